"""1P1D on real vLLM under load, as on GPUs: async scheduling on, and KV caches far smaller than the load.

Async scheduling is vLLM's default on GPUs (its CPU build turns it off; a test-only plugin, `tests/helpers/
async_scheduling`, keeps it on): the engine core schedules a step while the last one runs, so the connector's
scheduler side builds a step's metadata before the workers have reported the last step's transfers, and requests
that finish are known a step late.

The KV caches hold 20 blocks (2560 tokens) each, far fewer than the requests need at once, so vLLM preempts
requests (frees their blocks, and computes them again later). On the decode instance that is the usual case under
load; on the prefill instance it happens to prefill requests that go on decoding (`kv_both`, or a proxy that does
not cap the prefill at one token) after their prompt was saved: their blocks may then hold other KV before the
decode side pulls them, so the offer is withdrawn and the pull refused. A busy decode instance also queues requests
for blocks far longer than the prefill instance's lease (4 s here): while one waits, the decode instance asks the
prefill instance to keep its blocks, so its KV is still there when it gets blocks. Only the prefill instance has
the short lease (the decode instance keeps the default, 30 s): renewals follow the lease the prefill instance
says in its answer.

Every answer equals a colocated instance's, no load waits out its deadline, and nothing is left held."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from p2pkv.bench.router import STANDARD_PREFILL_PARAMS
from p2pkv.bench.soak import SoakResult, _drive
from p2pkv.params import DecodeParams, PrefillParams, parse_transfer_params
from tests.integration.conftest import (
    LOAD_FAILED,
    MAX_BATCHED_TOKENS,
    MAX_TOKENS,
    UpCluster,
    complete,
    greedy,
    ids_and_logprobs,
    kv_bytes,
    metric,
    prompt,
    two_steps,
    up_with_colocated,
)

pytestmark = pytest.mark.vllm
PLUGIN = Path(__file__).resolve().parents[1] / "helpers" / "async_scheduling"
BLOCKS = 20
LEASE_S = 4.0
RENEWED = 'p2pkv_lease_renewals_total{outcome="renewed"}'
PREEMPTIONS = "vllm:num_preemptions_total"
USAGE = "vllm:kv_cache_usage_perc"
LOADED = "p2pkv_bytes_loaded_total"
HELD_AGAIN = "computed its prompt again after a preemption; held again for a pull"


@pytest.fixture(scope="module")
def pressed(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpCluster]:
    vllm_args = ["--num-gpu-blocks-override", str(BLOCKS), "--max-model-len", "2048",
                 "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]
    extra = {"transfer_timeout_s": 5.0}
    prefill_only = ("--prefill-extra-config", json.dumps({"lease_s": LEASE_S}))
    work = tmp_path_factory.mktemp("pressed")
    # The oracle computes prompts in the same chunks as the prefill instance does, so that its KV is the one moved.
    same_chunks = ("--max-num-batched-tokens", str(MAX_BATCHED_TOKENS))
    with up_with_colocated(tiny_model, work, extra, vllm_args, prefill_only, {"PYTHONPATH": str(PLUGIN)},
                           same_chunks) as (proc, info, colocated):
        yield UpCluster(proc, info, colocated, tiny_model)


async def _all(base: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=600) as client:
        answers = await asyncio.gather(*(client.post(f"{base}/v1/completions", json=b) for b in bodies))
    for answer in answers:
        assert answer.status_code == 200, answer.text
    return [a.json() for a in answers]


def same_answer(answer: dict[str, Any], reference: dict[str, Any]) -> None:
    """The same tokens, log-probabilities within 1e-4 (test_disagg's criterion; KV of the wrong bytes moves them by
    1e-3 and more). Not bit for bit: the decode side computes the last prompt token alone, the colocated instance in
    its last chunk, and on CPUs with AMX oneDNN's GEMM for a long chunk rounds differently (3.5e-6 at 700 tokens)."""
    (ids, logprobs), (ref_ids, ref_logprobs) = ids_and_logprobs(answer), ids_and_logprobs(reference)
    assert ids == ref_ids
    assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < 1e-4


def _nothing_held(cluster: UpCluster) -> bool:
    prefill, decode = cluster.instance("kv_producer"), cluster.instance("kv_consumer")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not (metric(prefill["http"], USAGE) or metric(decode["http"], USAGE)
                or metric(decode["metrics"], "p2pkv_staging_bytes")):
            return True
        time.sleep(0.2)
    return False


def test_decode_requests_preempted_under_load_answer_as_colocated(pressed: UpCluster) -> None:
    """12 requests at once through the proxy, of prompts from 200 to 700 tokens and answers of 300: the decode
    instance cannot hold them all, and preempts some. Each prompt's KV was loaded, and each answer equals the
    colocated instance's."""
    decode = pressed.instance("kv_consumer")
    preempted = metric(decode["http"], PREEMPTIONS)
    lengths = [200 + 45 * i for i in range(12)]
    bodies = [{"model": pressed.model, "prompt": prompt(f"pressed{i}", n), "max_tokens": 300, "temperature": 0,
               "ignore_eos": True, "return_token_ids": True} for i, n in enumerate(lengths)]
    answers = asyncio.run(_all(pressed.proxy, bodies))
    assert metric(decode["http"], PREEMPTIONS) > preempted, "nothing was preempted: nothing to check"
    references = asyncio.run(_all(pressed.colocated, bodies))
    for n, answer, reference in zip(lengths, answers, references, strict=True):
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
        assert answer["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
    assert _nothing_held(pressed)


def test_prefill_requests_preempted_after_their_prompt_was_saved_hold_it_again(pressed: UpCluster) -> None:
    """GET prefill requests that go on decoding (500 tokens, 4 at once, sent to the prefill instance directly):
    the prefill instance preempts some after their prompts were saved and offered. Their offers are withdrawn (the
    blocks may hold other KV by then); resumed, each computes its prompt again, and its transfer is offered again
    from its new blocks. So every decode request naming one of them loads its prompt (no load fails), and its
    answer equals the colocated instance's."""
    prefill, decode = pressed.instance("kv_producer"), pressed.instance("kv_consumer")
    preempted, failed = metric(prefill["http"], PREEMPTIONS), metric(decode["metrics"], LOAD_FAILED)
    log = Path(pressed.info["log_dir"]) / "prefill0.log"
    held_again = log.read_text(errors="replace").count(HELD_AGAIN)
    texts = [prompt(f"pressed-prefill{i}", 300) for i in range(4)]

    async def both_steps(client: httpx.AsyncClient, text: str) -> dict[str, Any]:
        """Prefill, then at once (the lease here is 4 s) the decode request the answer names."""
        body = {"model": pressed.model, "prompt": text, "max_tokens": 500, "ignore_eos": True,
                "kv_transfer_params": PrefillParams(uuid.uuid4().hex, None, pull=True).to_dict()}
        first = await client.post(f"http://{prefill['http']}/v1/completions", json=body)
        assert first.status_code == 200, first.text
        params = parse_transfer_params(first.json()["kv_transfer_params"])
        assert isinstance(params, DecodeParams)
        body = {"model": pressed.model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0,
                "return_token_ids": True, "ignore_eos": True, "kv_transfer_params": params.to_dict()}
        answer = await client.post(f"http://{decode['http']}/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        out: dict[str, Any] = answer.json()
        return out

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=600) as client:
            return list(await asyncio.gather(*(both_steps(client, text) for text in texts)))

    answers = asyncio.run(run())
    assert metric(prefill["http"], PREEMPTIONS) > preempted, "nothing was preempted: nothing to check"
    assert log.read_text(errors="replace").count(HELD_AGAIN) > held_again, "no transfer was held again"
    for text, answer in zip(texts, answers, strict=True):
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 299
        assert answer["choices"][0]["token_ids"] == greedy(pressed.colocated, pressed.model, text)["choices"][0][
            "token_ids"]
    assert metric(decode["metrics"], LOAD_FAILED) == failed
    assert _nothing_held(pressed)


def test_a_pulled_transfer_is_kept_while_its_decode_request_waits_for_blocks(pressed: UpCluster) -> None:
    prefill, decode = pressed.instance("kv_producer"), pressed.instance("kv_consumer")
    failed, renewed = metric(decode["metrics"], LOAD_FAILED), metric(prefill["metrics"], RENEWED)
    text = prompt("waits-for-blocks", 400)

    async def run() -> tuple[dict[str, Any], float]:
        async with httpx.AsyncClient(timeout=600) as client:
            fillers = [asyncio.ensure_future(client.post(
                f"http://{decode['http']}/v1/completions",
                json={"model": pressed.model, "prompt": prompt(f"filler{i}", 300), "max_tokens": 1500,
                      "ignore_eos": True})) for i in range(6)]
            await asyncio.sleep(1.0)  # the fillers hold the decode instance's blocks
            params = PrefillParams(uuid.uuid4().hex, None, pull=True)
            answer = await client.post(f"http://{prefill['http']}/v1/completions", json={
                "model": pressed.model, "prompt": text, "max_tokens": 1, "kv_transfer_params": params.to_dict()})
            returned = parse_transfer_params(answer.json()["kv_transfer_params"])
            assert isinstance(returned, DecodeParams) and returned.pull and returned.lease_s == LEASE_S
            started = time.monotonic()
            decoded = await client.post(f"http://{decode['http']}/v1/completions", json={
                "model": pressed.model, "prompt": text, "max_tokens": 16, "temperature": 0, "logprobs": 1,
                "return_token_ids": True, "ignore_eos": True, "kv_transfer_params": returned.to_dict()})
            waited = time.monotonic() - started
            for filler in await asyncio.gather(*fillers):
                assert filler.status_code == 200, filler.text
            assert decoded.status_code == 200, decoded.text
            out: dict[str, Any] = decoded.json()
            return out, waited

    answer, waited = asyncio.run(run())
    assert waited > LEASE_S + 2, f"the request waited {waited:.1f} s: not past the lease, nothing to check"
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 399
    assert metric(decode["metrics"], LOAD_FAILED) == failed
    assert metric(prefill["metrics"], RENEWED) > renewed
    assert ids_and_logprobs(answer)[0] == ids_and_logprobs(greedy(pressed.colocated, pressed.model, text))[0]


def test_both_instances_step_with_async_scheduling(pressed: UpCluster) -> None:
    """The checks below ran what they claim: each instance's engine core stepped with a batch queue."""
    import sys

    sys.path.insert(0, str(PLUGIN))
    try:
        from p2pkv_test_async_scheduling import MARKER
    finally:
        sys.path.remove(str(PLUGIN))
    cluster = pressed
    logs = Path(cluster.info["log_dir"])
    greedy(cluster.proxy, cluster.model, prompt("async-warm", 40))
    stepped = sorted(p.name for p in logs.iterdir() if MARKER in p.read_text(errors="replace"))
    assert len(stepped) == 2, f"instances stepping with a batch queue: {stepped} of {sorted(logs.iterdir())}"


def test_answers_equal_colocated_and_every_prompt_is_loaded(pressed: UpCluster) -> None:
    """Prompts of one block to several, some prefilled in chunks (over 256 tokens): each answer's tokens and
    log-probabilities equal the colocated instance's, and the decode instance loaded every transfer's bytes."""
    cluster = pressed
    decode = cluster.instance("kv_consumer")
    before, expected = metric(decode["metrics"], LOADED), 0
    for i, length in enumerate([60, 129, 300, 700]):
        text = prompt(f"async{i}", length)
        answer = greedy(cluster.proxy, cluster.model, text)
        reference = greedy(cluster.colocated, cluster.model, text)
        same_answer(answer, reference)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == length - 1
        expected += kv_bytes(length)
    # A GET transfer (the decode side pulls), on the same instances.
    text = prompt("async-get", 400)
    returned, answer = two_steps(cluster, text, PrefillParams(uuid.uuid4().hex, None, pull=True))
    assert returned.pull
    same_answer(answer, greedy(cluster.colocated, cluster.model, text))
    expected += kv_bytes(400)
    assert metric(decode["metrics"], LOADED) - before == expected


def test_every_request_shape_is_served_and_nothing_is_left_held(pressed: UpCluster) -> None:
    """The soak's mixed requests, 8 at a time: plain, n = 3, batches, one-token prompts, a prompt the decode
    instance holds whole, prompt log-probabilities, streams, streamed batches, and clients that go away. None fails;
    afterwards neither instance holds KV and the decode side stages nothing."""
    cluster = pressed
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


def test_a_standard_prefill_whose_decode_request_never_comes_is_freed_at_lease_expiry(pressed: UpCluster) -> None:
    """A router's prefill request in vLLM's standard protocol (no p2pkv fields), whose client goes away before the
    decode request: the prefill instance holds the blocks for a pull, then frees them once its lease runs out."""
    prefill = pressed.instance("kv_producer")
    body = {"model": pressed.model, "prompt": prompt("standard-gone", 600), "max_tokens": 1,
            "max_completion_tokens": 1, "stream": False, "kv_transfer_params": dict(STANDARD_PREFILL_PARAMS)}
    answer = complete(f"http://{prefill['http']}", body)
    returned = parse_transfer_params(answer["kv_transfer_params"])
    assert isinstance(returned, DecodeParams) and returned.pull and returned.lease_s == LEASE_S
    assert answer["kv_transfer_params"]["remote_port"] == returned.prefill_kv.port  # type: ignore[union-attr]
    held_at = time.monotonic()
    assert metric(prefill["http"], USAGE) > 0, "the prefill instance holds nothing for the pull"
    while metric(prefill["http"], USAGE) > 0:
        assert time.monotonic() - held_at < LEASE_S + 15, "the blocks outlived the lease"
        time.sleep(0.2)
    assert time.monotonic() - held_at > LEASE_S - 1.5, "freed before the lease ran out"
