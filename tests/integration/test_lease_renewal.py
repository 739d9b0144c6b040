"""1P1D on real vLLM where the decode instance is busy: its KV cache holds 20 blocks (2560 tokens), and long requests
of its own fill it, so a request whose KV the prefill instance holds for a pull (GET) waits in vLLM's queue for
blocks far longer than the prefill instance's lease (4 s here). While it waits, the decode instance asks the prefill
instance to keep the blocks (every third of the lease), so the KV is still there when the request gets its blocks:
it is loaded, not computed again on the busy instance."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from p2pkv.params import DecodeParams, PrefillParams, parse_transfer_params
from tests.integration.conftest import UpCluster, metric, up_with_colocated
from tests.integration.test_disagg import LOAD_FAILED, greedy, ids_and_logprobs, prompt

pytestmark = pytest.mark.vllm
LEASE_S = 4.0
RENEWED = 'p2pkv_lease_renewals_total{outcome="renewed"}'


@pytest.fixture(scope="module")
def busy(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpCluster]:
    extra = {"transfer_timeout_s": 5.0, "lease_s": LEASE_S}
    vllm_args = ["--num-gpu-blocks-override", "20", "--max-model-len", "2048"]
    with up_with_colocated(tiny_model, tmp_path_factory.mktemp("busy"), extra, vllm_args) as (proc, info, colocated):
        yield UpCluster(proc, info, colocated, tiny_model)


def test_a_pulled_transfer_is_kept_while_its_decode_request_waits_for_blocks(busy: UpCluster) -> None:
    prefill, decode = busy.instance("kv_producer"), busy.instance("kv_consumer")
    failed, renewed = metric(decode["metrics"], LOAD_FAILED), metric(prefill["metrics"], RENEWED)
    text = prompt("waits-for-blocks", 400)

    async def run() -> tuple[dict[str, Any], float]:
        async with httpx.AsyncClient(timeout=600) as client:
            fillers = [asyncio.ensure_future(client.post(
                f"http://{decode['http']}/v1/completions",
                json={"model": busy.model, "prompt": prompt(f"filler{i}", 300), "max_tokens": 1500,
                      "ignore_eos": True})) for i in range(6)]
            await asyncio.sleep(1.0)  # the fillers hold the decode instance's blocks
            params = PrefillParams(uuid.uuid4().hex, None, pull=True)
            answer = await client.post(f"http://{prefill['http']}/v1/completions", json={
                "model": busy.model, "prompt": text, "max_tokens": 1, "kv_transfer_params": params.to_dict()})
            returned = parse_transfer_params(answer.json()["kv_transfer_params"])
            assert isinstance(returned, DecodeParams) and returned.pull
            started = time.monotonic()
            decoded = await client.post(f"http://{decode['http']}/v1/completions", json={
                "model": busy.model, "prompt": text, "max_tokens": 16, "temperature": 0, "logprobs": 1,
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
    assert ids_and_logprobs(answer)[0] == ids_and_logprobs(greedy(busy.colocated, busy.model, text))[0]
