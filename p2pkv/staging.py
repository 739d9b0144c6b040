"""KV caches the engine cannot address in place (a GPU's): their blocks move through host buffers.

The engine sends from and receives into host memory. For a KV cache on a GPU each transfer gets one host buffer
(from the host pool, which is pinned where CUDA is; its own memory when the pool is full), holding the transfer's
blocks layer after layer in payload order:

- sending, `push_views`: a device-to-host copy of one layer's blocks is queued on a copy stream, after the work
  already queued on the compute stream (the forward that wrote them). The engine sends the bytes once the copy is
  done (`ready`), so layer L is on the wire while layer L+1 is still being copied;
- GET, `source`: the layers not copied yet are copied; the puller is served from the buffer;
- receiving: a pull lands in the transfer's buffer (`sink`) and is copied into the blocks when it is complete
  (`land`); pushed bytes are copied from the staging store into the blocks (`DeviceKv.write_blocks`).

With `P2PKV_STAGE_KV=1` a KV cache in host memory takes this path too, so its logic runs in CI without a GPU.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import numpy as np
import numpy.typing as npt
import torch

from p2pkv.device_copy import (
    Copier,
    CudaCopier,
    HostCopier,
    Marker,
    Ready,
    done,
    gather_rows,
    scatter_rows,
    settle,
    wait_marker,
)
from p2pkv.engine.device import Piece, RangeSource
from p2pkv.engine.metrics import EngineMetrics
from p2pkv.engine.offers import ViewSource
from p2pkv.errors import P2pkvError
from p2pkv.integrity import digest
from p2pkv.layout import LayerGeometry, describe
from p2pkv.memory import HostPool
from p2pkv.memory.pool import PoolBuffer
from p2pkv.protocol import LayoutDigest

log = logging.getLogger(__name__)
STAGE_ENV = "P2PKV_STAGE_KV"
_T = TypeVar("_T")


class HostBuffer:
    """Host memory for one transfer: a block of the host pool, or its own memory when the pool has none free."""

    def __init__(self, nbytes: int, pool: HostPool | None, pin: bool) -> None:
        self._pool = pool
        self._block: PoolBuffer | None = pool.allocate(nbytes) if pool is not None else None
        if self._block is not None:
            self.tensor = torch.frombuffer(self._block.view, dtype=torch.uint8)
        else:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.view = memoryview(self.tensor.numpy()).cast("B")

    @property
    def from_pool(self) -> bool:
        return self._block is not None

    def release(self) -> None:
        if self._block is not None and self._pool is not None:
            self._pool.release(self._block)
            self._block = None


class DeviceKv:
    """Every layer's blocks, reached through host copies. `copy_out`/`copy_in` queue the copies and return a marker;
    `write_blocks` waits for its copy."""

    def __init__(self, tensors: Sequence[torch.Tensor], block_size: int, kernel: str, copy_timeout_s: float,
                 total_heads: int = 0) -> None:
        self.geometry: list[LayerGeometry]
        self.geometry, self.digest = describe(tensors, block_size, kernel, total_heads)
        device = tensors[0].device
        self.storages = [torch.empty(0, dtype=torch.uint8, device=device).set_(t.untyped_storage())
                          for t in tensors]
        self.on_gpu = device.type == "cuda"
        self._copier: Copier = CudaCopier(device) if self.on_gpu else HostCopier()
        self.copy_timeout_s = copy_timeout_s
        self.pool: HostPool | None = None
        self.metrics: EngineMetrics | None = None
        # Dense blocks scattered over the cache: gathered on the device and moved with one copy, where that beats
        # one copy per run of blocks (on a GPU each copy has a fixed launch cost; on the host it does not pay).
        self._dense = self.geometry[0].inner == ((0, self.digest.block_bytes),)
        self.gather_min_runs: int | None = 4 if self.on_gpu and self._dense else None
        self._host_views: list[memoryview] | None = None  # the storages' bytes, for digests (a host cache)
        # What one transfer's block ids give (the ids to gather, on the device too; each geometry's ranges), kept
        # while the same tuple of ids comes layer after layer: worked out once per transfer, not once per layer.
        self._memo: tuple[tuple[int, ...], dict[object, object]] | None = None

    @property
    def block_bytes(self) -> int:
        return self.digest.block_bytes

    @property
    def num_layers(self) -> int:
        return self.digest.num_layers

    def mark_compute(self) -> Marker:
        """When the work queued so far on the compute stream (the forward that wrote the blocks) is done."""
        return self._copier.mark_compute()

    def buffer(self, num_blocks: int) -> HostBuffer:
        """A host buffer for `num_blocks` blocks of every layer (pinned memory is allocated with this cache's device
        current: the engine's threads call this, and theirs is GPU 0 until it is set)."""
        nbytes = max(1, self.num_layers * num_blocks * self.block_bytes)
        if not self.on_gpu:
            return HostBuffer(nbytes, self.pool, False)
        with torch.cuda.device(self.storages[0].device):
            return HostBuffer(nbytes, self.pool, True)

    def blocks_2d(self, layer: int) -> torch.Tensor:
        """A dense layer as [blocks, block_bytes] rows (rows may be strided)."""
        g, storage, bb = self.geometry[layer], self.storages[layer], self.digest.block_bytes
        rows = (storage.numel() - g.base - bb) // g.block_stride + 1
        return storage.as_strided((rows, bb), (g.block_stride, 1), g.base)

    def _gather_ids(self, block_ids: Sequence[int]) -> npt.NDArray[np.int64] | None:
        """The block ids as an array where they are gathered on the device: a dense layer whose blocks make at
        least `gather_min_runs` runs (counted from the ids: a long transfer's ranges cost milliseconds to list)."""
        if not self._dense or self.gather_min_runs is None or len(block_ids) < self.gather_min_runs:
            return None
        ids = np.fromiter(block_ids, dtype=np.int64, count=len(block_ids))
        g = self.geometry[0]
        runs = len(ids) if g.block_stride != self.block_bytes else 1 + int(np.count_nonzero(np.diff(ids) != 1))
        return ids if runs >= self.gather_min_runs else None

    def _per_ids(self, block_ids: Sequence[int], key: object, make: Callable[[], _T]) -> _T:
        """`make()`, remembered for these ids while the same tuple of them is asked about (a transfer's layers come
        one after another with its one tuple); lists, which may change, are worked out every time."""
        if type(block_ids) is not tuple:
            return make()
        memo = self._memo  # taken once: another thread may start another transfer's memo meanwhile
        if memo is None or memo[0] is not block_ids:
            memo = self._memo = (block_ids, {})
        if key not in memo[1]:
            memo[1][key] = make()
        return cast(_T, memo[1][key])

    def _move(self, layer: int, block_ids: Sequence[int], host: torch.Tensor, to_host: bool) -> Marker:
        """Queue the copies between the blocks and `host` (payload order), in either direction."""
        cache = self.storages[layer]
        gather = self._per_ids(block_ids, "gather", lambda: self._gather_ids(block_ids))
        at = 0
        with self._copier.after_compute():
            if gather is not None:
                # Made on the copy stream and used only there: it may be freed whenever the memo lets it go.
                ids = self._per_ids(block_ids, cache.device, lambda: torch.from_numpy(gather).to(cache.device,
                                                                                                  non_blocking=True))
                rows = host[: len(block_ids) * self.block_bytes].view(len(block_ids), -1)
                if to_host:  # the gathered rows are made on the copy stream: freed only after the copy
                    rows.copy_(gather_rows(self.blocks_2d(layer), ids), non_blocking=True)
                else:
                    scatter_rows(self.blocks_2d(layer), ids, rows.to(cache.device, non_blocking=True))
                at = rows.numel()
            else:
                geometry = self.geometry[layer]
                for start, n in self._per_ids(block_ids, geometry, lambda: geometry.ranges(block_ids)):
                    there, here = host[at : at + n], cache[start : start + n]
                    (there if to_host else here).copy_(here if to_host else there, non_blocking=True)
                    at += n
            marker = self._copier.mark()
        if self.metrics is not None:
            self.metrics.of(self.metrics.device_copy_bytes, "to_host" if to_host else "to_device").inc(at)
        return marker

    def copy_out(self, layer: int, block_ids: Sequence[int], dst: torch.Tensor) -> Marker:
        """Queue the copy of the blocks into host memory `dst`, in payload order."""
        return self._move(layer, block_ids, dst, to_host=True)

    def copy_in(self, layer: int, block_ids: Sequence[int], src: torch.Tensor) -> Marker:
        """Queue the copy of host bytes `src` (payload order) into the blocks."""
        if src.numel() != len(block_ids) * self.block_bytes:
            raise ValueError(f"{src.numel()} bytes for {len(block_ids)} blocks of {self.block_bytes}")
        return self._move(layer, block_ids, src, to_host=False)

    def copy_pairs(self, moves: Sequence[tuple[int, torch.Tensor, Sequence[tuple[int, int, int]]]]) -> Marker:
        """Queue copies, per (our layer, `src`, pieces), from `src` (a flat byte tensor on a device this one can
        reach) into that layer's storage: (source offset, destination offset, length) each piece. One switch to the
        copy stream and one marker for them all (each costs tens of microseconds of host time on a GPU)."""
        with self._copier.after_compute():
            for layer, src, pairs in moves:
                dst = self.storages[layer]
                for s_at, d_at, n in pairs:
                    dst[d_at : d_at + n].copy_(src[s_at : s_at + n], non_blocking=True)
            return self._copier.mark()

    def write_blocks(self, layer: int, block_ids: Sequence[int], src: memoryview) -> None:
        """Copy whole blocks from host bytes (payload order) into the given blocks; returns once they are there."""
        marker = self.copy_in(layer, block_ids, _host_tensor(src))
        if not settle([marker], time.monotonic() + self.copy_timeout_s, self.copy_timeout_s):
            raise P2pkvError(f"copying {len(block_ids)} blocks to the device took over {self.copy_timeout_s} s")

    def bytes_digest(self, pieces: Sequence[Piece]) -> int | None:
        """integrity_check: the digest of these pieces of the cache, one after another; None for a cache on a GPU
        (its bytes are not digested)."""
        if self.on_gpu:
            return None
        if self._host_views is None:
            self._host_views = [memoryview(s.numpy()) for s in self.storages]
        views = self._host_views
        for layer, offset, n in pieces:
            if not (0 <= layer < len(views) and 0 <= offset and n >= 0 and offset + n <= views[layer].nbytes):
                raise P2pkvError(f"piece {offset}+{n} lies outside layer {layer} of this cache")
        return digest(views[layer][offset : offset + n] for layer, offset, n in pieces)


def _host_tensor(src: memoryview) -> torch.Tensor:
    """A uint8 tensor over host bytes, without a copy; read-only bytes are only ever read here."""
    if not len(src):
        return torch.empty(0, dtype=torch.uint8)
    if not src.readonly:
        return torch.frombuffer(src, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given buffer is not writable"
        return torch.frombuffer(src, dtype=torch.uint8)


class _Staged:
    """One transfer: its blocks, its host buffer (made on first use), and the copies queued into it."""

    def __init__(self, kv: DeviceKv, block_ids: Sequence[int]) -> None:
        self.kv = kv
        self.block_ids = tuple(block_ids)
        self.layer_bytes = len(block_ids) * kv.block_bytes
        self.markers: dict[int, Marker] = {}  # layer -> its copy to the host buffer
        self.compute: Marker = done  # the forward that wrote the blocks (GET: recorded when they are offered)
        self._buffer: HostBuffer | None = None

    @property
    def buffer(self) -> HostBuffer:
        if self._buffer is None:
            self._buffer = self.kv.buffer(len(self.block_ids))
        return self._buffer

    def layer(self, layer: int) -> torch.Tensor:
        return self.buffer.tensor[layer * self.layer_bytes : (layer + 1) * self.layer_bytes]

    def release(self) -> None:
        if self._buffer is not None:
            self._buffer.release()


class TransferBuffers:
    """The host buffers of the transfers in flight, by transfer id. Thread-safe: the engine's threads read them."""

    def __init__(self, kv: DeviceKv) -> None:
        self.kv = kv
        self._lock = threading.Lock()
        self._staged: dict[str, _Staged] = {}

    def __len__(self) -> int:
        return len(self._staged)

    @property
    def digest(self) -> LayoutDigest:
        return self.kv.digest

    def runs(self, block_ids: Sequence[int]) -> list[list[tuple[int, int]]] | None:
        return [geometry.ranges(block_ids) for geometry in self.kv.geometry]

    def device_blocks(self, block_ids: Sequence[int]) -> tuple[int, ...] | None:
        return tuple(block_ids)

    def write_blocks(self, layer: int, block_ids: Sequence[int], src: memoryview) -> None:
        self.kv.write_blocks(layer, block_ids, src)

    def _get(self, transfer_id: str, block_ids: Sequence[int]) -> _Staged:
        with self._lock:
            staged = self._staged.get(transfer_id)
            if staged is None:
                staged = self._staged[transfer_id] = _Staged(self.kv, block_ids)
            return staged

    def _wait(self, marker: Marker, what: str) -> None:
        if not wait_marker(marker, time.monotonic() + self.kv.copy_timeout_s):
            raise P2pkvError(f"{what} took over {self.kv.copy_timeout_s} s")

    def push_views(self, transfer_id: str, layer: int, block_ids: Sequence[int]) -> tuple[tuple[memoryview, ...],
                                                                                         Ready]:
        """Queue the copy of one layer's blocks; the bytes to send, and when they may be sent."""
        staged = self._get(transfer_id, block_ids)
        marker = self.kv.copy_out(layer, staged.block_ids, staged.layer(layer))
        with self._lock:
            staged.markers[layer] = marker
        start = layer * staged.layer_bytes
        return (staged.buffer.view[start : start + staged.layer_bytes],), lambda deadline: wait_marker(marker,
                                                                                                       deadline)

    def source(self, transfer_id: str, block_ids: Sequence[int]) -> ViewSource:
        """GET: the blocks as bytes, from the host buffer. Layers not pushed already are copied there when first
        asked for (on the serving thread, after the forward recorded now); a pull by reference copies nothing."""
        staged = self._get(transfer_id, block_ids)
        staged.compute = self.kv.mark_compute()
        bb = self.kv.block_bytes

        def views(layer: int, first: int, count: int) -> tuple[memoryview, ...]:
            with self._lock:
                marker = staged.markers.get(layer)
            if marker is None:
                self._wait(staged.compute, "the forward pass")
                marker = self.kv.copy_out(layer, staged.block_ids, staged.layer(layer))
                with self._lock:
                    staged.markers[layer] = marker
            self._wait(marker, f"copying layer {layer} to the host")
            start = layer * staged.layer_bytes + first * bb
            return (staged.buffer.view[start : start + count * bb],)

        return views

    def ranges(self, transfer_id: str, block_ids: Sequence[int]) -> RangeSource:
        """GET by reference (cuda_ipc): where the blocks lie in this worker's cache, once the forward that wrote
        them (recorded now) has finished."""
        staged = self._get(transfer_id, block_ids)
        staged.compute = compute = self.kv.mark_compute()
        ids = staged.block_ids

        def ranges(layer: int, first: int, count: int) -> list[tuple[int, int]]:
            self._wait(compute, "the forward pass")
            return self.kv.geometry[layer].ranges(ids[first : first + count])

        return ranges

    def sink(self, transfer_id: str, block_ids: Sequence[int]) -> ViewSource:
        """A pull's destination: the transfer's host buffer (made when first written), copied into the blocks by
        `land`."""
        staged = self._get(transfer_id, block_ids)
        bb = self.kv.block_bytes

        def views(layer: int, first: int, count: int) -> tuple[memoryview, ...]:
            start = layer * staged.layer_bytes + first * bb
            return (staged.buffer.view[start : start + count * bb],)

        return views

    def land(self, transfer_id: str) -> None:
        """Copy a completed pull from the transfer's buffer into its blocks, then free the buffer."""
        with self._lock:
            staged = self._staged.get(transfer_id)
        if staged is None:
            raise P2pkvError(f"transfer {transfer_id}: no host buffer to land from")
        try:
            markers = [self.kv.copy_in(layer, staged.block_ids, staged.layer(layer))
                       for layer in range(self.kv.num_layers)]
            if not settle(markers, time.monotonic() + self.kv.copy_timeout_s, self.kv.copy_timeout_s):
                raise P2pkvError(f"copying transfer {transfer_id} to the device took over {self.kv.copy_timeout_s} s")
        finally:
            self.release(transfer_id)

    def release(self, transfer_id: str) -> None:
        """Free the transfer's buffer (idempotent). Copies still queued into it are waited for first."""
        with self._lock:
            staged = self._staged.pop(transfer_id, None)
            markers = list(staged.markers.values()) if staged is not None else []
        if staged is None:
            return
        deadline = time.monotonic() + self.kv.copy_timeout_s
        if not all(wait_marker(m, deadline) for m in markers):
            log.error("transfer %s: a device copy is still running; its host buffer is leaked", transfer_id)
            return
        staged.release()
