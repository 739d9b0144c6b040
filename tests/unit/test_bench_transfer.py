"""`p2pkv bench transfer` measures every transport and its baseline and writes its plot (figures not judged here:
targets are for the benchmark command on a quiet machine)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from p2pkv.bench import transfer_nixl
from p2pkv.bench.transfer import BUSY, Row, _print_nixl, main, run, write_plot
from p2pkv.bench.transfer_peer import Shape
from p2pkv.transport import cma


def test_shapes_look_like_kv() -> None:
    shape = Shape.of(64 << 20)
    assert (shape.layers, shape.blocks, shape.block_bytes) == (8, 32, 256 << 10)
    assert Shape.of(64 << 10).nbytes == 64 << 10


@pytest.mark.skipif(not cma.available(), reason="shm needs Linux cross-memory attach")
def test_bench_transfer_measures_each_transport_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows, latencies = run([64 << 10, 1 << 20], ["tcp", "shm"], 8 << 20)
    assert [r.nbytes for r in rows] == [64 << 10, 1 << 20]
    for row in rows:
        for t in ("tcp", "shm"):
            assert row.transport_gbps[t] > 0 and row.baseline_gbps[t] > 0
        assert row.kernel_gbps > 0  # shm's ceiling, the kernel's copy alone
    assert set(latencies) == {f"a 64 KiB transfer over {t}" for t in ("tcp", "shm")} | {
        f"a 64 KiB transfer over {t}, {BUSY}" for t in ("tcp", "shm")} | {
        f"a 1 MiB pull (GET) over {t}" for t in ("tcp", "shm")} | {"64 KiB over a plain socket (Python, no engine)"}
    assert all(ms > 0 for ms in latencies.values())
    assert not any(t.name == "p2pkv-bench-busy" for t in threading.enumerate())  # the busy thread stopped with it
    plot = tmp_path / "transfer.png"
    main([1 << 20], ["shm"], 4 << 20, str(plot), repeats=1, checks=True)
    assert plot.read_bytes().startswith(b"\x89PNG")
    out = capsys.readouterr().out
    assert "shm GB/s" in out and "latency of a 64 KiB transfer over shm" in out
    assert "shm/kernel" in out and "kernel = process_vm_readv" in out
    assert "latency of a 1 MiB pull (GET) over shm" in out
    assert f"latency of a 64 KiB transfer over shm, {BUSY}" in out
    assert "latency of 64 KiB over a plain socket (Python, no engine)" in out
    assert "integrity_check on" in out
    if not torch.cuda.is_available():
        assert "cuda_ipc, nccl: no CUDA device here, not measured" in out


def test_vs_nixl_without_nixl_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(transfer_nixl, "available", lambda: False)
    assert main([64 << 10], ["tcp"], 1 << 20, str(tmp_path / "p.png"), repeats=1, vs_nixl=True) == 2
    assert "the nixl package is not importable" in capsys.readouterr().out
    assert not (tmp_path / "p.png").exists()  # nothing measured


def test_nixl_table_names_every_size_where_p2pkv_is_slower(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    rows = [Row(64 << 10, {"tcp": 0.5, "shm": 0.4}, {"tcp": 4.0, "shm": 9.0}, 5.0, {"tcp": 0.25, "shm": 1.6}),
            Row(1 << 20, {"tcp": 3.0, "shm": 8.0}, {"tcp": 4.0, "shm": 9.0}, 9.0, {"tcp": 3.0, "shm": 2.0})]
    write_plot(rows, ["tcp", "shm"], tmp_path / "nixl.png")  # NIXL's lines beside p2pkv's
    assert (tmp_path / "nixl.png").read_bytes().startswith(b"\x89PNG")
    slower = _print_nixl(rows, ["tcp", "shm"])
    assert slower == ["shm/NIXL at 64 KiB: 0.25"]  # equal is not slower
    out = capsys.readouterr().out
    assert "NIXL UCX tcp" in out and "p2pkv/NIXL" in out
    assert out.splitlines()[1].split()[-1] == "0.25" and out.splitlines()[1].split()[4] == "2.00"


@pytest.mark.skipif(not transfer_nixl.available(), reason="needs the nixl package (pip install nixl)")
def test_nixl_moves_the_same_shapes() -> None:
    for transport in ("tcp", "shm"):
        figures = transfer_nixl.measure(Shape.of(64 << 10), transport, count=16, repeats=1, latency_count=5)
        assert figures.gbps > 0 and figures.latency_us > 0
