"""The GPU check: its rows run on a CUDA machine (marker `gpu`), and without one every row is skipped cleanly."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from p2pkv.bench import gpu_check, gpu_rows, staged
from p2pkv.memory import HostPool

ROOT = Path(__file__).resolve().parents[2]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
def test_layout_ranges_move_blocks_on_the_device() -> None:
    assert "byte for byte" in gpu_check._layouts_on_device()


@pytest.mark.gpu
@needs_gpu
def test_pinned_pool_copies_at_pinned_speed() -> None:
    assert "to device" in gpu_check._pinned_pool()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_without_a_gpu_the_script_skips_every_row_and_succeeds() -> None:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if "no CUDA device on this machine" in line]
    assert len(rows) == len(gpu_check.CHECKS)
    assert all(" SKIP " in row for row in rows)


@pytest.mark.gpu
@needs_gpu
def test_tcp_with_gpu_tensors_through_the_pinned_pool() -> None:
    assert "byte for byte" in gpu_rows.tcp_staged()


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


@pytest.mark.gpu
@needs_gpu
def test_cuda_ipc_between_two_processes_on_one_gpu() -> None:
    assert "byte for byte" in gpu_rows.cuda_ipc()


@pytest.mark.gpu
@needs_gpu
def test_nccl_pipe_sends_blocks_to_itself() -> None:
    assert "byte for byte" in gpu_rows.nccl_self()


@pytest.mark.gpu
@needs_gpu
def test_scatter_into_a_paged_cache_at_half_a_device_copy() -> None:
    assert "a device copy at worst" in gpu_rows.scatter()
