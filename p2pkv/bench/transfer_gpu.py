"""The GPU rows of `p2pkv bench transfer`: cuda_ipc between two processes on one GPU, against a device-to-device
copy measured in the same run (and, for information, whole pulls with their control messages); nccl between two
processes on two GPUs (NCCL refuses two ranks on one), whole pulls by pipe against the device copy, reported.
Without a CUDA device it says so and measures nothing."""

from __future__ import annotations

from collections.abc import Sequence

import torch

TARGET = 0.8


def _label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def run(sizes: Sequence[int], target_from: int) -> list[str]:
    """Print the tables; return the sizes that missed the target."""
    if not torch.cuda.is_available():
        print("cuda_ipc, nccl: no CUDA device here, not measured (scripts/gpu_check.sh measures cuda_ipc on a GPU "
              "machine)")
        return []
    from p2pkv.bench import ipc_check

    usable = sorted({max(s, ipc_check.BLOCK_BYTES) // ipc_check.BLOCK_BYTES * ipc_check.BLOCK_BYTES for s in sizes})
    summary, rates = ipc_check.run("cuda", usable)
    print(f"cuda_ipc: {summary}")
    print(f"{'size':>9}{'copy GB/s':>12}{'device copy':>13}{'ratio':>8}{'whole pull GB/s':>17}{'pull ms':>9}")
    failed = []
    for r in rates:
        print(f"{_label(r.size):>9}{r.copy_gbps:>12.1f}{r.base_gbps:>13.1f}{r.ratio:>8.2f}{r.pull_gbps:>17.1f}"
              f"{r.size / r.pull_gbps / 1e6:>9.3f}")
        if r.size >= target_from and r.ratio < TARGET:
            failed.append(f"cuda_ipc at {_label(r.size)}: {r.ratio:.2f} (target {TARGET})")
    if torch.cuda.device_count() < 2:
        print("nccl: needs two GPUs (NCCL refuses two ranks on one); scripts/gpu_check.sh checks it by a one-rank "
              "send to itself")
        return failed
    summary, rates = ipc_check.run("cuda:0", usable, pipes=True, peer_device="cuda:1")
    print(f"nccl (cuda:1 -> cuda:0): {summary}")
    print(f"{'size':>9}{'pull GB/s':>12}{'device copy':>13}{'ratio':>8}{'pull ms':>9}")
    for r in rates:
        print(f"{_label(r.size):>9}{r.pull_gbps:>12.1f}{r.base_gbps:>13.1f}{r.pull_gbps / r.base_gbps:>8.2f}"
              f"{r.size / r.pull_gbps / 1e6:>9.3f}")
    return failed
