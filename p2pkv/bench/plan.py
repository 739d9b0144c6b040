"""`p2pkv bench plan`: what one request costs the host on each GPU data plane, before any byte moves.

For a KV cache laid out as vLLM lays it out (one buffer for every layer, `[B, H, N, C]` views in LBHNC order) of a
given geometry (Llama-3-8B's by default: 32 layers, 8 KV heads of 128, 16-token blocks, bf16) and one request of
`blocks` blocks with descending ids (as vLLM's free list hands them out), each plane prepares and issues its device
operations through a counting device layer that records them and moves nothing. Printed per plane: the operations
issued and the host time per request (median of `repeats`, each with new block ids), against a target of 2 ms.

Planes: cuda_ipc (the peer's blocks copied into ours), staging push (each layer copied to pinned host memory for
tcp/shm, as the forward computes it), staging land (a pull's bytes into the blocks), staged push landing (pushed
bytes into the blocks), nccl send and receive (gathered and scattered around the sends, in chunks), head slice (half
the heads of every block copied out for a decode instance of twice the tensor-parallel size).
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from p2pkv.engine.device import Fence
from p2pkv.kv.buffers import TransferBuffers
from p2pkv.kv.device_copy import HostOps, Marker, Rows, done
from p2pkv.kv.layout import head_slice
from p2pkv.kv.pipes import ChannelPipe
from p2pkv.kv.staging import DeviceKv
from p2pkv.memory import HostPool

TARGET_MS = 2.0
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


class CountingOps(HostOps):
    """A device layer that counts what it is asked to do and moves nothing (the tensors are never touched: a
    cache of gigabytes costs no memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.pins_host = True
        self.counts: Counter[str] = Counter()
        self._scratch = torch.empty(1 << 30, dtype=torch.uint8)  # handed out again and again, as a caching allocator

    def empty(self, count: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        return self._scratch[: count * dtype.itemsize].view(dtype)

    def issue(self, after: Sequence[Fence], stream: object | None = None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def wait(self, fence: Fence) -> None:
        pass

    def index(self, rows: Rows) -> torch.Tensor:
        self.counts["index"] += 1
        return torch.from_numpy(rows)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.counts["copy"] += 1

    def gather(self, dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
        self.counts["gather"] += 1

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        self.counts["scatter"] += 1

    def mark(self) -> Marker:
        return done

    def total(self) -> int:
        return sum(self.counts.values())


class CountingChannel:
    """A pipe's channel that counts its sends and receives and moves nothing."""

    def __init__(self, ops: CountingOps) -> None:
        self._ops = ops

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[object | None]:
        yield None

    def send(self, t: torch.Tensor, deadline: float) -> None:
        self._ops.counts["send"] += 1

    def recv(self, t: torch.Tensor, deadline: float) -> None:
        self._ops.counts["recv"] += 1

    def mark(self) -> Marker:
        return done

    def close(self, abort: bool = False) -> None:
        pass


@dataclass(frozen=True)
class Geometry:
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bf16"
    blocks: int = 512  # in the request

    @property
    def block_bytes(self) -> int:
        """One block of one layer (K and V)."""
        return self.kv_heads * self.block_size * 2 * self.head_dim * int(_DTYPES[self.dtype].itemsize)


def vllm_like_cache(g: Geometry, num_blocks: int, device: str = "cpu", order: str = "LBHNC", kernel: int = 1,
                    fill: bool | None = None) -> list[torch.Tensor]:
    """Every layer's `[B, H, N, 2 * head]` view of one buffer laid out in `order`, as vLLM 0.29+ allocates it;
    `kernel` kernel blocks per block: the views count kernel blocks (`[B * kernel, H, N / kernel, ...]`), as
    vLLM's are for a backend with smaller blocks. `fill`: random bytes, zeros, or (None) never touched."""
    sizes = {"L": g.layers, "B": num_blocks * kernel, "H": g.kv_heads, "N": g.block_size // kernel,
             "C": 2 * g.head_dim}
    numel = g.layers * num_blocks * g.kv_heads * g.block_size * 2 * g.head_dim
    flat = torch.empty(numel, dtype=_DTYPES[g.dtype], device=device)
    if fill is not None:
        raw = flat.view(torch.uint8)
        if fill:
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=device))
        else:
            raw.zero_()
    stride, step = {}, 1
    for dim in reversed(order):
        stride[dim] = step
        step *= sizes[dim]
    shape = [sizes[d] for d in "BHNC"]
    return [flat.as_strided(shape, [stride[d] for d in "BHNC"], layer * stride["L"]) for layer in range(g.layers)]


@dataclass(frozen=True)
class PlaneCost:
    plane: str
    operations: int
    per_layer: bool  # issued layer by layer (as the forward computes them), or once for the whole request
    host_ms: float

    @property
    def met(self) -> bool:
        return self.host_ms <= TARGET_MS


def _descending(g: Geometry, num_blocks: int, rng: random.Random) -> tuple[int, ...]:
    """`g.blocks` ids counting down from a random start, as a request gets them from vLLM's free list."""
    top = rng.randrange(g.blocks, num_blocks)
    return tuple(range(top, top - g.blocks, -1))


def measure(g: Geometry, repeats: int = 20, seed: int = 0) -> list[PlaneCost]:
    num_blocks = 2 * g.blocks + 16
    ops = CountingOps()
    kv = DeviceKv(vllm_like_cache(g, num_blocks), g.block_size, "bench", 60, g.kv_heads, ops)
    peer = DeviceKv(vllm_like_cache(g, num_blocks), g.block_size, "bench", 60, g.kv_heads, CountingOps())
    pool = HostPool(2 * g.layers * g.blocks * g.block_bytes + (64 << 20), pinned=False)
    kv.pool = pool
    half = DeviceKv(head_slice(vllm_like_cache(g, num_blocks), (0, max(1, g.kv_heads // 2))), g.block_size,
                    "bench", 60, g.kv_heads, ops)
    half.pool = pool
    buffers, slices = TransferBuffers(kv), TransferBuffers(half)
    pipe = ChannelPipe(kv, CountingChannel(ops), "counting")
    layers = range(g.layers)
    rng = random.Random(seed)

    def push(ids: tuple[int, ...]) -> None:
        for layer in layers:
            buffers.push_views("push", layer, ids)
        buffers.release("push")

    def land(ids: tuple[int, ...]) -> None:
        sink = buffers.sink("land", ids)
        sink(0, 0, 1)  # the pull wrote its bytes here
        buffers.land("land")
        buffers.release("land")

    staged = [memoryview(bytearray(0)).cast("B")]

    def landing(ids: tuple[int, ...]) -> None:
        if len(staged[0]) != len(ids) * g.block_bytes:
            staged[0] = memoryview(bytearray(len(ids) * g.block_bytes))
        buffers.write_layers(ids, [(layer, staged[0]) for layer in range(g.layers)], None)

    def slice_out(ids: tuple[int, ...]) -> None:
        slices.source("slice", ids)(0, 0, len(ids))
        slices.release("slice")

    planes: list[tuple[str, bool, Callable[[tuple[int, ...]], object]]] = [
        ("cuda_ipc", False, lambda ids: kv.copy_from(peer.flat, peer.places(layers, _descending(g, num_blocks, rng)),
                                                     kv.places(layers, ids))),
        ("staging push", True, push),
        ("staging land", False, land),
        ("staged push landing", True, landing),
        ("nccl send", False, lambda ids: pipe.send(kv.places(layers, ids), time.monotonic() + 60)),
        ("nccl receive", False, lambda ids: pipe.recv(kv.places(layers, ids), time.monotonic() + 60)),
        ("head slice (TP 1 -> 2)", False, slice_out),
    ]
    out = []
    for name, per_layer, run in planes:
        run(_descending(g, num_blocks, rng))  # warm: numpy's and torch's first calls
        times, counts = [], []
        for _ in range(repeats):
            ids = _descending(g, num_blocks, rng)
            ops.counts.clear()
            started = time.perf_counter()
            run(ids)
            times.append(time.perf_counter() - started)
            counts.append(ops.total())
        out.append(PlaneCost(name, max(counts), per_layer, statistics.median(times) * 1000))
    pool.close()
    return out


def main(g: Geometry, repeats: int) -> int:
    gib = g.layers * g.blocks * g.block_bytes / (1 << 30)
    print(f"geometry: {g.layers} layers, {g.kv_heads} KV heads of {g.head_dim}, {g.block_size}-token blocks, "
          f"{g.dtype}; a request of {g.blocks} blocks with descending ids ({gib:.2f} GiB); issued one device "
          f"operation per block and layer, {g.layers * g.blocks} operations")
    costs = measure(g, repeats)
    width = max(len(c.plane) for c in costs)
    print(f"{'plane':<{width}}  {'operations':>22}  {'host ms':>8}  target <= {TARGET_MS:g} ms")
    for c in costs:
        how = f"{c.operations} ({c.operations / g.layers:.1f} per layer)" if c.per_layer else str(c.operations)
        print(f"{c.plane:<{width}}  {how:>22}  {c.host_ms:>8.2f}  {'met' if c.met else 'NOT met'}")
    return 0 if all(cost.met for cost in costs) else 1
