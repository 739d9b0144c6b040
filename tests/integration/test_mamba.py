"""A Mamba hybrid through `p2pkv up` (1P1D, real vLLM): the tiny GraniteMoeHybrid with a Mamba2 mixer on every other
layer, so vLLM's hybrid KV cache manager keeps the attention KV and the Mamba state in two groups. The prefill
instance computes the prompt but its last token; the decode instance loads the attention blocks and the state after
those tokens, computes the last token from there, and answers as the prefill instance does when asked directly (a
request with no transfer, computed there as a colocated instance would)."""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from p2pkv.params import Address, DecodeParams, PrefillParams, parse_transfer_params
from p2pkv.tinymodel import TinyModelSpec, write_tiny_model
from tests.integration.conftest import (
    BLOCK_SIZE,
    MAX_BATCHED_TOKENS,
    MAX_TOKENS,
    complete,
    greedy,
    ids_and_logprobs,
    instance_of,
    kv_bytes_per_block_and_layer,
    loaded_as_direct,
    prompt,
    running_up,
)

LAYERS = TinyModelSpec().num_layers
MAX_LEN = TinyModelSpec().max_position_embeddings  # a Mamba group's block: the model's length


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    model = str(write_tiny_model(tmp_path_factory.mktemp("tiny-mamba"), TinyModelSpec(mamba=True)))
    work = tmp_path_factory.mktemp("up-mamba")
    # vLLM's CPU build runs Mamba2 with prefix caching off only; p2pkv moves the state after the prompt then
    with running_up(model, work, {"transfer_timeout_s": 5.0, "test_fault_injection": True},
                    ["--max-num-batched-tokens", str(MAX_BATCHED_TOKENS), "--no-enable-prefix-caching"]) as (_, info):
        yield {**info, "model": model, "logs": work / "logs"}


def test_a_mamba_hybrid_moves_its_attention_blocks_and_state_and_answers_as_computed_in_one_place(
        hybrid: dict[str, Any]) -> None:
    logs: Path = hybrid["logs"]
    decode_log = (logs / "decode0.log").read_text()
    assert f"kv cache group sizes ({MAX_LEN}, {BLOCK_SIZE})" in decode_log, "vLLM's hybrid manager is off"
    # vLLM pads a Mamba layer's state to the attention layers' page: a layer-block either way
    page = kv_bytes_per_block_and_layer()
    for length in (60, 129, 300, 700):  # 700 tokens: the prefill computes 699 in three chunks
        text = prompt(f"mamba-{length}", length)
        received, loaded = loaded_as_direct(hybrid, text, length)
        # The prefill computes all but the last token: its blocks for the attention layers, one state per mixer
        blocks = math.ceil((length - 1) / BLOCK_SIZE)
        assert received == (LAYERS // 2 * blocks + LAYERS // 2) * page, length
        assert loaded == received, length


def test_a_damaged_state_changes_the_answer(hybrid: dict[str, Any]) -> None:
    """The negative control: the same two steps by hand, the decode side told to damage what it loads (fault
    injection), answers otherwise; undamaged, as asked directly."""
    prefill, decode = instance_of(hybrid, "kv_producer"), instance_of(hybrid, "kv_consumer")
    text = prompt("mamba-damaged", 300)
    here = ids_and_logprobs(greedy(f"http://{prefill['http']}", hybrid["model"], text))[0]
    answers = []
    for corrupt in (False, True):
        params = PrefillParams(uuid.uuid4().hex, Address.parse(decode["kv"]))
        body = {"model": hybrid["model"], "prompt": text, "max_tokens": 1, "kv_transfer_params": params.to_dict()}
        returned = parse_transfer_params(complete(f"http://{prefill['http']}", body)["kv_transfer_params"])
        assert isinstance(returned, DecodeParams) and returned.num_prompt_tokens == 300
        # No logprobs: damaged floats may be NaN, which JSON cannot carry
        body = {"model": hybrid["model"], "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0,
                "return_token_ids": True, "ignore_eos": True,
                "kv_transfer_params": dataclasses.replace(returned, test_corrupt=corrupt).to_dict()}
        answer = complete(f"http://{decode['http']}", body)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 299
        answers.append(answer["choices"][0]["token_ids"])
    assert answers[0] == here and answers[1] != here
