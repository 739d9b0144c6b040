"""Prefill and decode of different tensor-parallel sizes, on real vLLM through the proxy (`p2pkv up --prefill-tp
--decode-tp`): each decode rank pulls its KV heads from the prefill ranks that hold them. Decode TP 1 from prefill
TP 2 (one rank gathers from two) with the GPU path's logic (`P2PKV_STAGE_KV=1`): the decode rank copies each prefill
rank's heads from that rank's exported cache into its own (by reference: host_ipc, cuda_ipc's CPU stand-in). Output
equals a colocated instance. Two decode ranks splitting one prefill rank's heads (decode TP 2) run in `test_pp`,
with other pipeline-parallel sizes too, so that CI starts one cluster fewer."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from p2pkv.kv.staging import STAGE_ENV
from p2pkv.params import Address, DecodeParams, PrefillParams, parse_transfer_params
from tests.integration.conftest import (
    MAX_TOKENS,
    Oracle,
    complete,
    greedy,
    ids_and_logprobs,
    instance_of,
    multi_rank_cluster,
    per_rank,
    prompt,
    served_like_colocated,
)

pytestmark = pytest.mark.vllm
BY_REFERENCE = '{transport="host_ipc"}'
CHECKED = 'p2pkv_digests_total{direction="pull",outcome="ok"}'
MISMATCHED = 'p2pkv_digests_total{direction="pull",outcome="mismatch"}'


@pytest.fixture(scope="module", params=[(2, 1)], ids=["p2d1-staged"])
def tp_cluster(request: pytest.FixtureRequest, tiny_model: str, tmp_path_factory: pytest.TempPathFactory,
               oracle: Oracle) -> Iterator[dict[str, Any]]:
    prefill_tp, decode_tp = request.param
    # PUT_ASYNC: the proxy asks for pulls.
    env = {STAGE_ENV: "1"} if prefill_tp > decode_tp else {}
    up_args = ("--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp))
    with multi_rank_cluster(tiny_model, tmp_path_factory.mktemp("tp"), up_args, oracle, env) as info:
        yield info


def _total(instance: dict[str, Any], series: str) -> float:
    """A series summed over the instance's ranks."""
    return sum(per_rank(instance, series))


def test_each_rank_pulls_its_heads_and_output_matches_colocated(tp_cluster: dict[str, Any]) -> None:
    prefill, decode = instance_of(tp_cluster, "kv_producer"), instance_of(tp_cluster, "kv_consumer")
    assert prefill["tp_size"] != decode["tp_size"]
    series = [(decode, "p2pkv_bytes_loaded_total"), (decode, "p2pkv_bytes_received_total" + BY_REFERENCE),
              (prefill, "p2pkv_bytes_sent_total" + BY_REFERENCE),
              (decode, 'p2pkv_transfers_total{direction="pull",outcome="ok"}'), (decode, CHECKED),
              (decode, MISMATCHED)]
    before = [_total(instance, name) for instance, name in series]
    expected = sum(served_like_colocated(tp_cluster, f"tp{i}", length)
                   for i, length in enumerate([60, 129, 300, 700]))
    loaded, received, sent, pulls, checked, mismatched = (
        _total(instance, name) - b for (instance, name), b in zip(series, before, strict=True))
    # Every head of every block went once, cache to cache: the ranks' loads add up to the whole KV of the prompts.
    assert loaded == received == sent == expected
    assert pulls == 4 * max(prefill["tp_size"], decode["tp_size"])  # one per (prefill rank, decode rank) pair here
    # integrity_check: each pull's heads were digested in the prefill rank's cache and where they landed.
    assert checked == pulls and mismatched == 0


def test_negative_control_corrupted_kv_changes_the_output(tp_cluster: dict[str, Any]) -> None:
    prefill, decode = instance_of(tp_cluster, "kv_producer"), instance_of(tp_cluster, "kv_consumer")
    answers = []
    for corrupt in (False, True):
        text = prompt("tp-control", 300)
        params = PrefillParams(uuid.uuid4().hex, Address.parse(decode["kv"]), decode_tp=decode["tp_size"])
        body = {"model": tp_cluster["model"], "prompt": text, "max_tokens": 1,
                "kv_transfer_params": params.to_dict()}
        returned = parse_transfer_params(complete(f"http://{prefill['http']}", body)["kv_transfer_params"])
        assert isinstance(returned, DecodeParams) and returned.pull
        assert returned.prefill_tp == prefill["tp_size"]
        returned = dataclasses.replace(returned, test_corrupt=corrupt)
        body = {"model": tp_cluster["model"], "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0,
                "logprobs": 1, "return_token_ids": True, "ignore_eos": True,
                "kv_transfer_params": returned.to_dict()}
        answer = complete(f"http://{decode['http']}", body)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 299
        answers.append(ids_and_logprobs(answer))
    reference = ids_and_logprobs(greedy(tp_cluster["colocated"], tp_cluster["model"], prompt("tp-control", 300)))
    assert answers[0][0] == reference[0]
    assert answers[1] != reference


def test_a_prompt_the_decode_instance_holds_whole_releases_what_each_prefill_rank_holds(
        tp_cluster: dict[str, Any]) -> None:
    """Sent twice through the proxy, the second time the decode instance loads nothing. The prefill ranks hold their
    heads for its pulls (another size: always pulled); the decode rank releases each at once, as it would have
    pulled it, rather than at the end of their 30-s lease."""
    import time

    from tests.integration.conftest import BLOCK_SIZE, metric

    prefill, decode = instance_of(tp_cluster, "kv_producer"), instance_of(tp_cluster, "kv_consumer")
    text = prompt("tp-whole", 2 * BLOCK_SIZE + 1)
    reference = ids_and_logprobs(greedy(tp_cluster["colocated"], tp_cluster["model"], text))[0]
    assert ids_and_logprobs(greedy(tp_cluster["proxy"], tp_cluster["model"], text))[0] == reference
    loaded = _total(decode, "p2pkv_bytes_loaded_total")
    assert ids_and_logprobs(greedy(tp_cluster["proxy"], tp_cluster["model"], text))[0] == reference
    assert _total(decode, "p2pkv_bytes_loaded_total") == loaded
    deadline = time.monotonic() + 5
    while metric(prefill["http"], "vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(prefill["http"], "vllm:kv_cache_usage_perc") == 0
