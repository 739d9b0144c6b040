"""Data-parallel instances on real vLLM through the proxy (`p2pkv up --prefill-dp 2 --decode-dp 2`): each instance
is one API server in front of two engines. Each engine binds KV ports of its own and announces itself with its
rank; the proxy pins a request's prefill and its decode to one engine each (`X-data-parallel-rank`), so the KV
pushed to a decode engine's workers is where its request is decoded. Output equals a colocated instance."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from p2pkv.params import Address, DecodeParams, PrefillParams, parse_transfer_params
from p2pkv.proxy.instances import DP_RANK_HEADER
from p2pkv.proxy.trace import DECODE_HEADER, PREFILL_HEADER
from tests.integration.conftest import (
    MAX_TOKENS,
    Oracle,
    greedy,
    ids_and_logprobs,
    instance_of,
    multi_rank_cluster,
    prompt,
    vllm_series,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def dp_cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory,
               oracle: Oracle) -> Iterator[dict[str, Any]]:
    with multi_rank_cluster(tiny_model, tmp_path_factory.mktemp("dp"), ("--prefill-dp", "2", "--decode-dp", "2"),
                            oracle) as info:
        yield info


def test_the_proxy_knows_each_engine_by_its_rank_and_kv_address(dp_cluster: dict[str, Any]) -> None:
    listed = httpx.get(f"{dp_cluster['proxy']}/instances", timeout=10).json()["instances"]
    for role, name in (("kv_producer", "prefill"), ("kv_consumer", "decode")):
        instance = instance_of(dp_cluster, role)
        assert instance["dp_size"] == 2
        kv = Address.parse(instance["kv"])
        engines = {e["dp_rank"]: e for e in listed if e["role"] == name}
        assert set(engines) == {0, 1}
        for rank, engine in engines.items():
            assert engine["address"] == instance["http"] and engine["source"] == "heartbeat"
            # Engine d's workers bind the instance's KV port + d * (workers per engine).
            assert engine["kv_address"] == str(kv.offset(rank))


def test_each_request_is_decoded_by_the_engine_its_kv_went_to(dp_cluster: dict[str, Any]) -> None:
    prefill, decode = instance_of(dp_cluster, "kv_producer"), instance_of(dp_cluster, "kv_consumer")
    loads = {rank: vllm_series(decode["http"], "vllm:p2pkv_transfers_total", direction="load", outcome="ok",
                               engine=str(rank)) for rank in (0, 1)}
    used: Counter[tuple[str, str]] = Counter()
    for i, length in enumerate([60, 129, 300, 385, 700, 200, 131, 256]):
        text = prompt(f"dp{i}", length)
        body = {"model": dp_cluster["model"], "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0,
                "logprobs": 1, "return_token_ids": True, "ignore_eos": True}
        resp = httpx.post(f"{dp_cluster['proxy']}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        reference = greedy(dp_cluster["colocated"], dp_cluster["model"], text)
        assert ids_and_logprobs(answer)[0] == ids_and_logprobs(reference)[0]
        # Every prompt token but the last came with the transfer, on the engine that decoded it.
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == length - 1, resp.headers[DECODE_HEADER]
        used[resp.headers[PREFILL_HEADER], resp.headers[DECODE_HEADER]] += 1
    prefills = {p for p, _ in used}
    decodes = Counter({d: sum(n for (_, dd), n in used.items() if dd == d) for _, d in used})
    assert prefills == {f"{prefill['http']}#0", f"{prefill['http']}#1"}
    assert set(decodes) == {f"{decode['http']}#0", f"{decode['http']}#1"}
    # vLLM's metrics count each engine's loads apart (its `engine` label is the rank): they match the routing.
    for rank in (0, 1):
        got = vllm_series(decode["http"], "vllm:p2pkv_transfers_total", direction="load", outcome="ok",
                          engine=str(rank)) - loads[rank]
        assert got == decodes[f"{decode['http']}#{rank}"]


def test_a_decode_engine_pulls_from_the_prefill_engine_that_holds_the_blocks(dp_cluster: dict[str, Any]) -> None:
    """GET by hand, across engines: prefill engine 1 holds the blocks and names its own KV address; decode engine 0
    pulls from there."""
    prefill, decode = instance_of(dp_cluster, "kv_producer"), instance_of(dp_cluster, "kv_consumer")
    length = 300
    text = prompt("dp-get", length)
    params = PrefillParams(uuid.uuid4().hex, None, pull=True)
    body = {"model": dp_cluster["model"], "prompt": text, "max_tokens": 1, "kv_transfer_params": params.to_dict()}
    resp = httpx.post(f"http://{prefill['http']}/v1/completions", json=body, headers={DP_RANK_HEADER: "1"},
                      timeout=120)
    assert resp.status_code == 200, resp.text
    returned = parse_transfer_params(resp.json()["kv_transfer_params"])
    assert isinstance(returned, DecodeParams) and returned.pull
    assert returned.prefill_kv == Address.parse(prefill["kv"]).offset(1)
    body = {"model": dp_cluster["model"], "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True, "logprobs": 1, "kv_transfer_params": returned.to_dict()}
    resp = httpx.post(f"http://{decode['http']}/v1/completions", json=body, headers={DP_RANK_HEADER: "0"},
                      timeout=120)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == length - 1
    reference = greedy(dp_cluster["colocated"], dp_cluster["model"], text)
    assert ids_and_logprobs(answer)[0] == ids_and_logprobs(reference)[0]
