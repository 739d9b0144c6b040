"""Pipeline parallelism on real vLLM through the proxy (`p2pkv up --prefill-pp N --decode-pp M`): each pipeline
stage holds some of the model's layers. With equal sizes (PP 2 to PP 2), stage s of the prefill instance moves its
layers to stage s of the decode instance (ranks bind `kv_port + stage * tp_size + tp_rank`), pushed. With other
sizes on both axes (PP 2 x TP 1 prefill to PP 1 x TP 2 decode), each decode rank pulls its heads of every layer
from the two prefill stages that hold them. Output equals a colocated instance, pushed and pulled, with the sizes
passed by the proxy or not. (`test_tp` covers other tensor-parallel sizes alone.)"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from p2pkv.params import Address, DecodeParams, PrefillParams, parse_transfer_params
from tests.integration.conftest import (
    BLOCK_SIZE,
    LAYERS,
    MAX_TOKENS,
    Oracle,
    complete,
    greedy,
    ids_and_logprobs,
    instance_of,
    kv_bytes_per_block_and_layer,
    multi_rank_cluster,
    per_rank,
    prompt,
    served_like_colocated,
)

pytestmark = pytest.mark.vllm
SHM = '{transport="shm"}'
PULLS = 'p2pkv_transfers_total{direction="pull",outcome="ok"}'
CHECKED = 'p2pkv_digests_total{{direction="{}",outcome="ok"}}'  # integrity_check: payloads whose digest matched


@pytest.fixture(scope="module", params=[(2, 1, 2, 1), (2, 1, 1, 2)], ids=["pp2-pp2", "pp2tp1-pp1tp2"])
def pp_cluster(request: pytest.FixtureRequest, tiny_model: str, tmp_path_factory: pytest.TempPathFactory,
               oracle: Oracle) -> Iterator[dict[str, Any]]:
    prefill_pp, prefill_tp, decode_pp, decode_tp = request.param
    up_args = ("--prefill-pp", str(prefill_pp), "--prefill-tp", str(prefill_tp), "--decode-pp", str(decode_pp),
               "--decode-tp", str(decode_tp))
    # Compiled: in eager mode vLLM's CPU build never allocates a later stage's intermediate tensors (its warm-up,
    # which does, is skipped) and that stage fails its first step.
    with multi_rank_cluster(tiny_model, tmp_path_factory.mktemp("pp"), up_args, oracle, compiled=True) as info:
        yield info


def _delta(after: list[float], before: list[float]) -> list[float]:
    return [a - b for a, b in zip(after, before, strict=True)]


def _same_sizes(info: dict[str, Any]) -> bool:
    prefill, decode = instance_of(info, "kv_producer"), instance_of(info, "kv_consumer")
    return all(prefill[k] == decode[k] for k in ("tp_size", "pp_size"))


def test_each_stage_gets_its_own_layers_and_output_matches_colocated(pp_cluster: dict[str, Any]) -> None:
    prefill, decode = instance_of(pp_cluster, "kv_producer"), instance_of(pp_cluster, "kv_consumer")
    series = [(decode, "p2pkv_bytes_loaded_total"), (decode, "p2pkv_bytes_received_total" + SHM),
              (prefill, "p2pkv_bytes_sent_total" + SHM), (decode, PULLS), (decode, CHECKED.format("pull")),
              (decode, CHECKED.format("receive"))]
    before = [per_rank(instance, name) for instance, name in series]
    lengths = [60, 129, 300, 700]
    expected = sum(served_like_colocated(pp_cluster, f"pp{i}", length) for i, length in enumerate(lengths))
    loaded, received, sent, pulls, pulls_checked, pushes_checked = (
        _delta(per_rank(instance, name), b) for (instance, name), b in zip(series, before, strict=True))
    # The decode side's two ranks (two stages of two layers, or two ranks of half the heads) each got exactly its
    # half of every prompt's KV.
    assert loaded == [expected / 2, expected / 2]
    if _same_sizes(pp_cluster):
        # Pushed stage to stage: every block of the prompt (the decode side loads all but the last token's).
        pushed = sum(math.ceil(n / BLOCK_SIZE) for n in lengths) * kv_bytes_per_block_and_layer() * LAYERS
        assert received == sent == [pushed / 2, pushed / 2]
        assert pulls == [0, 0]
        assert all(n >= len(lengths) for n in pushes_checked)  # each rank: one frame of a transfer or more
    else:
        # Pulled: each decode rank its heads of each prefill stage's layers, once per request and stage. Each
        # prefill stage sent its half of the layers.
        assert received == loaded and sent == [expected / 2, expected / 2]
        assert pulls == [2 * len(lengths), 2 * len(lengths)]
        assert pulls_checked == pulls  # one frame per pull


def _prefill_then_decode(info: dict[str, Any], text: str, params: PrefillParams,
                         corrupt: bool = False) -> tuple[DecodeParams, dict[str, Any]]:
    """The prefill request straight to the prefill instance, then the decode request with what it returned."""
    prefill, decode = instance_of(info, "kv_producer"), instance_of(info, "kv_consumer")
    body = {"model": info["model"], "prompt": text, "max_tokens": 1, "kv_transfer_params": params.to_dict()}
    returned = parse_transfer_params(complete(f"http://{prefill['http']}", body)["kv_transfer_params"])
    assert isinstance(returned, DecodeParams)
    assert returned.prefill_pp == prefill["pp_size"]
    sent = dataclasses.replace(returned, test_corrupt=corrupt)
    body = {"model": info["model"], "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "return_token_ids": True, "ignore_eos": True, "kv_transfer_params": sent.to_dict()}
    return returned, complete(f"http://{decode['http']}", body)


def test_pulls_and_a_corrupted_load_changes_the_output(pp_cluster: dict[str, Any]) -> None:
    decode = instance_of(pp_cluster, "kv_consumer")
    before = per_rank(decode, PULLS)
    answers, references = [], []
    for corrupt, tag in ((False, "pp-get"), (True, "pp-get-corrupt")):
        text = prompt(tag, 300)
        references.append(ids_and_logprobs(greedy(pp_cluster["colocated"], pp_cluster["model"], text)))
        params = PrefillParams(uuid.uuid4().hex, Address.parse(decode["kv"]), pull=True, decode_tp=decode["tp_size"],
                               decode_pp=decode["pp_size"])
        returned, answer = _prefill_then_decode(pp_cluster, text, params, corrupt)
        assert returned.pull
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 299
        answers.append(ids_and_logprobs(answer))
    assert answers[0][0] == references[0][0]
    assert answers[1] != references[1]
    # Per request, each decode rank pulled from the one prefill rank of its stage, or from both prefill stages.
    per_request = 1 if _same_sizes(pp_cluster) else 2
    assert _delta(per_rank(decode, PULLS), before) == [2 * per_request, 2 * per_request]


def test_a_proxy_that_does_not_pass_the_sizes_still_moves_the_kv(pp_cluster: dict[str, Any]) -> None:
    # An older proxy says nothing of the decode side's sizes. Equal sizes: pushed as usual. Other sizes: each
    # prefill stage's push reaches a decode rank that holds other heads and layers, which refuses it; the prefill
    # side then holds the blocks, and the decode ranks, told the prefill side's sizes, pull what they hold.
    decode = instance_of(pp_cluster, "kv_consumer")
    text = prompt("pp-legacy", 300)
    reference = ids_and_logprobs(greedy(pp_cluster["colocated"], pp_cluster["model"], text))
    _, answer = _prefill_then_decode(pp_cluster, text, PrefillParams(uuid.uuid4().hex, Address.parse(decode["kv"])))
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 299
    assert ids_and_logprobs(answer)[0] == reference[0]
