"""A hybrid model through `p2pkv up` (1P1D, real vLLM): the tiny Llama with a sliding window of 128 tokens on every
other layer, so vLLM's hybrid KV cache manager keeps its KV in two groups. The decode instance loads the prompt
(all but its last token) and answers as the prefill instance does when asked directly (a request with no
transfer, computed there as a colocated instance would); the window layers move only the blocks the last token's
window reads."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from p2pkv.tinymodel import TinyModelSpec, write_tiny_model
from tests.integration.conftest import (
    BLOCK_SIZE,
    MAX_BATCHED_TOKENS,
    kv_bytes_per_block_and_layer,
    loaded_as_direct,
    prompt,
    running_up,
)

WINDOW = 128
LAYERS = TinyModelSpec().num_layers


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    model = str(write_tiny_model(tmp_path_factory.mktemp("tiny-swa"), TinyModelSpec(sliding_window=WINDOW)))
    work = tmp_path_factory.mktemp("up-hybrid")
    with running_up(model, work, {"transfer_timeout_s": 5.0},
                    ["--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]) as (_, info):
        yield {**info, "model": model, "logs": work / "logs"}


def test_a_sliding_window_model_moves_each_groups_blocks_and_answers_as_computed_in_one_place(
        hybrid: dict[str, Any]) -> None:
    logs: Path = hybrid["logs"]
    decode_log = (logs / "decode0.log").read_text()
    assert "kv cache group sizes (128, 128)" in decode_log, "vLLM's hybrid manager is off: one group"
    assert "Turning off hybrid kv cache manager" not in decode_log
    per_layer_block = kv_bytes_per_block_and_layer()
    for length in (60, 129, 300, 700):  # 700 tokens: 6 blocks, of which the window reads the last 2
        text = prompt(f"hybrid-{length}", length)
        received, loaded = loaded_as_direct(hybrid, text, length)
        blocks = math.ceil(length / BLOCK_SIZE)
        window_blocks = blocks - max(0, length - WINDOW) // BLOCK_SIZE
        full_layers = LAYERS // 2
        assert received == (full_layers * blocks + (LAYERS - full_layers) * window_blocks) * per_layer_block, length
        # The decode side lands all but the last token's block when that token opens one; the window layers from
        # the first block the window reads.
        landed = math.ceil((length - 1) / BLOCK_SIZE)
        window_landed = landed - max(0, length - WINDOW) // BLOCK_SIZE
        assert loaded == (full_layers * landed + (LAYERS - full_layers) * window_landed) * per_layer_block, length
