"""The GPU check's rows for the data planes (`scripts/gpu_check.sh` runs them through `p2pkv.bench.gpu_check`):
tcp with GPU caches, cuda_ipc between two processes, the NCCL pipe, and the scatter into a paged cache. Each
returns its detail line, prints its measurements, and raises when it fails."""

from __future__ import annotations

import time

STAGING_SIZES = tuple(1 << p for p in range(20, 31, 2))  # 1 MiB to 1 GiB


def tcp_staged() -> str:
    """GPU caches on both sides of a tcp transfer, staged through the pinned pool: bytes checked for a push and a
    pull; the staging copies at least 80% of a plain pinned copy, 1 MiB to 1 GiB, blocks in one run, both issued
    back to back. Scattered blocks (every other one, gathered on the device), and one 1 MiB copy waited for against
    a plain copy waited for, are reported beside them."""
    from p2pkv.bench import staged
    from p2pkv.memory import HostPool

    checked = staged.round_trip("cuda")
    pool = HostPool(2 << 30)
    rates = [staged.bandwidth("cuda", size, scattered, pool) for size in STAGING_SIZES for scattered in (False, True)]
    for r in rates:
        print(f"  staging {r.size >> 20:5d} MiB {'scattered' if r.scattered else 'one run  '}: to host "
              f"{r.to_host_gbps:6.1f} GB/s (plain {r.base_to_host_gbps:6.1f}), to device {r.to_device_gbps:6.1f} "
              f"GB/s (plain {r.base_to_device_gbps:6.1f}), ratio {r.ratio:.2f}")
    one = staged.bandwidth("cuda", 1 << 20, False, pool, repeats=50, waited=True)
    print(f"  staging 1 MiB, each copy waited for: to host {(1 << 20) / one.to_host_gbps / 1e3:.1f} us (plain "
          f"{(1 << 20) / one.base_to_host_gbps / 1e3:.1f} us), to device {(1 << 20) / one.to_device_gbps / 1e3:.1f} us "
          f"(plain {(1 << 20) / one.base_to_device_gbps / 1e3:.1f} us)")
    in_run = min(r.ratio for r in rates if not r.scattered)
    scattered = min(r.ratio for r in rates if r.scattered)
    detail = (f"{checked}; staging {in_run:.2f}x a pinned copy (min, 1 MiB-1 GiB, back to back), scattered "
              f"{scattered:.2f}x; 1 MiB waited for {one.ratio:.2f}x a plain copy waited for")
    if in_run < 0.8:
        raise AssertionError(detail)
    return detail


def cuda_ipc() -> str:
    """Two processes on the one GPU: one offers, the other pulls by reference (CUDA IPC), every byte checked; a push
    between them is left for a pull (the receiver opens the sender's cache) and pulled, every byte checked; the
    copy out of the opened cache at least 80% of a device-to-device copy, 1 MiB to 1 GiB."""
    from p2pkv.bench import ipc_check

    summary, rates = ipc_check.run("cuda", STAGING_SIZES)
    for r in rates:
        print(f"  cuda_ipc {r.size >> 20:5d} MiB: copy {r.copy_gbps:7.1f} GB/s (device copy {r.base_gbps:7.1f}), "
              f"ratio {r.ratio:.2f}; whole pull {r.pull_gbps:7.1f} GB/s")
    worst = min(r.ratio for r in rates)
    detail = (f"{summary}; copies {worst:.2f}x a device copy (min, 1 MiB-1 GiB); whole pulls "
              f"{min(r.pull_gbps for r in rates):.1f}-{max(r.pull_gbps for r in rates):.1f} GB/s")
    if worst < 0.8:
        raise AssertionError(detail)
    return detail


def nccl_self() -> str:
    """NCCL through a one-rank send to itself (NCCL refuses two ranks on one GPU), through the engine's pipe
    (`ChannelPipe` over `NcclPipe`): scattered blocks of every layer, cut into the pieces the engine's pulls by pipe
    post, go from one half of a cache to the other in one grouped call and land byte for byte; the rate against a
    device copy is reported, 1 MiB to 1 GiB."""
    import torch

    from p2pkv.bench.staged import TOKENS, caches
    from p2pkv.device_copy import wait_marker
    from p2pkv.engine.device import pair_ranges
    from p2pkv.nccl import NcclPipe, unique_id
    from p2pkv.pipes import ChannelPipe
    from p2pkv.staging import DeviceKv

    device = torch.device("cuda", torch.cuda.current_device())
    pipe = NcclPipe(1, unique_id(), 0, device, channels=8)
    try:
        layers = caches("cuda", 4, 128, True)
        kv = DeviceKv(layers, TOKENS, "cuda", 60)
        moves = {b: 64 + (b * 7 + 3) % 64 for b in range(0, 64, 2)}
        sends, recvs = [], []
        for layer in range(4):
            geometry = kv.geometry[layer]
            pieces = pair_ranges(geometry.ranges(list(moves)), geometry.ranges(list(moves.values())))
            sends += [(layer, a, n) for a, _, n in pieces]
            recvs += [(layer, b, n) for _, b, n in pieces]
        ChannelPipe(kv, pipe, "nccl", peer_rank=0).exchange(sends, recvs, time.monotonic() + 60)
        for layer in range(4):
            for s, d in moves.items():
                if not torch.equal(layers[layer][s], layers[layer][d]):
                    raise AssertionError(f"layer {layer}: block {s} -> {d} differs")
        rates = []
        for size in STAGING_SIZES:
            a = torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)
            b = torch.empty(size, dtype=torch.uint8, device=device)
            best_nccl = best_copy = float("inf")
            for _ in range(3):
                torch.cuda.synchronize()
                started = time.perf_counter()
                wait_marker(pipe.exchange([(a, 0)], [(b, 0)]), time.monotonic() + 60)
                best_nccl = min(best_nccl, time.perf_counter() - started)
                started = time.perf_counter()
                b.copy_(a)
                torch.cuda.synchronize()
                best_copy = min(best_copy, time.perf_counter() - started)
            if not torch.equal(a, b):
                raise AssertionError(f"{size} bytes sent to self differ")
            rates.append((size, size / best_nccl / 1e9, size / best_copy / 1e9))
            print(f"  nccl self {size >> 20:5d} MiB: {rates[-1][1]:7.1f} GB/s (device copy {rates[-1][2]:7.1f})")
    finally:
        pipe.close()
    low = min(r[1] / r[2] for r in rates)
    return (f"{len(moves) * 4} scattered blocks over 4 layers in one grouped call, byte for byte; send to self "
            f"{low:.2f}x a device copy at worst (1 MiB-1 GiB, reported, no target)")


SCATTER_REPEATS = 20  # calls timed per figure (a 1 MiB call lasts microseconds)


def _scatter_once(size: int) -> tuple[float, float, float]:
    """Seconds to scatter `size` bytes of blocks (ours, torch's byte-wise index_copy_) and to copy them plainly."""
    import torch

    from p2pkv.bench.staged import BLOCK_BYTES, TOKENS, caches, mean_seconds
    from p2pkv.device_copy import scatter_rows
    from p2pkv.staging import DeviceKv

    n = size // BLOCK_BYTES
    (layer,) = caches("cuda", 1, 2 * n, False)
    blocks = DeviceKv([layer], TOKENS, "cuda", 60).blocks_2d(0)
    ids = torch.randperm(2 * n, device="cuda")[:n]
    rows = torch.randint(0, 255, (n, BLOCK_BYTES), dtype=torch.uint8, device="cuda")
    flat = torch.empty(n * BLOCK_BYTES, dtype=torch.uint8, device="cuda")
    ours = mean_seconds(lambda: scatter_rows(blocks, ids, rows), "cuda", SCATTER_REPEATS)
    if not torch.equal(blocks[ids], rows):
        raise AssertionError(f"{size} bytes: scattered blocks differ")
    bytewise = mean_seconds(lambda: blocks.index_copy_(0, ids, rows), "cuda", SCATTER_REPEATS)
    return ours, bytewise, mean_seconds(lambda: flat.copy_(rows.view(-1)), "cuda", SCATTER_REPEATS)


def scatter() -> str:
    """Received blocks (contiguous on the device) scattered into a paged cache (16-token blocks, 8 heads, 128 dims,
    bf16; every other block, shuffled) at least 50% of a device copy of the same bytes, 1 MiB to 1 GiB. torch's
    byte-wise `index_copy_` is reported beside it."""
    worst, parts = float("inf"), []
    for size in STAGING_SIZES:
        ours, bytewise, copy = _scatter_once(size)
        ratio = copy / ours
        worst = min(worst, ratio)
        parts.append(f"{size >> 20} MiB {ratio:.2f}x (bytes {copy / bytewise:.2f}x)")
        print(f"  scatter {size >> 20:5d} MiB: {size / ours / 1e9:7.1f} GB/s, device copy {size / copy / 1e9:7.1f} "
              f"GB/s, ratio {ratio:.2f}; torch index_copy_ on bytes {copy / bytewise:.2f}x")
    detail = f"scatter at {worst:.2f}x a device copy at worst; " + ", ".join(parts)
    if worst < 0.5:
        raise AssertionError(detail)
    return detail


