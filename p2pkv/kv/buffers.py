"""The host buffers of a KV cache's transfers in flight (`TransferBuffers`, the `BlockAccess` of a cache the engine
cannot address in place): each transfer's blocks staged in one host buffer, copied to and from the device by
`p2pkv.kv.staging.DeviceKv`, as that module tells."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence

import torch

from p2pkv.engine.device import Fence, Placed, PlaceSource
from p2pkv.engine.offers import ViewSource
from p2pkv.errors import P2pkvError
from p2pkv.kv.device_copy import (
    Marker,
    NoPinnedSpace,
    PartialCopy,
    Ready,
    all_done,
    done,
    wait_marker,
)
from p2pkv.kv.staging import DeviceKv, HostBuffer, host_tensor
from p2pkv.protocol import LayoutDigest

log = logging.getLogger(__name__)


class _Staged:
    """One transfer: its blocks, its host buffer (made on first use), and the copies issued into or out of it."""

    def __init__(self, kv: DeviceKv, block_ids: Sequence[int], held: Sequence[int] | None = None) -> None:
        """`held`: the layers the buffer holds, in order (a KV cache group's); every layer where not given."""
        self.kv = kv
        self.block_ids = tuple(block_ids)
        self.held = tuple(held) if held is not None else None
        self.layer_bytes = len(block_ids) * kv.block_bytes
        self.markers: dict[int, Marker] = {}  # layer -> its copy to the host buffer
        self.landing: Marker | None = None  # the copy into the blocks (`land`)
        self.after: Fence | None = None  # the forward that wrote the blocks (GET: recorded when they are offered)
        self.retired = 0.0  # when it was released
        self._buffer: HostBuffer | None = None

    def buffer(self, pinned_only: bool = False, wait_s: float = 0.0) -> HostBuffer:
        """The transfer's buffer, made on first use. `wait_s`: off the forward's path, wait that long for pinned
        memory (the pool pins ahead of demand on its own thread) before NoPinnedSpace."""
        deadline = time.monotonic() + wait_s
        while self._buffer is None:
            try:
                self._buffer = self.kv.buffer(len(self.block_ids), pinned_only or wait_s > 0,
                                              len(self.held) if self.held is not None else 0)
            except NoPinnedSpace:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.001)
        return self._buffer

    def slot(self, layer: int) -> int:
        """Where a layer lies in the buffer, in layers."""
        return layer if self.held is None else self.held.index(layer)

    def layers(self, first: int, end: int) -> torch.Tensor:
        """The buffer's layer slots `first .. end`."""
        return self.buffer().tensor[first * self.layer_bytes : end * self.layer_bytes]

    def copies(self) -> list[Marker]:
        return [*self.markers.values(), *([self.landing] if self.landing is not None else [])]

    def release(self) -> None:
        if self._buffer is not None:
            self._buffer.release()


class TransferBuffers:
    """The host buffers of the transfers in flight, by transfer id. Thread-safe: the engine's threads read them."""

    def __init__(self, kv: DeviceKv) -> None:
        self.kv = kv
        self._lock = threading.Lock()
        self._staged: dict[str, _Staged] = {}
        self._retiring: list[_Staged] = []  # released, their copies still running: freed by `collect`

    def __len__(self) -> int:
        return len(self._staged)

    @property
    def digest(self) -> LayoutDigest:
        return self.kv.digest

    def fence(self) -> Fence:
        return self.kv.fence()

    def places(self, block_ids: Sequence[int]) -> Placed | None:
        return self.kv.places(range(self.kv.num_layers), block_ids)

    def device_blocks(self, block_ids: Sequence[int]) -> tuple[int, ...] | None:
        return tuple(block_ids)

    def write_blocks(self, layer: int, block_ids: Sequence[int], src: memoryview) -> None:
        self.kv.write_blocks(layer, block_ids, src)

    def write_layers(self, block_ids: Sequence[int], layers: Sequence[tuple[int, memoryview]],
                     after: Fence | None) -> Marker:
        """Pushed bytes of some layers, (layer, view in payload order), into the blocks; the copies are issued after
        `after` and not waited for: the caller keeps the views until the marker says done."""
        ids = tuple(block_ids)
        with self.kv.issuing([after] if after is not None else []):
            for layer, view in layers:
                (piece,) = self.kv.plan([layer], ids)
                self.kv.move(ids, piece, host_tensor(view), to_host=False)
            marker = self.kv.ops.mark()
        self.kv.count(sum(v.nbytes for _, v in layers), to_host=False)
        return marker

    def _get(self, transfer_id: str, block_ids: Sequence[int], layers: Sequence[int] | None = None) -> _Staged:
        with self._lock:
            staged = self._staged.get(transfer_id)
            if staged is None:
                staged = self._staged[transfer_id] = _Staged(self.kv, block_ids, layers)
            return staged

    def _wait(self, marker: Marker, what: str) -> None:
        if not wait_marker(marker, time.monotonic() + self.kv.copy_timeout_s):
            raise P2pkvError(f"{what} took over {self.kv.copy_timeout_s} s")

    def push_views(self, transfer_id: str, layer: int, block_ids: Sequence[int], after: Fence | None = None,
                   layers: Sequence[int] | None = None) -> tuple[tuple[memoryview, ...], Ready]:
        """Issue the copy of one layer's blocks (after `after`, the fence vLLM's thread recorded once the layer was
        written); the bytes to send, and when they may be sent. Called on the forward's path: NoPinnedSpace where
        the pool has no pinned memory free for the transfer."""
        staged = self._get(transfer_id, block_ids, layers)
        buffer = staged.buffer(pinned_only=True)
        slot = staged.slot(layer)
        marker: Marker = done
        try:
            marker = self.kv.copy_out([layer], staged.block_ids, staged.layers(slot, slot + 1),
                                      [after] if after is not None else [])
        except PartialCopy as exc:  # the buffer is released only once what was issued is done
            marker = exc.pending
            raise
        finally:
            with self._lock:
                staged.markers[layer] = marker
        start = slot * staged.layer_bytes
        return (buffer.view[start : start + staged.layer_bytes],), lambda deadline: wait_marker(marker, deadline)

    def source(self, transfer_id: str, block_ids: Sequence[int], after: Fence | None = None) -> ViewSource:
        """GET: the blocks as bytes, from the host buffer. The layers not pushed already are copied there, all at
        once, when first asked for (on the serving thread, after `after`: the fence recorded when the blocks were
        offered); a pull by reference copies nothing."""
        staged = self._get(transfer_id, block_ids)
        staged.after = after
        bb = self.kv.block_bytes

        def views(layer: int, first: int, count: int) -> tuple[memoryview, ...]:
            with self._lock:  # held while issuing: two serving threads do not both copy a layer
                marker = staged.markers.get(layer)
                if marker is None:
                    marker = self._copy_layers(staged, [at for at in range(self.kv.num_layers)
                                                        if at not in staged.markers])
            self._wait(marker, f"copying layer {layer} to the host")
            start = layer * staged.layer_bytes + first * bb
            return (staged.buffer().view[start : start + count * bb],)

        return views

    def _copy_layers(self, staged: _Staged, layers: list[int]) -> Marker:
        """Issue the copies of these layers into the transfer's buffer, one batch per run of consecutive layers,
        and note them (the caller holds the lock)."""
        markers = []
        after = [staged.after] if staged.after is not None else []
        try:
            for _, run in itertools.groupby(enumerate(layers), key=lambda x: x[1] - x[0]):
                span = [layer for _, layer in run]
                markers.append(self.kv.copy_out(span, staged.block_ids, staged.layers(span[0], span[-1] + 1),
                                                after))
        except PartialCopy as exc:
            markers.append(exc.pending)
            raise
        finally:
            marker = all_done(markers)
            for layer in layers:
                staged.markers[layer] = marker
        return marker

    def offered_places(self, transfer_id: str, block_ids: Sequence[int], after: Fence | None = None) -> PlaceSource:
        """GET by reference or by pipe: where the blocks lie in this worker's storages, once the forward that wrote
        them (`after`) has finished (the serving thread waits for it: the puller's copies are not ordered after
        anything on this device)."""
        staged = self._get(transfer_id, block_ids)
        staged.after = after
        ids = staged.block_ids

        def places(first: int, count: int) -> Placed:
            if after is not None:
                self._wait(lambda: self.kv.ops.passed(after), "the forward pass")
            return self.kv.places(range(self.kv.num_layers), ids[first : first + count])

        return places

    def sink(self, transfer_id: str, block_ids: Sequence[int]) -> ViewSource:
        """A pull's destination: the transfer's host buffer (made when first written), copied into the blocks by
        `land`."""
        staged = self._get(transfer_id, block_ids)
        bb = self.kv.block_bytes

        def views(layer: int, first: int, count: int) -> tuple[memoryview, ...]:
            start = layer * staged.layer_bytes + first * bb
            # Pinned: `land` copies from here on vLLM's thread, where a copy from pageable memory would wait.
            return (staged.buffer(wait_s=self.kv.copy_timeout_s).view[start : start + count * bb],)

        return views

    def land(self, transfer_id: str, after: Fence | None = None) -> Marker:
        """Issue the copy of a completed pull from the transfer's buffer into its blocks (every layer at once),
        after `after`; the marker says when it is done. `release` frees the buffer once it is."""
        with self._lock:
            staged = self._staged.get(transfer_id)
        if staged is None:
            raise P2pkvError(f"transfer {transfer_id}: no host buffer to land from")
        try:
            staged.landing = self.kv.copy_in(range(self.kv.num_layers), staged.block_ids,
                                             staged.layers(0, self.kv.num_layers),
                                             [after] if after is not None else [])
        except PartialCopy as exc:
            staged.landing = exc.pending
            raise
        return staged.landing

    def copied_out(self, transfer_id: str) -> Marker:
        with self._lock:
            staged = self._staged.get(transfer_id)
            return all_done(list(staged.markers.values())) if staged is not None else done

    def release(self, transfer_id: str) -> None:
        """Free the transfer's buffer (idempotent) once the copies into or out of it are done. Never waited for:
        vLLM's thread releases (a failed push's buffer, say, whose copies still wait for the forward), so a buffer
        whose copies run is freed by a later `release` or `collect`."""
        with self._lock:
            staged = self._staged.pop(transfer_id, None)
            if staged is not None:
                staged.retired = time.monotonic()
                self._retiring.append(staged)
        self.collect()

    def collect(self) -> None:
        with self._lock:
            if not self._retiring:
                return
            retiring, self._retiring = self._retiring, []
        keep, now = [], time.monotonic()
        for staged in retiring:
            try:
                finished = all(m() for m in staged.copies())
            except Exception as exc:  # a device error: nothing runs any more
                log.error("a device copy of a released transfer failed: %r", exc)
                finished = True
            if finished:
                staged.release()
            elif now - staged.retired > self.kv.copy_timeout_s:
                log.error("a device copy is still running %.0f s after its transfer ended; its host buffer is leaked",
                          self.kv.copy_timeout_s)
            else:
                keep.append(staged)
        if keep:
            with self._lock:
                self._retiring.extend(keep)
