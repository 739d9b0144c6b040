"""The GPU check: its rows run on a CUDA machine (marker `gpu`), and without one every row is skipped cleanly."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from p2pkv.bench import gpu_check, gpu_rows, ipc_check, staged
from p2pkv.bench.plan import Geometry
from p2pkv.memory import HostPool

ROOT = Path(__file__).resolve().parents[2]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("name", "check"), gpu_check.CHECKS, ids=[name for name, _ in gpu_check.CHECKS])
def test_gpu_row_passes(name: str, check: Callable[[], str]) -> None:
    """Each row of scripts/gpu_check.sh: it raises when its check or its target fails."""
    assert check()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_without_a_gpu_the_script_skips_every_row_and_succeeds() -> None:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if "no CUDA device on this machine" in line]
    assert len(rows) == len(gpu_check.CHECKS)
    assert all(" SKIP " in row for row in rows)


def test_the_staged_tcp_row_runs_on_host_tensors() -> None:
    """The GPU row's code on CPU tensors (copies synchronous, no streams): a push and a pull land byte for byte,
    and the bandwidth measurement runs, for blocks in one run and scattered."""
    assert "byte for byte" in staged.round_trip("cpu", layers=2, blocks=16)
    pool = HostPool(8 << 20, pinned=False)
    for scattered in (False, True):
        rate = staged.bandwidth("cpu", 2 << 20, scattered, pool, repeats=2)
        assert rate.to_host_gbps > 0 and rate.to_device_gbps > 0 and rate.ratio > 0
    stats = pool.stats()
    assert stats is not None and stats.bytes_in_use == 0


def test_the_rows_that_take_a_device_run_their_checks_on_host_tensors() -> None:
    """Rows (b), (c) and (e) on CPU tensors, smaller: their byte-for-byte checks pass (their targets apply on a GPU
    only); (a)'s request between two processes, by process_vm_readv where CUDA IPC would be."""
    small = Geometry(layers=4, kv_heads=8, head_dim=32, block_size=16, blocks=24)
    assert "split) both ways, byte for byte" in gpu_rows.kernel_blocks("cpu")
    assert "byte for byte" in gpu_rows.staging("cpu", small)
    assert "byte for byte" in gpu_rows.head_slice_pull("cpu", small)
    summary, rate = ipc_check.request("cpu", 4, 24)
    assert "4 layers x 24 blocks" in summary and "host_ipc, byte for byte" in summary
    assert rate.pull_s > 0 and rate.copy_s == 0  # no device copy to time on host caches


def test_two_gpu_rows_say_they_are_skipped_where_there_are_fewer() -> None:
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has two GPUs")
    with pytest.raises(gpu_rows.RowSkipped, match="needs two GPUs"):
        gpu_rows.nccl_two_gpus()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a row failing for want of CUDA")
def test_each_row_runs_in_a_process_of_its_own_and_its_failure_becomes_its_row() -> None:
    row = gpu_check._in_child(0, 120)
    assert row.name == gpu_check.CHECKS[0][0]
    assert row.outcome == "FAIL" and "CUDA" in row.detail, row


def test_a_row_that_outlasts_its_deadline_fails_alone() -> None:
    row = gpu_check._in_child(0, 0.05)
    assert row.outcome == "FAIL" and row.detail == "did not finish in 0 s", row
