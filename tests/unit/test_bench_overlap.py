"""`p2pkv bench overlap` runs the connector's worker sides in two processes, a paced device layer on the prefill
side, over tcp and shm, and plots per-layer lags (its targets are for the benchmark command on a quiet machine;
here only that each layer crossed before the next one was ready)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the worker sides' metadata is vLLM's connector metadata class")

from p2pkv.bench.overlap import plot, run
from p2pkv.kv.staging import STAGE_ENV
from p2pkv.transport import cma


@pytest.mark.skipif(not cma.available(), reason="shm needs Linux cross-memory attach")
def test_each_layer_crosses_before_the_next_is_ready_and_the_lags_are_plotted(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(STAGE_ENV, "1")
    layer_ms = 60.0
    results = [run(transport, layers=4, tokens=256, layer_s=layer_ms / 1000, rounds=1) for transport in ("tcp", "shm")]
    for result in results:
        assert len(result.lags_ms) == 4
        assert all(0 < lag < layer_ms for lag in result.lags_ms), result  # not held back for later layers
        assert 0 < result.tail_ms < layer_ms, result
    path = tmp_path / "overlap.png"
    plot(results, layer_ms, str(path))
    assert path.read_bytes().startswith(b"\x89PNG")
