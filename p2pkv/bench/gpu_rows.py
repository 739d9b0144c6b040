"""The GPU check's rows (`scripts/gpu_check.sh` runs them through `p2pkv.bench.gpu_check`), each on what users
run: caches laid out as vLLM lays them out (one buffer for every layer; Llama-3-8B's geometry), requests of 512
blocks with descending ids, baselines measured in the same run on the same card. Each returns its detail line,
prints its measurements, and raises when its check or its target fails (`RowSkipped`: it cannot run here).

Most rows take a `device`, so that the unit tests run their code on CPU tensors (no streams, no targets there)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from p2pkv.bench.plan import Geometry, vllm_like_cache
from p2pkv.kv.buffers import TransferBuffers
from p2pkv.kv.device_copy import Marker, wait_marker
from p2pkv.kv.layers import prepare_layers
from p2pkv.kv.layout import head_slice
from p2pkv.kv.staging import DeviceKv
from p2pkv.memory import HostPool

LLAMA = Geometry()  # 32 layers, 8 KV heads of 128, 16-token blocks, bf16; requests of 512 blocks (1 GiB)
ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


class RowSkipped(Exception):
    """The row cannot run on this machine (two GPUs needed, say); its reason is the row's detail."""


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _seconds(work: Callable[[], object], device: str) -> float:
    """The best of three runs of `work`, the device drained before and after each."""
    best = float("inf")
    for _ in range(3):
        _sync(device)
        started = time.perf_counter()
        work()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return best


def _descending(count: int, top: int) -> tuple[int, ...]:
    return tuple(range(top, top - count, -1))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte for byte (random bytes read as bf16 hold NaNs, which never equal themselves)."""
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def _wait(marker: Marker, what: str) -> None:
    if not wait_marker(marker, time.monotonic() + 60):
        raise AssertionError(f"{what} did not finish in 60 s")


def kernel_blocks(device: str = "cuda") -> str:
    """(e) vLLM's blocks split into kernel blocks (64/16, 128/64) and whole (every physical order), on `device`:
    blocks copied cache to cache (cuda_ipc's copy) and through pinned host memory (staging) land each whole vLLM
    block byte for byte, and nothing else."""
    checked = 0
    pool = HostPool(64 << 20)
    pool.prepare()
    cases = [(order, 64, 1) for order in ORDERS] + [("LBHNC", 64, 4), ("LBNHC", 64, 4), ("LBHNC", 128, 2)]
    for order, block, kernel in cases:
        g = Geometry(layers=3, kv_heads=4, head_dim=32, block_size=block, blocks=5)
        caches = [vllm_like_cache(g, 24, device, order, kernel, fill=i == 0) for i in range(3)]
        _sync(device)  # filled on the default stream; copied on the side stream
        names = [f"model.layers.{i}.self_attn.attn" for i in range(g.layers)]
        layers = [prepare_layers(dict(zip(names, c, strict=True)), 24, block, lambda n: (int(n.split(".")[2]), n))
                  for c in caches]
        src, direct, staged = (DeviceKv(k.tensors, block, device, 60) for k in layers)
        if src.digest.kernel_blocks != kernel:
            raise AssertionError(f"{order} {block}/{block // kernel}: {src.digest.kernel_blocks} kernel blocks")
        moves = dict(zip(_descending(5, 20), (3, 11, 7, 0, 22), strict=True))
        ids, placed = list(moves), list(moves.values())
        _wait(direct.copy_from(src.flat, src.places(range(3), ids), direct.places(range(3), placed)), "a copy")
        staged.pool = src.pool = pool
        out, into = TransferBuffers(src), TransferBuffers(staged)
        (host,), ready = out.push_views("t", 0, tuple(ids))
        views = [host, *(out.source("t", tuple(ids))(layer, 0, len(ids))[0] for layer in (1, 2))]
        if not ready(time.monotonic() + 60):
            raise AssertionError("staging out did not finish")
        _wait(into.write_layers(tuple(placed), list(enumerate(views)), None), "landing")
        out.release("t")
        for theirs, mine_direct, mine_staged in zip(layers[0].tensors, layers[1].tensors, layers[2].tensors,
                                                    strict=True):
            for s, d in moves.items():
                for mine, how in ((mine_direct, "cache to cache"), (mine_staged, "staged")):
                    if not _same(mine[d], theirs[s]):
                        raise AssertionError(f"{order} {block}/{block // kernel} {how}: block {s} -> {d} differs")
                checked += 1
            untouched = [b for b in range(24) if b not in placed]
            if mine_direct[untouched].view(torch.uint8).any() or mine_staged[untouched].view(torch.uint8).any():
                raise AssertionError(f"{order} {block}/{block // kernel}: other blocks were written")
    pool.close()
    return f"{checked} vLLM blocks (6 orders whole; 64/16, 128/64 split) both ways, byte for byte"


def sleep_cycles(seconds: float) -> int:
    """GPU clock cycles `torch.cuda._sleep` spins for `seconds` (measured here: clocks differ by card)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 * seconds / (start.elapsed_time(end) / 1000))


def stream_order() -> str:
    """(d) The forward runs on a non-default stream (as vLLM's does) and writes the blocks after 200 ms of work;
    vLLM's thread records the fence in the hook. A head slice of the blocks, copied out from another thread (an
    engine's), carries the new bytes. A copy from that thread without the fence is reported beside it."""
    g = Geometry(layers=4, blocks=64)
    views = vllm_like_cache(g, 64, "cuda", fill=False)
    kv = DeviceKv(views, 16, "cuda", 60)
    kv.pool = HostPool(256 << 20)
    kv.pool.prepare()
    torch.cuda.synchronize()
    half = DeviceKv(head_slice(views, (0, 4)), 16, "cuda", 60, parent=kv)
    half.pool = kv.pool
    buffers = TransferBuffers(half)
    ids = _descending(16, 40)
    cycles = sleep_cycles(0.2)
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):
        torch.cuda._sleep(cycles)
        for v in views:
            v.fill_(7.0)
        fence = kv.fence()  # vLLM's thread, in the hook: its current stream is the forward's
    source = buffers.source("fenced", ids, fence)
    unfenced = buffers.source("unfenced", ids)
    got: dict[str, bytes] = {}

    def engine() -> None:  # the copy without the fence first: the side stream runs copies in order
        got["unfenced"] = bytes(unfenced(0, 0, len(ids))[0])
        got["fenced"] = bytes(source(0, 0, len(ids))[0])

    thread = threading.Thread(target=engine, name="engine-thread")
    thread.start()
    thread.join(60)
    torch.cuda.synchronize()
    expected = bytes(views[0][list(ids), :4].contiguous().view(torch.uint8).cpu().numpy())
    if got.get("fenced") != expected:
        raise AssertionError("the slice copied after the fence does not carry the forward's bytes")
    stale = got.get("unfenced") != expected
    buffers.release("fenced")
    buffers.release("unfenced")
    kv.pool.close()
    return ("the fenced slice carried the forward's bytes; a copy without the fence "
            + ("read stale bytes" if stale else "happened to see them"))


def landing() -> str:
    """(g) A pull's bytes land (as `get_finished` lands them) while the forward's stream runs a 200 ms kernel:
    issuing the copies and asking whether they are done each take under 1 ms; they finish after the kernel, with
    the right bytes."""
    g = Geometry(layers=8, blocks=128)
    views = vllm_like_cache(g, 300, "cuda", fill=False)
    torch.cuda.synchronize()
    kv = DeviceKv(views, 16, "cuda", 60)
    kv.pool = HostPool(1 << 30)
    kv.pool.prepare()
    buffers = TransferBuffers(kv)
    ids = _descending(128, 250)
    sink = buffers.sink("t", ids)
    payload = torch.randint(0, 256, (g.layers * 128 * g.block_bytes,), dtype=torch.uint8)
    for layer in range(g.layers):
        (view,) = sink(layer, 0, 128)
        torch.frombuffer(view, dtype=torch.uint8).copy_(payload[layer * 128 * g.block_bytes:][: 128 * g.block_bytes])
    forward = torch.cuda.Stream()
    cycles = sleep_cycles(0.2)
    with torch.cuda.stream(forward):
        torch.cuda._sleep(cycles)
        fence = kv.fence()
    started = time.perf_counter()
    marker = buffers.land("t", fence)
    issue_ms = (time.perf_counter() - started) * 1000
    polls, done_early = [], 0
    deadline = time.monotonic() + 0.1
    while time.monotonic() < deadline:
        at = time.perf_counter()
        done_early += marker()
        polls.append((time.perf_counter() - at) * 1000)
        time.sleep(0.002)
    _wait(marker, "landing")
    landed_s = time.perf_counter() - started
    buffers.release("t")
    for layer in range(g.layers):
        block = payload[layer * 128 * g.block_bytes:][: 128 * g.block_bytes].view(128, -1).to("cuda")
        if not torch.equal(views[layer][list(ids)].contiguous().view(torch.uint8).view(128, -1), block):
            raise AssertionError(f"layer {layer}: landed bytes differ")
    kv.pool.close()
    detail = (f"issued in {issue_ms:.3f} ms, asked {len(polls)} times while the kernel ran (max "
              f"{max(polls):.3f} ms), done after {landed_s * 1000:.0f} ms with the right bytes")
    if done_early:
        raise AssertionError(detail + "; the copies did not wait for the forward's fence")
    if issue_ms >= 1 or max(polls) >= 1:
        raise AssertionError(detail + "; target < 1 ms")
    return detail


def staging(device: str = "cuda", g: Geometry = LLAMA) -> str:
    """(b) A Llama-3-8B request (32 layers x 512 blocks, descending ids, 1 GiB) staged through the pinned pool
    for tcp/shm: pushed layer by layer (gather, then one copy to the host each) against one pinned copy of the same
    bytes, target >= 0.8x; landed in another cache (one copy to the device, then scatters) against one pinned copy
    back, target >= 0.7x; the blocks land byte for byte."""
    blocks = 2 * g.blocks + 16
    src_views = vllm_like_cache(g, blocks, device, fill=True)
    dst_views = vllm_like_cache(g, blocks, device, fill=False)
    nbytes = g.layers * g.blocks * g.block_bytes
    pool = HostPool(4 * nbytes)
    pool.prepare(2 * nbytes)  # the push's buffer and the landing's, pinned before anything is timed
    _sync(device)
    src, dst = DeviceKv(src_views, 16, device, 60), DeviceKv(dst_views, 16, device, 60)
    src.pool = dst.pool = pool
    ids, placed = _descending(g.blocks, blocks - 1), _descending(g.blocks, g.blocks + 10)
    out, into = TransferBuffers(src), TransferBuffers(dst)
    issue = {"push": 0.0, "land": 0.0}

    def push() -> None:
        started = time.perf_counter()
        readies = [out.push_views("p", layer, ids)[1] for layer in range(g.layers)]
        issue["push"] = (time.perf_counter() - started) * 1000
        if not all(r(time.monotonic() + 60) for r in readies):
            raise AssertionError("a layer's copy to the host did not finish")
        out.release("p")

    push_s = _seconds(push, device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    flat = src.flat[0][:nbytes]
    base_out = _seconds(lambda: host.copy_(flat, non_blocking=True), device)
    for layer in range(g.layers):  # one more push, kept, to land from
        out.push_views("p", layer, ids)
    source, sink = out.source("p", ids), into.sink("l", placed)
    for layer in range(g.layers):
        (mine,) = sink(layer, 0, g.blocks)
        (theirs,) = source(layer, 0, g.blocks)
        mine[:] = theirs

    def land() -> None:
        started = time.perf_counter()
        marker = into.land("l")
        issue["land"] = (time.perf_counter() - started) * 1000
        _wait(marker, "landing")

    land_s = _seconds(land, device)
    base_in = _seconds(lambda: flat.copy_(host, non_blocking=True), device)
    into.release("l")
    out.release("p")
    for layer in range(g.layers):
        if not torch.equal(dst_views[layer][list(placed)].view(torch.uint8),
                           src_views[layer][list(ids)].view(torch.uint8)):
            raise AssertionError(f"layer {layer}: staged blocks differ")
    pool.close()
    push_x, land_x = base_out / push_s, base_in / land_s
    detail = (f"push {nbytes / push_s / 1e9:.1f} GB/s ({push_x:.2f}x a pinned copy; issued in {issue['push']:.2f} "
              f"ms), land {nbytes / land_s / 1e9:.1f} GB/s ({land_x:.2f}x; issued in {issue['land']:.2f} ms), byte "
              "for byte")
    if device.startswith("cuda") and (push_x < 0.8 or land_x < 0.7):
        raise AssertionError(detail + "; targets 0.8x and 0.7x")
    return detail


def cuda_ipc() -> str:
    """(a) cuda_ipc, a Llama-3-8B request (1 GiB, descending ids both sides) between two processes: the copy out
    of the opened cache >= 0.5x a device copy of the same bytes on one GPU (>= 0.7x a peer copy with two), issued in
    under 2 ms of host time; every byte checked; the memory the exporting GPU loses once a peer has opened it."""
    from p2pkv.bench import ipc_check

    two = torch.cuda.device_count() >= 2
    summary, r = ipc_check.request("cuda:0", LLAMA.layers, LLAMA.blocks, "cuda:1" if two else None)
    target = 0.7 if two else 0.5
    lost = (f"the exporting GPU lost {r.exporter_lost / (1 << 20):.0f} MiB once opened" if two
            else "one GPU: what the exporter loses is not told apart from the importer's own use")
    detail = (f"{summary}; copy {r.nbytes / r.copy_s / 1e9:.1f} GB/s = {r.ratio:.2f}x a "
              f"{'peer' if two else 'device'} copy, issued in {r.issue_ms:.2f} ms; whole pull "
              f"{r.pull_s * 1000:.1f} ms; {lost}")
    if r.ratio < target or r.issue_ms >= 2:
        raise AssertionError(detail + f"; targets >= {target}x, < 2 ms")
    return detail


def head_slice_pull(device: str = "cuda", g: Geometry = LLAMA) -> str:
    """(c) A half-head slice (TP 1 -> 2: 4 of 8 heads) of a Llama-3-8B request copied cache to cache, against the
    whole heads of the same blocks: its rate >= 0.5x; byte for byte."""
    blocks = 2 * g.blocks + 16
    src_views = vllm_like_cache(g, blocks, device, fill=True)
    whole_views = vllm_like_cache(g, blocks, device, fill=False)
    half_views = vllm_like_cache(Geometry(g.layers, g.kv_heads // 2, g.head_dim, g.block_size, g.dtype, g.blocks),
                                 blocks, device, fill=False)
    _sync(device)
    src = DeviceKv(src_views, 16, device, 60)
    half_src = DeviceKv(head_slice(src_views, (0, g.kv_heads // 2)), 16, device, 60, parent=src)
    whole, half = DeviceKv(whole_views, 16, device, 60), DeviceKv(half_views, 16, device, 60)
    ids, placed = _descending(g.blocks, blocks - 1), _descending(g.blocks, g.blocks + 10)
    layers = range(g.layers)
    whole_s = _seconds(lambda: _wait(whole.copy_from(src.flat, src.places(layers, ids),
                                                     whole.places(layers, placed)), "a copy"), device)
    half_s = _seconds(lambda: _wait(half.copy_from(src.flat, half_src.places(layers, ids),
                                                   half.places(layers, placed)), "a copy"), device)
    for layer in layers:
        if not torch.equal(half_views[layer][list(placed)].view(torch.int16),
                           src_views[layer][list(ids), : g.kv_heads // 2].view(torch.int16)):
            raise AssertionError(f"layer {layer}: the half-head slice differs")
    nbytes = g.layers * g.blocks * g.block_bytes
    ratio = (nbytes / 2 / half_s) / (nbytes / whole_s)
    detail = (f"half heads {nbytes / 2 / half_s / 1e9:.1f} GB/s, whole heads {nbytes / whole_s / 1e9:.1f} GB/s: "
              f"{ratio:.2f}x, byte for byte")
    if device.startswith("cuda") and ratio < 0.5:
        raise AssertionError(detail + "; target >= 0.5x")
    return detail


def nccl_self() -> str:
    """NCCL through its binding (vLLM's where vLLM is installed; else the check's stand-in over the same
    library), one rank sending to itself (NCCL refuses two ranks on one GPU): the communicator made without
    blocking, a send and a receive in one group, byte for byte; its rate against a device copy is reported."""
    from p2pkv.bench.nccl_library import library
    from p2pkv.kv.device_copy import event_marker
    from p2pkv.kv.nccl import Communicator, unique_id

    lib, which = library()
    device = torch.device("cuda", torch.cuda.current_device())
    comm = Communicator(lib, 1, unique_id(lib), 0, 8, time.monotonic() + 60)
    stream = torch.cuda.Stream(device)
    size = LLAMA.layers * LLAMA.blocks * LLAMA.block_bytes
    a = torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)
    b = torch.empty(size, dtype=torch.uint8, device=device)

    def exchange() -> None:
        comm.exchange(a.data_ptr(), b.data_ptr(), size, 0, stream.cuda_stream, time.monotonic() + 60)
        event = torch.cuda.Event()
        event.record(stream)
        _wait(event_marker(event, device), "a send to self")

    try:
        nccl_s = _seconds(exchange, "cuda")
        if not torch.equal(a, b):
            raise AssertionError("the bytes sent to self differ")
    finally:
        comm.close()
    copy_s = _seconds(lambda: b.copy_(a), "cuda")
    return (f"through {which}: 1 GiB sent to self byte for byte at {size / nccl_s / 1e9:.1f} GB/s "
            f"({copy_s / nccl_s:.2f}x a device copy; reported)")


def nccl_two_gpus() -> str:
    """(f) Two GPUs: a Llama-3-8B request pulled by NCCL pipe from a process on the other GPU >= 0.6x a peer copy
    of the same bytes; a peer killed mid-transfer: the pull fails within its deadline + 1 s, and the GPU still runs
    a kernel after."""
    if torch.cuda.device_count() < 2:
        raise RowSkipped("needs two GPUs (NCCL refuses two ranks on one)")
    from p2pkv.bench import ipc_check

    size = LLAMA.layers * LLAMA.blocks * LLAMA.block_bytes
    summary, rates = ipc_check.run("cuda:0", [size], repeats=2, pipes=True, peer_device="cuda:1")
    (rate,) = rates
    failed_after = ipc_check.killed_mid_pipe("cuda:0", "cuda:1", deadline_s=5.0)
    probe = torch.ones(1 << 20, device="cuda:0") * 2
    torch.cuda.synchronize("cuda:0")
    ratio = rate.pull_gbps / rate.base_gbps
    detail = (f"{summary}; {rate.pull_gbps:.1f} GB/s = {ratio:.2f}x a peer copy; a peer killed mid-transfer: the "
              f"pull failed after {failed_after:.1f} s (deadline 5 s), and the GPU ran a kernel after "
              f"({int(probe.sum().item())})")
    if ratio < 0.6 or failed_after > 6.0:
        raise AssertionError(detail + "; targets >= 0.6x, failed within 6 s")
    return detail


def tcp_staged(device: str = "cuda") -> str:
    """GPU caches on both sides of a tcp transfer through the engines, staged through the pinned pool: a push and a
    pull land byte for byte."""
    from p2pkv.bench import staged

    return staged.round_trip(device)
