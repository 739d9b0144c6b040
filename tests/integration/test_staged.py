"""1P1D on real vLLM with the GPU path's logic (`P2PKV_STAGE_KV=1`): the decode instance opens the prefill
instance's exported cache and copies the blocks it needs straight into its own (cuda_ipc's protocol, with
process_vm_readv standing in for CUDA IPC): no host buffer on either side, output equal to a colocated instance.
The instances run PUT_ASYNC: the decode side asks in the handshake for pulls (`pull_over_device`), so the prefill
side leaves each transfer for it to pull; a GET request goes the same way."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from p2pkv.kv.staging import STAGE_ENV
from p2pkv.params import PrefillParams
from tests.integration.conftest import (
    LEFT,
    Oracle,
    UpCluster,
    greedy,
    ids_and_logprobs,
    kv_bytes,
    metric,
    prompt,
    two_steps,
    up_with_colocated,
)

pytestmark = pytest.mark.vllm
BY_REFERENCE = '{transport="host_ipc"}'
SERIES = {
    "by_reference_in": "p2pkv_bytes_received_total" + BY_REFERENCE,
    "by_reference_out": "p2pkv_bytes_sent_total" + BY_REFERENCE,
    "pushed_in_shm": 'p2pkv_bytes_received_total{transport="shm"}',
    "pushed_in_tcp": 'p2pkv_bytes_received_total{transport="tcp"}',
    "loaded": "p2pkv_bytes_loaded_total",
    "left": LEFT,
    "to_host": 'p2pkv_device_copy_bytes_total{direction="to_host"}',
    "to_device": 'p2pkv_device_copy_bytes_total{direction="to_device"}',
}


@pytest.fixture(scope="module")
def staged(tiny_model: str, tmp_path_factory: pytest.TempPathFactory, oracle: Oracle) -> Iterator[UpCluster]:
    with up_with_colocated(tiny_model, tmp_path_factory.mktemp("staged"), {"transfer_timeout_s": 5.0}, [], (),
                           {STAGE_ENV: "1"}, shared=oracle) as (proc, info, colocated):
        cluster = UpCluster(proc, info, colocated, tiny_model)
        # The first transfer opens the prefill worker's link to the decode worker; the layers its forward produced
        # before the handshake ended were copied to a host buffer (and then not sent). Later ones copy nothing.
        greedy(cluster.proxy, tiny_model, prompt("staged-warm", 40))
        yield cluster


def counters(cluster: UpCluster) -> dict[str, dict[str, float]]:
    return {role: {name: metric(cluster.instance(role)["metrics"], series) for name, series in SERIES.items()}
            for role in ("kv_producer", "kv_consumer")}


def moved(cluster: UpCluster, before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    after = counters(cluster)
    return {role: {k: after[role][k] - before[role][k] for k in after[role]} for role in after}


def check_cache_to_cache(delta: dict[str, dict[str, float]], expected: int) -> None:
    prefill, decode = delta["kv_producer"], delta["kv_consumer"]
    assert decode["by_reference_in"] == expected
    assert prefill["by_reference_out"] == expected
    assert decode["loaded"] == expected
    assert decode["pushed_in_shm"] == decode["pushed_in_tcp"] == 0, "no bytes were pushed"
    for side in (prefill, decode):  # nothing went through a host buffer
        assert side["to_host"] == side["to_device"] == 0


def test_put_async_is_left_for_the_decode_side_to_copy_cache_to_cache(staged: UpCluster) -> None:
    before = counters(staged)
    expected = 0
    for i, length in enumerate([60, 129, 300]):
        text = prompt(f"staged{i}", length)
        answer = greedy(staged.proxy, staged.model, text)
        reference = greedy(staged.colocated, staged.model, text)
        assert ids_and_logprobs(answer)[0] == ids_and_logprobs(reference)[0]
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == length - 1
        expected += kv_bytes(length)
    delta = moved(staged, before)
    check_cache_to_cache(delta, expected)
    assert delta["kv_producer"]["left"] == 3


def test_get_pulls_copy_cache_to_cache_and_match_colocated(staged: UpCluster) -> None:
    before = counters(staged)
    length = 200
    text = prompt("staged-get", length)
    returned, answer = two_steps(staged, text, PrefillParams(uuid.uuid4().hex, None, pull=True))
    assert returned.pull
    reference = greedy(staged.colocated, staged.model, text)
    assert ids_and_logprobs(answer)[0] == ids_and_logprobs(reference)[0]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == length - 1
    delta = moved(staged, before)
    check_cache_to_cache(delta, kv_bytes(length))
    assert delta["kv_producer"]["left"] == 0, "a GET transfer is offered, not pushed"
