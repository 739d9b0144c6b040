"""Pulls by reference between two processes (cuda_ipc on a GPU; kind "host" on CPU): the GPU check's row for
cuda_ipc, written against a `device` so that the unit tests run the same code on CPU caches. With `pipes`, the
same between processes on two GPUs by NCCL pipe (`bench transfer`'s nccl rows; gloo on CPU caches).

A child process holds a cache whose every byte is a known function of its block and position, and offers
transfers; this process pulls them into its own cache by reference and checks every byte. Bandwidth: for each size,
the pull from request to confirmation, and the copy out of the opened cache alone, against a plain copy of the
same bytes inside this process (for `cuda`: a device-to-device copy), measured in the same run.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from p2pkv.bench.nccl_library import library
from p2pkv.config import ExtraConfig, Transport
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.device import Placed, RemoteCache
from p2pkv.engine.puller import PullState
from p2pkv.engine.sender import OutState
from p2pkv.engine.store import StageState
from p2pkv.kv.buffers import TransferBuffers
from p2pkv.kv.device_copy import wait_marker
from p2pkv.kv.ipc import CacheAccess, CudaRemote
from p2pkv.kv.pipes import GlooPipes, NcclPipes
from p2pkv.kv.staging import DeviceKv
from p2pkv.params import Address
from p2pkv.way import WhyPull

BLOCK_BYTES = 64 << 10  # 16 tokens x 8 heads x 128 dims x K and V, bf16
CHECK_BLOCKS = 64
_SPAWN = mp.get_context("spawn")


def pattern(block_ids: torch.Tensor, block_bytes: int, layer: int = 0) -> torch.Tensor:
    """The bytes the offering process puts in these blocks of this layer: [len(block_ids), block_bytes] uint8."""
    pos = torch.arange(block_bytes, dtype=torch.int32, device=block_ids.device)
    mixed = (block_ids.to(torch.int32)[:, None] * 131 + layer * 29 + pos[None, :] * 7 + (pos[None, :] >> 8) * 13)
    return (mixed & 255).to(torch.uint8)


def _engine(kv: DeviceKv, pipes: bool, checks: bool = False) -> TransferEngine:
    settings = EngineSettings.from_config(ExtraConfig(
        kv_host="127.0.0.1", transfer_timeout_s=120, connect_timeout_s=60,
        transport=Transport.NCCL if pipes else Transport.AUTO, integrity_check=checks), 0, 0)
    if pipes:
        maker = NcclPipes(kv, 8, library()[0]) if kv.on_gpu else GlooPipes(kv, "127.0.0.1")
        engine = TransferEngine(settings, kv.digest, pipes=maker)
    else:
        engine = TransferEngine(settings, kv.digest, device=CacheAccess(kv))
    engine.start()
    return engine


def _cache(device: str, blocks: int, layers: int = 1) -> list[torch.Tensor]:
    """Every layer's [blocks, block bytes] view of one buffer, layer after layer (as vLLM's LBHNC caches lie)."""
    flat = torch.zeros(layers * blocks * BLOCK_BYTES, dtype=torch.uint8, device=device)
    return list(flat.view(layers, blocks, BLOCK_BYTES).unbind(0))


def _free_bytes(device: str) -> int:
    return int(torch.cuda.mem_get_info(torch.device(device))[0]) if device.startswith("cuda") else 0


def _stalling(engine: TransferEngine, pipe: Connection) -> None:
    """The engine's pipes say when a send starts, then never finish it: a peer that hangs mid-transfer."""
    maker = engine.pipes
    assert maker is not None
    join = maker.join

    def joined(token: bytes, deadline: float) -> Any:
        made = join(token, deadline)

        def send(placed: Placed, deadline: float) -> None:
            pipe.send("sending")
            time.sleep(600)

        made.send = send  # type: ignore[method-assign]  # this pipe's sends hang
        return made

    maker.join = joined  # type: ignore[method-assign]


def offer_process(pipe: Connection, device: str, blocks: int, plan: list[tuple[str, list[int]]],
                  pipes: bool = False, layers: int = 1, stall: bool = False) -> None:
    """Child: fill a cache with `pattern`, offer each (transfer id, block ids) of `plan`, send the engine's address,
    the cache's export and its device's free memory, and hold the offers until told to stop (answering pushes to
    leave for a pull, and questions about its device's free memory, meanwhile)."""
    cache = _cache(device, blocks, layers)
    step = max(1, (256 << 20) // BLOCK_BYTES)
    for layer, view in enumerate(cache):
        for first in range(0, blocks, step):  # in slices: the pattern's int32 temporaries stay small
            ids = torch.arange(first, min(blocks, first + step), device=device)
            view[first : first + len(ids)] = pattern(ids, BLOCK_BYTES, layer)
    _sync(device)
    kv = DeviceKv(cache, 16, torch.device(device).type, 120)
    buffers = TransferBuffers(kv)
    engine = _engine(kv, pipes)
    if stall:
        _stalling(engine, pipe)
    try:
        for tid, ids in plan:
            engine.offer(tid, len(ids), buffers.source(tid, ids), 600, buffers.offered_places(tid, ids))
        pipe.send((engine.address, CacheAccess(kv).export(), _free_bytes(device)))
        while pipe.poll(600):
            ask = pipe.recv()
            if ask == "stop":
                break
            pipe.send(_free_bytes(device) if ask == "free" else _push_left(engine, buffers, *ask))
    finally:
        engine.close()


def _push_left(engine: TransferEngine, buffers: TransferBuffers, peer: str, tid: str, ids: list[int]) -> str:
    """Child: push a transfer as a PUT_ASYNC worker does; the peer, which can pull over a device path, should ask
    for a pull instead; then offer the blocks, as the worker does. The outcome, for the parent to check."""
    deadline = time.monotonic() + 120
    for layer in range(buffers.kv.num_layers):
        views, ready = buffers.push_views(tid, layer, ids)
        engine.push_layer(tid, Address.parse(peer), layer, len(ids), views, deadline, ready)
    out = engine.wait_outgoing(tid, 120)
    if out is None or out.state is not OutState.REFUSED or out.reason != WhyPull.DEVICE_PATH.value:
        return f"the push ended {out.state.value if out else 'unknown'}: {out.reason if out else ''}"
    buffers.release(tid)
    engine.offer(tid, len(ids), buffers.source(tid, ids), 600, buffers.offered_places(tid, ids))
    return "left"


@dataclass(frozen=True)
class RequestRate:
    nbytes: int
    pull_s: float  # the pull, request to confirmation
    copy_s: float  # the copy out of the opened cache, issued to done (0 where there is no device copy: host caches)
    issue_ms: float  # host time to prepare and issue that copy
    base_s: float  # one copy of the same bytes in one run (from the peer's GPU, with two)
    exporter_lost: int  # device memory the exporting process's GPU lost once this process opened its cache

    @property
    def ratio(self) -> float:
        return self.base_s / self.copy_s if self.copy_s else 0.0


def request(device: str, layers: int, blocks: int, peer_device: str | None = None) -> tuple[str, RequestRate]:
    """One request as vLLM makes them: `blocks` blocks of every layer, descending ids on both sides, pulled by
    reference between two processes (the offering one on `peer_device`); every byte checked. Timed: the pull
    through the engine; the copy alone, and its host time; one device copy of the same bytes."""
    total = 2 * blocks + 16
    src = list(range(total - 1, total - 1 - blocks, -1))
    dst = tuple(range(blocks + 10, 10, -1))
    plan = [("req", src)]
    parent, child = _SPAWN.Pipe()
    proc = _SPAWN.Process(target=offer_process, args=(child, peer_device or device, total, plan, False, layers),
                          daemon=True)
    proc.start()
    cache = _cache(device, total, layers)
    kv = DeviceKv(cache, 16, torch.device(device).type, 120)
    engine = _engine(kv, False)
    try:
        if not parent.poll(300):
            raise RuntimeError("the offering process did not start")
        address, export, free_before = parent.recv()
        started = _now(device)
        how = _pull(engine, Address.parse(address), "req", list(dst))
        pull_s = _now(device) - started
        parent.send("free")
        lost = free_before - parent.recv() if parent.poll(60) else 0
        ids = torch.tensor(src, device=device)
        for layer, view in enumerate(cache):
            if not torch.equal(view[torch.tensor(dst, device=device)], pattern(ids, BLOCK_BYTES, layer)):
                raise AssertionError(f"layer {layer}: pulled blocks differ from the sender's")
        nbytes = layers * blocks * BLOCK_BYTES
        summary = (f"{layers} layers x {blocks} blocks (descending ids, {nbytes >> 20} MiB) pulled by reference over "
                   f"{how}, byte for byte")
        copy_s = issue_ms = 0.0
        remote = CacheAccess(kv).open(export)
        try:
            if isinstance(remote, CudaRemote):
                theirs, ours = kv.places(range(layers), src), kv.places(range(layers), dst)  # the peer's lie as ours
                copy_s, issue_ms = _copy_alone(remote, theirs, ours, device)
        finally:
            remote.close()
        flat = kv.flat[0][:nbytes]
        source = torch.empty(nbytes, dtype=torch.uint8, device=peer_device or device)
        started = _now(device)
        flat.copy_(source)
        base_s = _now(device) - started
        return summary, RequestRate(nbytes, pull_s, copy_s, issue_ms, base_s, lost)
    finally:
        engine.close()
        parent.send("stop")
        proc.join(60)


def _copy_alone(remote: CudaRemote, theirs: Placed, ours: Placed, device: str) -> tuple[float, float]:
    """The best of three: seconds from issue to done, and milliseconds of host time to issue."""
    best_s = best_issue = float("inf")
    for _ in range(3):
        _sync(device)
        started = time.perf_counter()
        marker = remote.issue(theirs, ours)
        issued = time.perf_counter()
        if not wait_marker(marker, time.monotonic() + 60):
            raise AssertionError("the copy out of the opened cache did not finish")
        best_s = min(best_s, time.perf_counter() - started)
        best_issue = min(best_issue, (issued - started) * 1000)
    return best_s, best_issue


def killed_mid_pipe(device: str, peer_device: str, deadline_s: float) -> float:
    """A peer on `peer_device` that hangs once it sends by pipe, killed as it does: seconds from the kill until the
    pull (deadline `deadline_s`) failed here. Pulls carry bytes until the pipe is made."""
    plan = [(f"k-{i}", [1, 2]) for i in range(WARM_UP + 1)]
    parent, child = _SPAWN.Pipe()
    proc = _SPAWN.Process(target=offer_process, args=(child, peer_device, 8, plan, True, 1, True), daemon=True)
    proc.start()
    (cache,) = _cache(device, 8)
    kv = DeviceKv([cache], 16, torch.device(device).type, 120)
    engine = _engine(kv, True)
    buffers = TransferBuffers(kv)
    try:
        if not parent.poll(300):
            raise RuntimeError("the offering process did not start")
        peer = Address.parse(parent.recv()[0])
        for tid, _ in plan:
            engine.pull(tid, peer, 0, 2, buffers.sink(tid, [5, 6]), time.monotonic() + deadline_s, (5, 6))
            if parent.poll(deadline_s) and parent.recv() == "sending":
                proc.kill()
                killed = time.monotonic()
                result = engine.wait_pull(tid, 3 * deadline_s)
                if result is None or result.state is not PullState.FAILED:
                    raise AssertionError(f"the pull from a killed peer ended {result}")
                return time.monotonic() - killed
            result = engine.wait_pull(tid, deadline_s)
            buffers.release(tid)
            time.sleep(0.2)
        raise AssertionError("no pull went by pipe")
    finally:
        engine.close()
        proc.kill()
        proc.join(30)


@dataclass(frozen=True)
class IpcRate:
    size: int
    pull_gbps: float  # request to confirmation, control messages included
    copy_gbps: float  # the copy out of the opened cache alone
    base_gbps: float  # a plain copy of the same bytes in this process

    @property
    def ratio(self) -> float:
        return self.copy_gbps / self.base_gbps


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


WARM_UP = 20  # pulls that may carry bytes while the pipe is being made


def run(device: str, sizes: Sequence[int], repeats: int = 3, pipes: bool = False,
        peer_device: str | None = None, checks: bool = False) -> tuple[str, list[IpcRate]]:
    """The correctness check's summary, and one rate per size. `pipes`: by pipe (the offering process's cache on
    `peer_device`), where the rate's copy is the whole pull. `checks`: integrity_check (this side; the link agrees
    it with the offering process), which digests a host cache's pulls on both sides."""
    largest = max(sizes) // BLOCK_BYTES
    blocks = max(2 * CHECK_BLOCKS, largest)
    check_src = list(range(0, 2 * CHECK_BLOCKS, 2))  # scattered in the sender's cache
    plan = [(f"warm-{i}", [i]) for i in range(WARM_UP if pipes else 0)] + [("check", check_src)]
    plan += [(f"bw-{size}-{r}", list(range(size // BLOCK_BYTES))) for size in sizes for r in range(repeats)]
    parent, child = _SPAWN.Pipe()
    proc = _SPAWN.Process(target=offer_process, args=(child, peer_device or device, blocks, plan, pipes),
                          daemon=True)
    proc.start()
    (cache,) = _cache(device, blocks)
    kv = DeviceKv([cache], 16, torch.device(device).type, 120)
    engine = _engine(kv, pipes, checks)
    try:
        if not parent.poll(300):
            raise RuntimeError("the offering process did not start")
        address, export, _ = parent.recv()
        peer = Address.parse(address)
        if pipes:
            _warm_up(engine, peer, kv)
        check_dst = list(reversed(range(1, 2 * CHECK_BLOCKS, 2)))  # scattered here too, in another order
        result = _pull(engine, peer, "check", check_dst)
        got = cache[torch.tensor(check_dst, device=device)]
        if not torch.equal(got, pattern(torch.tensor(check_src, device=device), BLOCK_BYTES)):
            raise AssertionError("pulled blocks differ from the sender's")
        how = "by pipe" if pipes else "by reference"
        summary = f"{CHECK_BLOCKS} scattered blocks pulled {how} over {result}, byte for byte, between two processes"
        summary += "; " + _check_left(engine, parent, peer, cache, device)
        remote = None if pipes else CacheAccess(kv).open(export)
        rates = [_rate(engine, peer, remote, kv, device, size, repeats) for size in sizes]
        if remote is not None:
            remote.close()
        return summary, rates
    finally:
        engine.close()  # unmaps the child's cache before the child exits
        parent.send("stop")
        proc.join(60)


def _check_left(engine: TransferEngine, parent: Connection, peer: Address, cache: torch.Tensor, device: str) -> str:
    """The child pushes a transfer to this engine, which pulls over a device path: it must be left for a pull
    (PullInstead), then pulled here straight into the cache, byte for byte."""
    src = list(range(1, 17))
    parent.send((engine.address, "left", src))
    if not parent.poll(180):
        raise RuntimeError("the offering process did not answer the push")
    outcome = parent.recv()
    if outcome != "left":
        raise AssertionError(f"the push was not left for a pull: {outcome}")
    state = engine.wait_staged("left", 30)
    if state is not StageState.FAILED or engine.store.reason("left") != WhyPull.DEVICE_PATH.value:
        raise AssertionError(f"the receiving side saw {state}: {engine.store.reason('left')}")
    dst = list(range(40, 56))
    transport = _pull(engine, peer, "left", dst)
    if not torch.equal(cache[torch.tensor(dst, device=device)], pattern(torch.tensor(src, device=device),
                                                                         BLOCK_BYTES)):
        raise AssertionError("blocks of a push left for a pull differ from the sender's")
    return f"a push was left for a pull (PullInstead) and pulled over {transport}"


def _warm_up(engine: TransferEngine, peer: Address, kv: DeviceKv) -> None:
    """Pulls (carrying bytes) until one goes by pipe: the pipe is made off the request path."""
    buffers = TransferBuffers(kv)
    for i in range(WARM_UP):
        tid = f"warm-{i}"
        engine.pull(tid, peer, 0, 1, buffers.sink(tid, [0]), time.monotonic() + 120, (0,))
        result = engine.wait_pull(tid, 120)
        buffers.release(tid)
        if result is None or result.state is not PullState.DONE:
            raise AssertionError(f"pull {tid}: {result}")
        if result.by_reference:
            return
        time.sleep(0.2)
    raise AssertionError(f"no pull went by pipe in {WARM_UP}")


def _rate(engine: TransferEngine, peer: Address, remote: RemoteCache | None, kv: DeviceKv, device: str,
          size: int, repeats: int) -> IpcRate:
    """Best of `repeats`: whole pulls, copies out of the opened cache (by pipe: the pulls), plain copies of the
    same bytes."""
    ids = list(range(size // BLOCK_BYTES))
    cache = kv.flat[0].view(-1, BLOCK_BYTES)
    placed = kv.places([0], ids)  # the peer's cache lies as ours does
    pull_s = copy_s = base_s = float("inf")
    src, dst = cache[: len(ids)].clone(), torch.empty_like(cache[: len(ids)])
    for r in range(repeats):
        started = _now(device)
        _pull(engine, peer, f"bw-{size}-{r}", ids)
        pull_s = min(pull_s, _now(device) - started)
        if remote is not None:
            started = _now(device)
            remote.copy(placed, placed, time.monotonic() + 60)
            copy_s = min(copy_s, _now(device) - started)
        else:
            copy_s = pull_s
        started = _now(device)
        dst.copy_(src)
        base_s = min(base_s, _now(device) - started)
    return IpcRate(size, size / pull_s / 1e9, size / copy_s / 1e9, size / base_s / 1e9)


def _pull(engine: TransferEngine, peer: Address, tid: str, ids: list[int]) -> str:
    def unused_sink(layer: int, first: int, count: int) -> tuple[memoryview, ...]:
        raise AssertionError("a pull by reference wrote to the host sink")

    engine.pull(tid, peer, 0, len(ids), unused_sink, time.monotonic() + 120, tuple(ids))
    result = engine.wait_pull(tid, 120)
    if result is None or result.state is not PullState.DONE or not result.by_reference:
        raise AssertionError(f"pull {tid}: {result}")
    engine.forget_pull(tid)
    return result.transport


def _now(device: str) -> float:
    """The time once the device has finished what was queued."""
    _sync(device)
    return time.perf_counter()
