"""1P1D on real vLLM with KV caches of 20 blocks (2560 tokens) each, far fewer than the requests need at once, so
vLLM preempts requests (frees their blocks, and computes them again later). On the decode instance that is the
usual case under load; on the prefill instance it happens to prefill requests that go on decoding (`kv_both`, or a
proxy that does not cap the prefill at one token) after their prompt was saved: their blocks may then hold other KV
before the decode side pulls them, so the offer is withdrawn and the pull refused. Either way every answer equals a
colocated instance's, no load waits out its deadline, and nothing is left held. A busy decode instance queues
requests for blocks far longer than the prefill instance's lease (4 s here): while one waits, the decode instance
asks the prefill instance to keep its blocks (every third of the lease), so its KV is still there when it gets
blocks, and is loaded rather than computed again on the busy instance."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from p2pkv.params import DecodeParams, PrefillParams, parse_transfer_params
from tests.integration.conftest import MAX_BATCHED_TOKENS, UpCluster, metric, up_with_colocated
from tests.integration.test_disagg import LOAD_FAILED, MAX_TOKENS, greedy, ids_and_logprobs, prompt

pytestmark = pytest.mark.vllm
BLOCKS = 20
LEASE_S = 4.0
RENEWED = 'p2pkv_lease_renewals_total{outcome="renewed"}'
PREEMPTIONS = "vllm:num_preemptions_total"
USAGE = "vllm:kv_cache_usage_perc"


@pytest.fixture(scope="module")
def pressed(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpCluster]:
    vllm_args = ["--num-gpu-blocks-override", str(BLOCKS), "--max-model-len", "2048",
                 "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]
    extra = {"transfer_timeout_s": 5.0, "lease_s": LEASE_S}
    with up_with_colocated(tiny_model, tmp_path_factory.mktemp("pressed"), extra, vllm_args) as (proc, info,
                                                                                                  colocated):
        yield UpCluster(proc, info, colocated, tiny_model)


async def _all(base: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=600) as client:
        answers = await asyncio.gather(*(client.post(f"{base}/v1/completions", json=b) for b in bodies))
    for answer in answers:
        assert answer.status_code == 200, answer.text
    return [a.json() for a in answers]


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


def test_prefill_requests_preempted_after_their_prompt_was_saved_are_not_pulled(pressed: UpCluster) -> None:
    """GET prefill requests that go on decoding (500 tokens, 4 at once, sent to the prefill instance directly):
    the prefill instance preempts some after their prompts were saved and offered. Their offers are withdrawn (the
    blocks may hold other KV by now), so a decode request naming such a transfer has its pull refused at once and
    computes the prompt itself, well before the pull's deadline (5 s); its answer equals the colocated
    instance's."""
    prefill, decode = pressed.instance("kv_producer"), pressed.instance("kv_consumer")
    preempted, failed = metric(prefill["http"], PREEMPTIONS), metric(decode["metrics"], LOAD_FAILED)
    texts = [prompt(f"pressed-prefill{i}", 300) for i in range(4)]
    bodies = [{"model": pressed.model, "prompt": text, "max_tokens": 500, "ignore_eos": True,
               "kv_transfer_params": PrefillParams(uuid.uuid4().hex, None, pull=True).to_dict()} for text in texts]
    returned = [parse_transfer_params(a["kv_transfer_params"]) for a in asyncio.run(_all(f"http://{prefill['http']}",
                                                                                        bodies))]
    assert metric(prefill["http"], PREEMPTIONS) > preempted, "nothing was preempted: nothing to check"
    for text, params in zip(texts, returned, strict=True):
        assert isinstance(params, DecodeParams)
        body = {"model": pressed.model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
                "return_token_ids": True, "ignore_eos": True, "kv_transfer_params": params.to_dict()}
        started = time.monotonic()
        answer = asyncio.run(_all(f"http://{decode['http']}", [body]))[0]
        assert time.monotonic() - started < 3
        assert answer["choices"][0]["token_ids"] == greedy(pressed.colocated, pressed.model, text)["choices"][0][
            "token_ids"]
    # Each preemption after a save withdrew that transfer: at least one decode load was refused.
    assert metric(decode["metrics"], LOAD_FAILED) > failed
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
            assert isinstance(returned, DecodeParams) and returned.pull
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
