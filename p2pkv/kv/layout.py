"""Which bytes each (layer, block) occupies in vLLM's KV cache, derived from the layer views' strides.

vLLM 0.29+ gives each layer a logical `[B, H, N, C]` view (MLA: `[B, 1, N, C]`) into one buffer, in a physical
order chosen by `KVCacheLayout` (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC). Views may be non-contiguous. One block
of one layer is therefore one contiguous run of bytes in most orders (any order with B outside H, N and C within
the layer), and several runs when a dimension sits outside B (LHBNC, BHLNC: one run per head). Blocks are copied
whole, as opaque bytes in address order: on CPU their interior is packed by the attention kernel, and both peers
must agree on what those bytes mean: the block's shape and the physical order of its dimensions (`block_order`),
part of the layout digest. Where the runs lie (which depends on the block count) is each side's own business.

Where an attention backend's kernel block is smaller than vLLM's block (FlashMLA, CUTLASS MLA, FlashInfer with a
large `--block-size`), vLLM's views count kernel blocks: `manager_blocks` regroups them so that dim 0 is vLLM's
block id again (`[B, kernel blocks, H, N, C]`), and a block moves with all its kernel blocks.

Device planes move many blocks with one indexing operation: `row_bytes` finds the largest row size every run of a
set of layers is made of, and `LayerGeometry.rows` lists, with numpy, the rows of some blocks in payload order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from p2pkv.errors import IncompatiblePeerError, P2pkvError, UnsupportedCacheError
from p2pkv.protocol import LayerPlace, LayoutDigest

ByteBlocks = npt.NDArray[np.uint8]
Run = tuple[int, int]  # (byte offset, byte length)
MAX_RUNS_PER_BLOCK = 4096


def runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive block ids coalesced into (first, count) runs, in order."""
    out: list[tuple[int, int]] = []
    for b in block_ids:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def merge_adjacent(ranges: Sequence[Run]) -> list[Run]:
    """Neighbouring ranges joined where one ends where the next begins; order is kept."""
    out: list[Run] = []
    for start, length in ranges:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return out


def inner_runs(shape: Sequence[int], strides: Sequence[int], element_size: int) -> list[Run]:
    """The byte runs of one block (a tensor of `shape`/`strides` in elements), relative to its first element, in
    address order. Raises for views whose elements overlap (zero or negative strides)."""
    dims = [(n, s) for n, s in zip(shape, strides, strict=True) if n != 1]
    if any(s <= 0 for _, s in dims):
        raise IncompatiblePeerError(f"KV block view with shape {tuple(shape)} strides {tuple(strides)} overlaps")
    dims.sort(key=lambda d: d[1], reverse=True)
    run = 1  # elements in the innermost dense run
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    offsets = [0]
    for n, s in dims:
        offsets = [o + i * s for o in offsets for i in range(n)]
        if len(offsets) > MAX_RUNS_PER_BLOCK:
            raise IncompatiblePeerError(f"KV block view with shape {tuple(shape)} strides {tuple(strides)} "
                                        f"splits into more than {MAX_RUNS_PER_BLOCK} runs")
    offsets.sort()
    if any(b - a < run for a, b in itertools.pairwise(offsets)):
        raise IncompatiblePeerError(f"KV block view with shape {tuple(shape)} strides {tuple(strides)} overlaps")
    return merge_adjacent([(o * element_size, run * element_size) for o in offsets])


def heads_axis(t: torch.Tensor) -> int:
    """Which dimension of a layer's view counts KV heads: `[B, H, N, C]`, or `[B, kernel blocks, H, N, C]` once
    kernel blocks are regrouped (`manager_blocks`); dim 1 for other shapes."""
    return t.dim() - 3 if t.dim() >= 4 else 1


def manager_blocks(t: torch.Tensor, num_blocks: int, name: str) -> torch.Tensor:
    """A layer's view with vLLM's block ids on dim 0. vLLM's views count kernel blocks where the backend's are
    smaller than its own: block b is then kernel blocks `b * r .. b * r + r - 1` (`r` = kernel blocks per block),
    so dim 0 splits into `[num_blocks, r]` without a copy. `num_blocks` 0: not known, the view is kept as it is."""
    if num_blocks <= 0 or t.shape[0] == num_blocks:
        return t
    if t.dim() != 4 or t.shape[0] % num_blocks:
        raise UnsupportedCacheError(f"KV layer {name}: {t.shape[0]} blocks in a view of shape {tuple(t.shape)} do "
                                    f"not split into vLLM's {num_blocks} blocks")
    return t.unflatten(0, (num_blocks, t.shape[0] // num_blocks))


VECTOR_FROM = 64  # blocks from which `ranges` is worked out with numpy (a long transfer's list costs milliseconds)


@dataclass(frozen=True)
class LayerGeometry:
    """Where the blocks of one layer live, in bytes from the start of its storage."""

    base: int  # byte offset of block 0's first element
    block_stride: int  # bytes from one block to the next
    inner: tuple[Run, ...]  # runs of one block relative to its first element

    @classmethod
    def of(cls, t: torch.Tensor) -> LayerGeometry:
        if t.dim() < 2:
            raise IncompatiblePeerError(f"KV layer of shape {tuple(t.shape)}: expected [blocks, ...]")
        es = t.element_size()
        inner = inner_runs(t.shape[1:], t.stride()[1:], es)
        return cls(t.storage_offset() * es, t.stride(0) * es, tuple(inner))

    def ranges(self, block_ids: Sequence[int]) -> list[Run]:
        """The byte ranges of these blocks, block after block, each block's runs in address order; merged where
        they touch, so consecutive blocks of a block-major layout become one range."""
        if len(block_ids) < VECTOR_FROM:
            return merge_adjacent([(self.base + b * self.block_stride + off, n) for b in block_ids
                                   for off, n in self.inner])
        offs, lens = (np.array(x, dtype=np.int64) for x in zip(*self.inner, strict=True))
        ids = np.fromiter(block_ids, dtype=np.int64, count=len(block_ids))  # from a list: a third faster than asarray
        starts = (self.base + ids[:, None] * self.block_stride + offs[None, :]).ravel()
        ends = starts + np.tile(lens, len(ids))
        first = np.flatnonzero(np.r_[True, starts[1:] != ends[:-1]])  # where a range does not touch the last
        last = np.r_[first[1:] - 1, len(starts) - 1]
        return list(zip(starts[first].tolist(), (ends[last] - starts[first]).tolist(), strict=True))

    def rows(self, block_ids: npt.NDArray[np.int64], row: int) -> npt.NDArray[np.int64]:
        """The rows of `row` bytes these blocks occupy, counted from the storage's start, in payload order (block
        after block, each block's runs in address order). Every run must be a whole number of rows (`row_bytes`)."""
        inner = np.concatenate([np.arange(off // row, (off + n) // row, dtype=np.int64) for off, n in self.inner])
        first = (self.base + block_ids * self.block_stride) // row
        out: npt.NDArray[np.int64] = (first[:, None] + inner[None, :]).ravel()
        return out



def row_bytes(geometries: Sequence[LayerGeometry], *more: int) -> int:
    """The largest row size every block of these layers is made of: it divides each layer's base, block stride,
    and its runs' offsets and lengths (and `more`, byte counts that must be whole rows too)."""
    values = [v for g in geometries for v in (g.base, g.block_stride, *(x for run in g.inner for x in run))]
    return math.gcd(*values, *more) or 1


def ids_bytes(block_ids: Sequence[int]) -> bytes:
    """Block ids as they travel (little-endian int32)."""
    return np.fromiter(block_ids, dtype="<i4", count=len(block_ids)).tobytes()


def ids_array(raw: bytes) -> npt.NDArray[np.int64]:
    if len(raw) % 4:
        raise P2pkvError(f"block ids of {len(raw)} bytes: not int32")
    return np.frombuffer(raw, dtype="<i4").astype(np.int64)


def place(geometry: LayerGeometry, storage: int) -> LayerPlace:
    return LayerPlace(storage, geometry.base, geometry.block_stride, geometry.inner)


def geometry_of(p: LayerPlace) -> LayerGeometry:
    return LayerGeometry(p.base, p.block_stride, tuple((int(a), int(n)) for a, n in p.inner))


def placed_row(layers: Sequence[LayerPlace]) -> int:
    """The largest row size every block of these layers is made of (`row_bytes`)."""
    return row_bytes([geometry_of(p) for p in layers])


def placed_rows(block_ids: bytes, layers: Sequence[LayerPlace], row: int) -> list[tuple[int, npt.NDArray[np.int64]]]:
    """The rows of `row` bytes the blocks occupy, in payload order: one (storage, rows) per run of consecutive
    layers in one storage (vLLM's layers share one, so one in all), rows counted from the storage's start."""
    ids = ids_array(block_ids)
    out: list[tuple[int, npt.NDArray[np.int64]]] = []
    shared: dict[tuple[int, tuple[Run, ...]], npt.NDArray[np.int64]] = {}  # layers alike but for their base
    for storage, group in itertools.groupby(layers, key=lambda p: p.storage):
        parts = []
        for p in group:
            g = geometry_of(p)
            if g.base % row or g.block_stride % row or any(a % row or n % row for a, n in g.inner):
                raise P2pkvError(f"layer place {p} is not made of rows of {row} bytes")
            key = (g.block_stride, g.inner)
            if key not in shared:
                shared[key] = LayerGeometry(0, g.block_stride, g.inner).rows(ids, row)
            parts.append(shared[key] + g.base // row)
        out.append((storage, parts[0] if len(parts) == 1 else np.concatenate(parts)))
    return out


def placed_ranges(block_ids: bytes, layers: Sequence[LayerPlace]) -> list[tuple[int, int, int]]:
    """(storage, offset, length) of the blocks' bytes, in payload order (digests, reads across processes)."""
    ids = ids_array(block_ids).tolist()
    return [(p.storage, start, n) for p in layers for start, n in geometry_of(p).ranges(ids)]


def _storage_bytes(t: torch.Tensor) -> ByteBlocks:
    if t.device.type != "cpu":
        raise IncompatiblePeerError(f"KV tensors on {t.device.type} are reached through host copies (DeviceKv)")
    flat = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    arr: ByteBlocks = flat.numpy()
    return arr


def head_slice(tensors: Sequence[torch.Tensor], heads: tuple[int, int]) -> list[torch.Tensor]:
    """Views of heads `first .. end` of every block (`[B, H, N, C]`, MLA `[B, 1, N, C]`; `heads_axis`)."""
    first, end = heads
    axis = heads_axis(tensors[0])
    held = tensors[0].shape[axis]
    if not 0 <= first < end <= held:
        raise IncompatiblePeerError(f"heads {first}..{end} outside the {held} held here")
    return [t.narrow(axis, first, end - first) for t in tensors]


def block_order(t: torch.Tensor) -> str:
    """The physical order of one block's dimensions, outermost first, as the letters of its logical view: `HNC`
    for `[B, H, N, C]`, `KHNC` once kernel blocks are regrouped (`[B, K, H, N, C]`). A block's bytes travel in
    address order, so two peers whose blocks have the same shape but another order (LBHNC and LBNHC: one run
    each) would permute heads and tokens: the digest carries it. Dimensions of one element are left out (their
    place changes no byte), except H, which `LayoutDigest.differences` drops only where a slice holds one head."""
    names = {2: "C", 3: "HC", 4: "HNC", 5: "KHNC"}.get(t.dim()) or "".join(f"d{i}" for i in range(1, t.dim()))
    kept = [(stride, name) for name, size, stride in zip(names, t.shape[1:], t.stride()[1:], strict=True)
            if size > 1 or name == "H"]
    # Outermost first; a tie (a dimension of one element beside another) keeps the logical order.
    return "".join(name for _, name in sorted(kept, key=lambda x: -x[0]))


def describe(tensors: Sequence[torch.Tensor], block_size: int, kernel: str,
             total_heads: int = 0) -> tuple[list[LayerGeometry], LayoutDigest]:
    """Each layer's block geometry and the digest peers compare; refuses layers that differ. `total_heads`: the
    model's KV heads over all tensor-parallel ranks (0: not known; peers must then hold the same heads)."""
    if not tensors:
        raise IncompatiblePeerError("no KV cache tensors were registered")
    first = tensors[0]
    shapes = {(tuple(t.shape[1:]), t.dtype) for t in tensors}
    if len(shapes) != 1:
        raise IncompatiblePeerError(f"KV layers differ in block shape or dtype: {shapes}")
    geometry = [LayerGeometry.of(t) for t in tensors]
    if len({g.inner for g in geometry}) != 1:
        raise IncompatiblePeerError("KV layers differ in how their blocks are laid out in memory")
    block_bytes = first[0].numel() * first.element_size()
    split = first.dim() == 5  # kernel blocks regrouped (`manager_blocks`): [B, kernel blocks, H, N, C]
    digest = LayoutDigest(num_layers=len(tensors), block_size=block_size, block_bytes=block_bytes,
                          dtype=str(first.dtype).removeprefix("torch."),
                          block_shape=tuple(first.shape[2:] if split else first.shape[1:]),
                          kernel=kernel, block_order=block_order(first), total_heads=total_heads,
                          kernel_blocks=first.shape[1] if split else 1)
    return geometry, digest


@dataclass
class KvBlocks:
    """Byte access to every layer's blocks, in the order the layers were registered (KV in host memory)."""

    storages: list[ByteBlocks]
    geometry: list[LayerGeometry]
    digest: LayoutDigest

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], block_size: int, kernel: str,
                     total_heads: int = 0) -> KvBlocks:
        geometry, digest = describe(tensors, block_size, kernel, total_heads)
        return cls([_storage_bytes(t) for t in tensors], geometry, digest)

    @property
    def block_bytes(self) -> int:
        return self.digest.block_bytes

    def block_views(self, layer: int, block_ids: Sequence[int]) -> tuple[memoryview, ...]:
        """Zero-copy views of the given blocks of one layer, in payload order (as few as the layout allows)."""
        storage = self.storages[layer]
        return tuple(storage[start : start + n].data for start, n in self.geometry[layer].ranges(block_ids))

    def write_blocks(self, layer: int, block_ids: Sequence[int], src: memoryview) -> None:
        """Copy whole blocks from `src` (payload order, as `block_views` gives them) into the given blocks."""
        data = np.frombuffer(src, dtype=np.uint8)
        if data.size != len(block_ids) * self.block_bytes:
            raise ValueError(f"{data.size} bytes for {len(block_ids)} blocks of {self.block_bytes}")
        storage = self.storages[layer]
        at = 0
        for start, n in self.geometry[layer].ranges(block_ids):
            storage[start : start + n] = data[at : at + n]
            at += n
