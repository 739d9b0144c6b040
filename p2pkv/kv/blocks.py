"""How a worker's KV blocks reach the engine: `BlockAccess`, with two implementations. `InPlaceBlocks` (a cache in
host memory: the engine reads and writes the blocks themselves) and `p2pkv.kv.buffers.TransferBuffers` (a GPU
cache: host buffers per transfer, and pulls by reference). The worker uses only this seam."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from p2pkv.engine.device import Fence, Placed, PlaceSource
from p2pkv.engine.offers import ViewSource
from p2pkv.kv.device_copy import Marker, Ready, done
from p2pkv.kv.layout import KvBlocks
from p2pkv.protocol import LayoutDigest


class BlockAccess(Protocol):
    @property
    def digest(self) -> LayoutDigest: ...

    def fence(self) -> Fence | None:
        """Where vLLM's forward has got to, for the copies that must come after it; only on vLLM's thread, in the
        connector's hooks. None where blocks are read and written in place (nothing is queued)."""

    def push_views(self, transfer_id: str, layer: int, block_ids: Sequence[int], after: Fence | None = None,
                   layers: Sequence[int] | None = None) -> tuple[tuple[memoryview, ...], Ready | None]:
        """One layer's bytes to push, and (when they are still being copied, after `after`) when they may be sent.
        NoPinnedSpace where no page-locked memory is free for them. `layers`: the layers `transfer_id` stands for,
        in order, where not every layer (a KV cache group's, whose blocks are its own): what a host buffer holds."""

    def source(self, transfer_id: str, block_ids: Sequence[int], after: Fence | None = None) -> ViewSource:
        """GET: what a pull reads (copied out after `after`)."""

    def offered_places(self, transfer_id: str, block_ids: Sequence[int],
                       after: Fence | None = None) -> PlaceSource | None:
        """GET by reference (cuda_ipc) or by pipe: where the blocks lie in this worker's storages, once `after` has
        passed; None where pulls carry bytes only."""

    def sink(self, transfer_id: str, block_ids: Sequence[int]) -> ViewSource:
        """Where a pull writes."""

    def device_blocks(self, block_ids: Sequence[int]) -> tuple[int, ...] | None:
        """The blocks a pull by reference may copy into; None where pulls carry bytes only."""

    def places(self, block_ids: Sequence[int]) -> Placed | None:
        """Where these blocks (of the heads and layers this access holds) lie in the cache's storages, for a pull
        by reference or by pipe to land in; None where pulls carry bytes only."""

    def write_blocks(self, layer: int, block_ids: Sequence[int], src: memoryview) -> None:
        """Bytes (payload order) into the blocks; returns once they are there (off vLLM's hot path)."""

    def write_layers(self, block_ids: Sequence[int], layers: Sequence[tuple[int, memoryview]],
                     after: Fence | None) -> Marker:
        """Pushed bytes of some layers, (layer, view) in any order, into the blocks, after `after`; the views are
        read until the marker says done."""

    def land(self, transfer_id: str, after: Fence | None = None) -> Marker:
        """A completed pull into `sink` made final in the blocks, after `after`; done when the marker says so."""

    def release(self, transfer_id: str) -> None:
        """The transfer is over: free what it held (idempotent), once copies still reading or writing it are done;
        never waits for them (vLLM's thread calls it): `collect` frees it later."""

    def collect(self) -> None:
        """Free what released transfers held whose copies have finished since (each step; never waits)."""

    def copied_out(self, transfer_id: str) -> Marker | None:
        """When the copies of this transfer's blocks out of the cache are done (its bytes then live in host buffers:
        the blocks may take other KV); None where the engine reads the blocks themselves (KV in host memory)."""


class InPlaceBlocks:
    """A cache in host memory: pushes send the blocks' own bytes, pulls write straight into them."""

    def __init__(self, kv: KvBlocks) -> None:
        self.kv = kv

    @property
    def digest(self) -> LayoutDigest:
        return self.kv.digest

    def fence(self) -> Fence | None:
        return None

    def push_views(self, transfer_id: str, layer: int, block_ids: Sequence[int], after: Fence | None = None,
                   layers: Sequence[int] | None = None) -> tuple[tuple[memoryview, ...], Ready | None]:
        return self.kv.block_views(layer, block_ids), None

    def _views(self, block_ids: Sequence[int]) -> ViewSource:
        ids = tuple(block_ids)

        def views(layer: int, first: int, count: int) -> tuple[memoryview, ...]:
            return self.kv.block_views(layer, ids[first : first + count])

        return views

    def source(self, transfer_id: str, block_ids: Sequence[int], after: Fence | None = None) -> ViewSource:
        return self._views(block_ids)

    def offered_places(self, transfer_id: str, block_ids: Sequence[int],
                       after: Fence | None = None) -> PlaceSource | None:
        return None

    def sink(self, transfer_id: str, block_ids: Sequence[int]) -> ViewSource:
        return self._views(block_ids)

    def device_blocks(self, block_ids: Sequence[int]) -> tuple[int, ...] | None:
        return None

    def places(self, block_ids: Sequence[int]) -> Placed | None:
        return None

    def write_blocks(self, layer: int, block_ids: Sequence[int], src: memoryview) -> None:
        self.kv.write_blocks(layer, block_ids, src)

    def write_layers(self, block_ids: Sequence[int], layers: Sequence[tuple[int, memoryview]],
                     after: Fence | None) -> Marker:
        for layer, src in layers:
            self.kv.write_blocks(layer, block_ids, src)
        return done

    def land(self, transfer_id: str, after: Fence | None = None) -> Marker:
        return done  # the pull wrote into the blocks themselves

    def release(self, transfer_id: str) -> None:
        pass

    def collect(self) -> None:
        pass

    def copied_out(self, transfer_id: str) -> Marker | None:
        return None
