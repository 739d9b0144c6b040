"""Every GPU plane moves one request with a number of device operations that does not grow with its number of
blocks: counted through a device layer that records and moves nothing, for Llama-3-8B's geometry (512 blocks x 32
layers, which one operation per block and layer made 16,384), against the same request of 64 blocks."""

from __future__ import annotations

import math
import re

import pytest

from p2pkv.bench.plan import Geometry, measure
from p2pkv.cli.main import main as cli
from p2pkv.kv.staging import SCRATCH_BYTES


def test_device_operations_do_not_grow_with_the_blocks() -> None:
    big, small = Geometry(blocks=512), Geometry(blocks=64)
    counts = {c.plane: c for c in measure(big, repeats=2)}
    few = {c.plane: c for c in measure(small, repeats=2)}
    assert set(counts) == {"cuda_ipc", "staging push", "staging land", "staged push landing", "nccl send",
                           "nccl receive", "head slice (TP 1 -> 2)"}
    request = big.layers * big.blocks * big.block_bytes
    chunks = math.ceil(request / SCRATCH_BYTES)
    for plane, cost in counts.items():
        if cost.per_layer:  # one layer's copy as the forward computes it: a copy and a gather or scatter
            assert cost.operations <= 2 * big.layers + 1, (plane, cost.operations)
            assert cost.operations == few[plane].operations, plane
        else:  # the whole request, per chunk of scratch: its indices (one or two uploads), a gather, a scatter or copy
            assert cost.operations <= 4 * chunks, (plane, cost.operations)
            assert few[plane].operations <= 4 * math.ceil(request // 8 / SCRATCH_BYTES), plane
        assert cost.operations < big.layers * big.blocks / 100


def test_the_benchmark_prints_the_host_time_of_each_plane(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli(["bench", "plan", "--layers", "4", "--blocks", "32", "--repeats", "2"])
    out = capsys.readouterr().out
    rows = [re.search(r"(\d+\.\d+)  (met|NOT met)$", line) for line in out.splitlines()[2:]]
    assert len(rows) == 7 and all(row is not None and float(row[1]) > 0 for row in rows), out
    assert "4 layers, 8 KV heads of 128, 16-token blocks, bf16" in out
    assert code == (0 if all(row is not None and row[2] == "met" for row in rows) else 1)
