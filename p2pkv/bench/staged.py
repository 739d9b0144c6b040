"""KV caches on a device, moved through host buffers (`p2pkv.kv.staging`): the GPU check's rows for TCP with GPU
tensors. Written against a `device` so that the same code runs on CPU tensors in the unit tests.

- `round_trip`: two engines over tcp, a cache on `device` on each side; blocks pushed (PUT) and pulled (GET) land
  byte for byte in other block ids.
- `bandwidth`: the staging copies (device to host buffer and back, blocks in one run and scattered) against a
  plain copy of the same bytes between the same memories, measured in the same run and the same way (back to
  back; or each waited for).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from p2pkv.config import ExtraConfig, Transport
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.puller import PullState
from p2pkv.engine.sender import OutState
from p2pkv.engine.store import StageState
from p2pkv.kv.buffers import TransferBuffers
from p2pkv.kv.device_copy import Marker, wait_marker
from p2pkv.kv.staging import DeviceKv
from p2pkv.memory import HostPool
from p2pkv.params import Address

# vLLM's FlashAttention view per layer: [blocks, heads, tokens, K and V]; 16-token blocks, 8 heads, 128 dims, bf16.
HEADS, TOKENS, KV_DIMS = 8, 16, 256
BLOCK_BYTES = HEADS * TOKENS * KV_DIMS * 2


def caches(device: str, layers: int, blocks: int, fill: bool) -> list[torch.Tensor]:
    """Per-layer block-major views of one flat buffer, as vLLM allocates them."""
    shape = (layers, blocks, HEADS, TOKENS, KV_DIMS)
    flat = (torch.randn(shape, device=device).to(torch.bfloat16) if fill
            else torch.zeros(shape, dtype=torch.bfloat16, device=device))
    return list(flat.unbind(0))


def _engines(digest_kv: DeviceKv) -> tuple[TransferEngine, TransferEngine]:
    made = []
    for _ in range(2):
        extra = ExtraConfig(kv_host="127.0.0.1", transfer_timeout_s=30, transport=Transport.TCP)
        engine = TransferEngine(EngineSettings.from_config(extra, 0, 0), digest_kv.digest)
        engine.start()
        made.append(engine)
    return made[0], made[1]


def round_trip(device: str, layers: int = 4, blocks: int = 64) -> str:
    src_layers, dst_layers = caches(device, layers, blocks, True), caches(device, layers, blocks, False)
    _sync(device)  # filled on the default stream; copied on the side stream
    src, dst = DeviceKv(src_layers, TOKENS, device, 30), DeviceKv(dst_layers, TOKENS, device, 30)
    pool = HostPool(4 * layers * blocks * BLOCK_BYTES)  # pinned on a GPU: a push takes only pinned memory
    pool.prepare()
    src.pool = dst.pool = pool
    sender, receiver = _engines(src)
    out_buffers, in_buffers = TransferBuffers(src), TransferBuffers(dst)
    moves = {b: (b * 7 + 3) % blocks for b in range(0, blocks, 2)}  # scattered both ends
    ids, placed = list(moves), list(moves.values())
    try:
        deadline = time.monotonic() + 30
        for layer in range(layers):
            views, ready = out_buffers.push_views("put", layer, ids)
            sender.push_layer("put", Address.parse(receiver.address), layer, len(ids), views, deadline, ready)
        out = sender.wait_outgoing("put", 30)
        if out is None or out.state is not OutState.DONE:
            raise AssertionError(f"push: {out}")
        if receiver.wait_staged("put", 30) is not StageState.COMPLETE:
            raise AssertionError("push: not staged")
        item = receiver.take_staged("put")
        assert item is not None
        for layer in range(layers):
            dst.write_blocks(layer, placed, item.layer_view(layer))
        receiver.release_staged(item)
        _check(src_layers, dst_layers, moves, "push")
        for layer in dst_layers:
            layer.zero_()
        sender.offer("get", len(ids), out_buffers.source("get", ids), lease_s=30)
        receiver.pull("get", Address.parse(sender.address), 0, len(ids), in_buffers.sink("get", placed),
                      time.monotonic() + 30)
        result = receiver.wait_pull("get", 30)
        if result is None or result.state is not PullState.DONE:
            raise AssertionError(f"pull: {result}")
        if not wait_marker(in_buffers.land("get"), time.monotonic() + 30):
            raise AssertionError("pull: the copy into the blocks did not finish")
        in_buffers.release("get")
        _check(src_layers, dst_layers, moves, "pull")
    finally:
        out_buffers.release("put")
        out_buffers.release("get")
        sender.close()
        receiver.close()
        pool.close()
    return f"push and pull over tcp, {layers} layers x {len(ids)} scattered blocks, byte for byte"


def _check(src: list[torch.Tensor], dst: list[torch.Tensor], moves: dict[int, int], what: str) -> None:
    for layer, (s_layer, d_layer) in enumerate(zip(src, dst, strict=True)):
        for s, d in moves.items():
            if not torch.equal(s_layer[s], d_layer[d]):
                raise AssertionError(f"{what}: layer {layer} block {s} -> {d} differs")


@dataclass(frozen=True)
class StagingRate:
    size: int
    scattered: bool
    to_host_gbps: float
    to_device_gbps: float
    base_to_host_gbps: float
    base_to_device_gbps: float

    @property
    def ratio(self) -> float:
        return min(self.to_host_gbps / self.base_to_host_gbps, self.to_device_gbps / self.base_to_device_gbps)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def mean_seconds(work: Callable[[], object], device: str, repeats: int = 5) -> float:
    """Mean seconds of `repeats` runs after one warm-up, the device drained before and after."""
    work()
    _sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        work()
    _sync(device)
    return (time.perf_counter() - started) / repeats


def _rate(nbytes: int, repeats: int, run: Callable[[], object], device: str) -> float:
    return nbytes / mean_seconds(run, device, repeats) / 1e9


def bandwidth(device: str, size: int, scattered: bool, pool: HostPool, repeats: int = 5,
              waited: bool = False) -> StagingRate:
    """One layer of `size` bytes of blocks staged out and landed back, against `copy_` of one contiguous run. Both
    measured alike: issued `repeats` times back to back, the device drained once at the end (the engine queues
    one layer's copy while the last is on the wire). `waited`: each staging copy, and each plain copy, waited for
    before the next is issued (one short transfer on its own)."""
    n = size // BLOCK_BYTES
    (layer,) = caches(device, 1, 2 * n, True)
    kv = DeviceKv([layer], TOKENS, device, 60)
    kv.pool = pool
    ids = list(range(0, 2 * n, 2)) if scattered else list(range(n))
    buffers = TransferBuffers(kv)
    host = buffers.sink("bench", ids)(0, 0, n)[0]
    host_t = torch.frombuffer(host, dtype=torch.uint8)
    flat = layer.view(-1).view(torch.uint8)[: n * BLOCK_BYTES]
    deadline = time.monotonic() + 600

    def settled(marker: Marker) -> None:
        if waited and not wait_marker(marker, deadline):
            raise AssertionError(f"a staging copy of {size} bytes missed its deadline")

    def out() -> None:
        settled(kv.copy_out([0], ids, host_t))

    def back() -> None:
        settled(kv.copy_in([0], ids, host_t))

    def plain(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], object]:
        def copy() -> None:
            dst.copy_(src, non_blocking=True)
            if waited:
                _sync(device)

        return copy

    try:
        rate = StagingRate(size, scattered, _rate(size, repeats, out, device), _rate(size, repeats, back, device),
                           _rate(size, repeats, plain(host_t, flat), device),
                           _rate(size, repeats, plain(flat, host_t), device))
    finally:
        buffers.release("bench")
    return rate
