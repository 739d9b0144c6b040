"""KV caches the engine cannot address in place (a GPU's): their blocks move through host buffers, one per
transfer (`p2pkv.kv.buffers.TransferBuffers`); this module copies them to and from the device (`DeviceKv`).

The engine sends from and receives into host memory. For a KV cache on a GPU each transfer gets one host buffer
(from the host pool, pinned where CUDA is), holding the transfer's blocks layer after layer in payload order:

- sending, `push_views`: the copy of one layer's blocks to the host is issued on the side stream after the fence
  vLLM's thread recorded when the layer was written; the engine sends the bytes once the copy is done (`ready`);
- GET, `source`: the layers not copied yet are copied, all at once, after the fence recorded when the blocks were
  offered; the puller is served from the buffer;
- receiving: a pull lands in the transfer's buffer (`sink`) and is copied into the blocks by `land`; pushed bytes
  are copied from the staging store as each layer arrives (`write_layers`). Both return a marker and never wait:
  the request is reported loaded once the marker says the copies are done.

Every copy is batched (`DeviceKv.plan`): the blocks of a set of layers sharing one storage are rows of a `[rows,
row bytes]` view of it, moved by one gather or scatter (in chunks of at most `SCRATCH_BYTES` of device scratch),
with indices built by numpy. Where the rows are one run, a plain copy.

With `P2PKV_STAGE_KV=1` a KV cache in host memory takes this path too, so its logic runs in CI without a GPU.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import numpy as np
import torch

from p2pkv.engine.device import Fence, Placed
from p2pkv.engine.metrics import EngineMetrics
from p2pkv.errors import P2pkvError
from p2pkv.integrity import digest
from p2pkv.kv.device_copy import (
    WORDS,
    DeviceOps,
    Marker,
    NoPinnedSpace,
    PartialCopy,
    Rows,
    as_rows,
    ops_for,
    settle,
    word_bytes,
)
from p2pkv.kv.layout import LayerGeometry, describe, ids_bytes, place, placed_ranges, placed_row, placed_rows, row_bytes
from p2pkv.memory import HostPool
from p2pkv.memory.pool import PoolBuffer

log = logging.getLogger(__name__)
STAGE_ENV = "P2PKV_STAGE_KV"
SCRATCH_BYTES = 64 << 20  # device scratch per gather or scatter: a whole request at once could be a GiB
_T = TypeVar("_T")


class HostBuffer:
    """Host memory for one transfer: a block of the host pool, or its own (pageable) memory."""

    def __init__(self, nbytes: int, pool: HostPool | None, pinned_only: bool = False) -> None:
        """`pinned_only`: NoPinnedSpace rather than pageable memory when the pool has none free (on the forward's
        path, where a copy into pageable memory would wait for the forward, and pinning more may not happen)."""
        self._pool = pool
        self._block: PoolBuffer | None = pool.allocate(nbytes) if pool is not None else None
        if self._block is not None:
            self.tensor = torch.frombuffer(self._block.view, dtype=torch.uint8)
        elif pinned_only:
            raise NoPinnedSpace(f"no pinned host memory free for {nbytes} bytes (mem_pool_size_gb)")
        else:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.view = memoryview(self.tensor.numpy()).cast("B")

    @property
    def from_pool(self) -> bool:
        return self._block is not None

    def release(self) -> None:
        if self._block is not None and self._pool is not None:
            self._pool.release(self._block)
            self._block = None


@dataclass(frozen=True)
class RowPiece:
    """Rows of `row` bytes of one storage (`DeviceKv.flat[storage]`, counted from byte `start`), in payload
    order: the blocks of one or more consecutive layers that share the storage. `one_run`: they follow one another
    (a plain copy moves them)."""

    storage: int
    start: int
    row: int
    rows: Rows
    one_run: bool = False

    @property
    def nbytes(self) -> int:
        return len(self.rows) * self.row


def one_run(rows: Rows) -> bool:
    return len(rows) > 0 and int(rows[-1]) - int(rows[0]) == len(rows) - 1 and bool(np.all(np.diff(rows) == 1))


class DeviceKv:
    """Every layer's blocks, reached through host copies (or, cuda_ipc and pipes, cache to cache), through a
    `DeviceOps`. Layers that share a storage (vLLM 0.29+ allocates one for all) are moved together."""

    def __init__(self, tensors: Sequence[torch.Tensor], block_size: int, kernel: str, copy_timeout_s: float,
                 total_heads: int = 0, ops: DeviceOps | None = None, parent: DeviceKv | None = None) -> None:
        """`parent`: the whole cache these views (some heads of some layers) are of: its storages, numbered as it
        numbers them (and exports them), and its device layer."""
        self.geometry: list[LayerGeometry]
        self.geometry, self.digest = describe(tensors, block_size, kernel, total_heads)
        device = tensors[0].device
        self.flat: list[torch.Tensor] = parent.flat if parent is not None else []  # distinct storages, flat bytes
        self.storage_of: list[int] = []  # each layer's storage, an index into `flat`
        known = {t.data_ptr(): i for i, t in enumerate(self.flat)}
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in known:
                if parent is not None:
                    raise P2pkvError("a slice of a cache lies outside the cache's storages")
                known[storage.data_ptr()] = len(self.flat)
                self.flat.append(torch.empty(0, dtype=torch.uint8, device=device).set_(storage))
            self.storage_of.append(known[storage.data_ptr()])
        ops = ops if ops is not None or parent is None else parent.ops
        self.storages = [self.flat[i] for i in self.storage_of]  # per layer
        self.on_gpu = device.type == "cuda"
        self.ops: DeviceOps = ops if ops is not None else ops_for(device)
        self.copy_timeout_s = copy_timeout_s
        self.pool: HostPool | None = None
        self.metrics: EngineMetrics | None = None
        self._host_views: list[memoryview] | None = None  # the storages' bytes, for digests (a host cache)
        self._row_views: dict[tuple[int, int, int, int], torch.Tensor] = {}  # (storage, start, row, word) -> rows
        self._rows_of: dict[LayerGeometry, int] = {}  # a layer's row size
        # One transfer's layers come one after another with its one tuple of block ids: what those ids give (the
        # rows of each geometry, their indices on the device) is worked out once per transfer, not per layer.
        self._memo: tuple[tuple[int, ...], dict[object, object]] | None = None

    @property
    def block_bytes(self) -> int:
        return self.digest.block_bytes

    @property
    def num_layers(self) -> int:
        return self.digest.num_layers

    def fence(self) -> Fence:
        """Where vLLM's forward has got to (only on vLLM's thread, in the connector's hooks)."""
        return self.ops.fence()

    def buffer(self, num_blocks: int, pinned_only: bool = False, num_layers: int = 0) -> HostBuffer:
        """A host buffer for `num_blocks` blocks of every layer (of `num_layers` layers, where given)."""
        nbytes = max(1, (num_layers or self.num_layers) * num_blocks * self.block_bytes)
        return HostBuffer(nbytes, self.pool, pinned_only and self.ops.pins_host)

    def _per_ids(self, block_ids: Sequence[int], key: object, make: Callable[[], _T]) -> _T:
        """`make()`, remembered while the same tuple of ids is asked about; lists, which may change, are worked
        out every time."""
        if type(block_ids) is not tuple:
            return make()
        memo = self._memo  # taken once: another thread may start another transfer's memo meanwhile
        if memo is None or memo[0] is not block_ids:
            memo = self._memo = (block_ids, {})
        if key not in memo[1]:
            memo[1][key] = make()
        return cast(_T, memo[1][key])

    def plan(self, layers: Sequence[int], block_ids: Sequence[int]) -> list[RowPiece]:
        """The rows these blocks of these layers occupy, in payload order (layer after layer), one piece per run of
        consecutive layers that share a storage."""
        if len(layers) == 1:  # a layer pushed as the forward computes it: its rows are its transfer's, shifted
            layer = layers[0]
            g = self.geometry[layer]
            row = self._row_of(g)
            rows, run = self._rows(g, block_ids, row)
            return [RowPiece(self.storage_of[layer], g.base, row, rows, run)]
        pieces = []
        for storage, group in itertools.groupby(layers, key=lambda layer: self.storage_of[layer]):
            geometries = [self.geometry[layer] for layer in group]
            row = row_bytes(geometries)
            start = min(g.base for g in geometries) // row * row
            parts = [self._rows(g, block_ids, row)[0] + (g.base - start) // row for g in geometries]
            rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
            pieces.append(RowPiece(storage, start, row, rows, one_run(rows)))
        return pieces

    def _row_of(self, g: LayerGeometry) -> int:
        row = self._rows_of.get(g)
        if row is None:
            row = self._rows_of[g] = row_bytes([g])
        return row

    def places(self, layers: Sequence[int], block_ids: Sequence[int]) -> Placed:
        """Where these blocks of these layers lie in the storages (`flat`), as they travel."""
        return Placed(ids_bytes(block_ids), [place(self.geometry[layer], self.storage_of[layer]) for layer in layers])

    def pieces(self, placed: Placed) -> list[RowPiece]:
        """The rows of blocks placed in this cache's storages, in payload order."""
        row = placed_row(placed.layers)
        return [RowPiece(storage, 0, row, rows, one_run(rows))
                for storage, rows in placed_rows(placed.block_ids, placed.layers, row)]

    def _rows(self, g: LayerGeometry, block_ids: Sequence[int], row: int) -> tuple[Rows, bool]:
        """A layer's rows counted from its base, and whether they are one run: worked out once per transfer for the
        layers that lie alike but for their base."""

        def make() -> tuple[Rows, bool]:
            ids = np.fromiter(block_ids, dtype=np.int64, count=len(block_ids))
            rows = LayerGeometry(0, g.block_stride, g.inner).rows(ids, row)
            return rows, one_run(rows)

        return self._per_ids(block_ids, (g.block_stride, g.inner, row), make)

    def _index(self, block_ids: Sequence[int], piece: RowPiece) -> torch.Tensor:
        """A piece's rows on the device (a piece of one chunk), uploaded once per transfer for the layers that share
        one list of rows."""
        rows, index = self._per_ids(block_ids, ("index", id(piece.rows)), lambda: (piece.rows,
                                                                                  self.ops.index(piece.rows)))
        return index if rows is piece.rows else self.ops.index(piece.rows)

    @contextlib.contextmanager
    def issuing(self, after: Sequence[Fence], stream: object | None = None) -> Iterator[None]:
        """`ops.issue`, and where issuing fails part-way, PartialCopy with a marker for what was issued before."""
        with self.ops.issue(after, stream):
            try:
                yield
            except PartialCopy:
                raise
            except Exception as exc:
                raise PartialCopy(exc, self.ops.mark()) from exc

    def count(self, nbytes: int, to_host: bool) -> None:
        if self.metrics is not None:
            self.metrics.of(self.metrics.device_copy_bytes, "to_host" if to_host else "to_device").inc(nbytes)

    def rows_view(self, storage: int, start: int, row: int, word: int) -> torch.Tensor:
        """A storage from byte `start` as [rows, row bytes] in words of `word` bytes (made once)."""
        key = (storage, start, row, word)
        view = self._row_views.get(key)
        if view is None:
            view = self._row_views[key] = as_rows(self.flat[storage][start:], row, word)
        return view

    def move(self, block_ids: Sequence[int], piece: RowPiece, host: torch.Tensor, to_host: bool) -> None:
        """Issue the copies of one piece between the cache and `host` (its bytes in payload order): one plain copy
        where its rows are one run; else one gather (to the host) or scatter (from it) per chunk of scratch."""
        row = piece.row
        word = word_bytes(row, host.data_ptr(), self.flat[piece.storage].data_ptr() + piece.start)
        rows = self.rows_view(piece.storage, piece.start, row, word)
        dtype = WORDS[word]
        there = host.view(dtype).view(-1, row // word)
        ops = self.ops
        if piece.one_run:
            first = int(piece.rows[0])
            mine = rows[first : first + len(piece.rows)]
            ops.copy(there, mine) if to_host else ops.copy(mine, there)
            return
        total = len(piece.rows)
        per_chunk = max(1, SCRATCH_BYTES // row)
        if not ops.pins_host:  # a cache in host memory: the host buffer is rows like the cache's, no scratch
            index = self._index(block_ids, piece)
            ops.gather(there, rows, index) if to_host else ops.scatter(rows, index, there)
            return
        for at in range(0, total, per_chunk):  # indices go up chunk by chunk: a bounded upload each
            n = min(per_chunk, total - at)
            scratch = ops.empty(n * row // word, dtype).view(n, -1)
            if n == total:
                part, near = self._index(block_ids, piece), there
            else:
                part, near = ops.index(piece.rows[at : at + n]), there[at : at + n]
            if to_host:
                ops.gather(scratch, rows, part)
                ops.copy(near, scratch)
            else:
                ops.copy(scratch, near)
                ops.scatter(rows, part, scratch)

    def _transfer(self, layers: Sequence[int], block_ids: Sequence[int], host: torch.Tensor,
                  after: Sequence[Fence], to_host: bool) -> Marker:
        expected = len(layers) * len(block_ids) * self.block_bytes
        if host.numel() != expected:
            raise ValueError(f"{host.numel()} bytes for {len(block_ids)} blocks of {len(layers)} layers of "
                             f"{self.block_bytes}")
        at = 0
        with self.issuing(after):
            pieces = self.plan(layers, block_ids)
            for piece in pieces:
                self.move(block_ids, piece, host if len(pieces) == 1 else host[at : at + piece.nbytes], to_host)
                at += piece.nbytes
            marker = self.ops.mark()
        self.count(at, to_host)
        return marker

    def copy_out(self, layers: Sequence[int], block_ids: Sequence[int], dst: torch.Tensor,
                 after: Sequence[Fence] = ()) -> Marker:
        """Issue the copy of these blocks of these layers into host bytes `dst` (payload order), after `after`."""
        return self._transfer(layers, block_ids, dst, after, to_host=True)

    def copy_in(self, layers: Sequence[int], block_ids: Sequence[int], src: torch.Tensor,
                after: Sequence[Fence] = ()) -> Marker:
        """Issue the copy of host bytes `src` (payload order) into these blocks of these layers, after `after`."""
        return self._transfer(layers, block_ids, src, after, to_host=False)

    def copy_from(self, sources: Sequence[torch.Tensor], theirs: Placed, ours: Placed,
                  after: Sequence[Fence] = ()) -> Marker:
        """Issue the copy of blocks of another cache (`sources`: its storages, flat bytes on this device; a peer's,
        opened here) into ours, after `after`: one gather from their storage and one scatter into ours per chunk of
        scratch and pair of storages, whatever the number of blocks."""
        row = math.gcd(placed_row(theirs.layers), placed_row(ours.layers))
        segments = _segments(placed_rows(theirs.block_ids, theirs.layers, row),
                             placed_rows(ours.block_ids, ours.layers, row))
        ops = self.ops
        with self.issuing(after):
            for s_t, rows_t, s_o, rows_o in segments:
                src, dst = sources[s_t], self.flat[s_o]
                word = word_bytes(row, src.data_ptr(), dst.data_ptr())
                src_view, dst_view = as_rows(src, row, word), as_rows(dst, row, word)
                per_chunk = max(1, SCRATCH_BYTES // row)
                for at in range(0, len(rows_t), per_chunk):
                    n = min(per_chunk, len(rows_t) - at)
                    scratch = ops.empty(n * row // word, WORDS[word]).view(n, -1)
                    ops.gather(scratch, src_view, ops.index(rows_t[at : at + n]))
                    ops.scatter(dst_view, ops.index(rows_o[at : at + n]), scratch)
            return ops.mark()

    def write_blocks(self, layer: int, block_ids: Sequence[int], src: memoryview) -> None:
        """Copy whole blocks from host bytes (payload order) into the given blocks; returns once they are there
        (off vLLM's hot path only: the fault injection of the tests, the benchmarks)."""
        marker = self.copy_in([layer], block_ids, host_tensor(src))
        if not settle([marker], time.monotonic() + self.copy_timeout_s, self.copy_timeout_s):
            raise P2pkvError(f"copying {len(block_ids)} blocks to the device took over {self.copy_timeout_s} s")

    def bytes_digest(self, placed: Placed) -> int | None:
        """integrity_check: the digest of these blocks of the cache, layer after layer; None for a cache on a GPU
        (its bytes are not digested)."""
        if self.on_gpu:
            return None
        if self._host_views is None:
            self._host_views = [memoryview(s.numpy()) for s in self.flat]
        views = self._host_views
        pieces = placed_ranges(placed.block_ids, placed.layers)
        for storage, offset, n in pieces:
            if not (0 <= storage < len(views) and 0 <= offset and n >= 0 and offset + n <= views[storage].nbytes):
                raise P2pkvError(f"piece {offset}+{n} lies outside storage {storage} of this cache")
        return digest(views[storage][offset : offset + n] for storage, offset, n in pieces)


def _segments(theirs: list[tuple[int, Rows]], ours: list[tuple[int, Rows]]) -> list[tuple[int, Rows, int, Rows]]:
    """Two sides' rows (one list per storage, in payload order) cut where either side changes storage."""
    out = []
    i = j = at_i = at_j = 0
    while i < len(theirs) and j < len(ours):
        (s_t, rows_t), (s_o, rows_o) = theirs[i], ours[j]
        n = min(len(rows_t) - at_i, len(rows_o) - at_j)
        out.append((s_t, rows_t[at_i : at_i + n], s_o, rows_o[at_j : at_j + n]))
        at_i, at_j = at_i + n, at_j + n
        if at_i == len(rows_t):
            i, at_i = i + 1, 0
        if at_j == len(rows_o):
            j, at_j = j + 1, 0
    return out


def host_tensor(src: memoryview) -> torch.Tensor:
    """A uint8 tensor over host bytes, without a copy; read-only bytes are only ever read here."""
    if not len(src):
        return torch.empty(0, dtype=torch.uint8)
    if not src.readonly:
        return torch.frombuffer(src, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given buffer is not writable"
        return torch.frombuffer(src, dtype=torch.uint8)
