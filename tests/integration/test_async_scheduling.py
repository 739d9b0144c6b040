"""1P1D on real vLLM with async scheduling, which vLLM turns on by default on GPUs (its CPU build turns it off; a
test-only plugin, `tests/helpers/async_scheduling`, keeps it on). The engine core then schedules a step while the
last one runs, so the connector's scheduler side builds a step's metadata before the workers have reported the
last step's transfers, and requests that finish are known a step late. Answers must still equal a colocated
instance's, every transfer's KV must be loaded, and nothing may be left held, under every request shape the soak
sends (clients that go away included)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from p2pkv.bench.soak import SoakResult, _drive
from p2pkv.params import PrefillParams
from tests.integration.conftest import MAX_BATCHED_TOKENS, UpCluster, metric, up_with_colocated
from tests.integration.test_disagg import greedy, ids_and_logprobs, prompt, two_steps
from tests.integration.test_staged import kv_bytes

pytestmark = pytest.mark.vllm
PLUGIN = Path(__file__).resolve().parents[1] / "helpers" / "async_scheduling"
LOADED = "p2pkv_bytes_loaded_total"
USAGE = "vllm:kv_cache_usage_perc"


@pytest.fixture(scope="module")
def async_cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UpCluster, Path]]:
    work = tmp_path_factory.mktemp("async")
    vllm_args = ["--async-scheduling", "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]
    with up_with_colocated(tiny_model, work, {"transfer_timeout_s": 5.0}, vllm_args, (),
                           {"PYTHONPATH": str(PLUGIN)}) as (proc, info, colocated):
        yield UpCluster(proc, info, colocated, tiny_model), work / "logs"


def test_both_instances_step_with_async_scheduling(async_cluster: tuple[UpCluster, Path]) -> None:
    """The checks below ran what they claim: each instance's engine core stepped with a batch queue."""
    import sys

    sys.path.insert(0, str(PLUGIN))
    try:
        from p2pkv_test_async_scheduling import MARKER
    finally:
        sys.path.remove(str(PLUGIN))
    cluster, logs = async_cluster
    greedy(cluster.proxy, cluster.model, prompt("async-warm", 40))
    stepped = sorted(p.name for p in logs.iterdir() if MARKER in p.read_text(errors="replace"))
    assert len(stepped) == 2, f"instances stepping with a batch queue: {stepped} of {sorted(logs.iterdir())}"


def test_answers_equal_colocated_and_every_prompt_is_loaded(async_cluster: tuple[UpCluster, Path]) -> None:
    """Prompts of one block to several, some prefilled in chunks (over 256 tokens): each answer's tokens and
    log-probabilities equal the colocated instance's, and the decode instance loaded every transfer's bytes."""
    cluster, _ = async_cluster
    decode = cluster.instance("kv_consumer")
    before, expected = metric(decode["metrics"], LOADED), 0
    for i, length in enumerate([60, 129, 300, 700]):
        text = prompt(f"async{i}", length)
        answer = greedy(cluster.proxy, cluster.model, text)
        reference = greedy(cluster.colocated, cluster.model, text)
        assert ids_and_logprobs(answer) == ids_and_logprobs(reference)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == length - 1
        expected += kv_bytes(length)
    # A GET transfer (the decode side pulls), on the same instances.
    text = prompt("async-get", 400)
    returned, answer = two_steps(cluster, text, PrefillParams(uuid.uuid4().hex, None, pull=True))
    assert returned.pull
    assert ids_and_logprobs(answer) == ids_and_logprobs(greedy(cluster.colocated, cluster.model, text))
    expected += kv_bytes(400)
    assert metric(decode["metrics"], LOADED) - before == expected


def test_every_request_shape_is_served_and_nothing_is_left_held(async_cluster: tuple[UpCluster, Path]) -> None:
    """The soak's mixed requests, 8 at a time: plain, n = 3, batches, one-token prompts, a prompt the decode
    instance holds whole, prompt log-probabilities, streams, streamed batches, and clients that go away. None fails;
    afterwards neither instance holds KV and the decode side stages nothing."""
    cluster, _ = async_cluster
    result = SoakResult(90, 0, 0.0)
    asyncio.run(_drive(cluster.proxy, cluster.model, 90, 8, 45, asyncio.Event(), result, mixed=True))
    assert result.failures == 0
    assert result.left > 0
    prefill, decode = cluster.instance("kv_producer"), cluster.instance("kv_consumer")

    def held() -> list[float]:
        return [metric(prefill["http"], USAGE), metric(decode["http"], USAGE),
                metric(decode["metrics"], "p2pkv_staging_bytes")]

    deadline = time.monotonic() + 5
    while any(held()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert held() == [0, 0, 0]
    assert httpx.get(f"{cluster.proxy}/health", timeout=10).status_code == 200
