"""How a worker's KV blocks reach the engine: `BlockAccess`, with two implementations. `InPlaceBlocks` (a cache in
host memory: the engine reads and writes the blocks themselves) and `p2pkv.staging.TransferBuffers` (a GPU
cache: host buffers per transfer, and pulls by reference). The worker uses only this seam."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from p2pkv.device_copy import Ready
from p2pkv.engine.device import RangeSource, Run
from p2pkv.engine.offers import ViewSource
from p2pkv.layout import KvBlocks
from p2pkv.protocol import LayoutDigest


class BlockAccess(Protocol):
    @property
    def digest(self) -> LayoutDigest: ...

    def push_views(self, transfer_id: str, layer: int,
                   block_ids: Sequence[int]) -> tuple[tuple[memoryview, ...], Ready | None]:
        """One layer's bytes to push, and (when they are still being copied) when they may be sent."""

    def source(self, transfer_id: str, block_ids: Sequence[int]) -> ViewSource:
        """GET: what a pull reads."""

    def ranges(self, transfer_id: str, block_ids: Sequence[int]) -> RangeSource | None:
        """GET by reference (cuda_ipc): where the blocks lie in the exported cache; None without an export."""

    def sink(self, transfer_id: str, block_ids: Sequence[int]) -> ViewSource:
        """Where a pull writes."""

    def device_blocks(self, block_ids: Sequence[int]) -> tuple[int, ...] | None:
        """The blocks a pull by reference may copy into; None where pulls carry bytes only."""

    def runs(self, block_ids: Sequence[int]) -> list[list[Run]] | None:
        """Per layer, where these blocks (of the heads this access holds) lie in the cache's storages, for a pull
        of a slice by reference or by pipe to land in; None where pulls carry bytes only."""

    def write_blocks(self, layer: int, block_ids: Sequence[int], src: memoryview) -> None:
        """Pushed bytes (payload order) into the blocks; returns once they are there."""

    def land(self, transfer_id: str) -> None:
        """A completed pull into `sink` made final in the blocks."""

    def release(self, transfer_id: str) -> None:
        """The transfer is over: free what it held (idempotent)."""


class InPlaceBlocks:
    """A cache in host memory: pushes send the blocks' own bytes, pulls write straight into them."""

    def __init__(self, kv: KvBlocks) -> None:
        self.kv = kv

    @property
    def digest(self) -> LayoutDigest:
        return self.kv.digest

    def push_views(self, transfer_id: str, layer: int,
                   block_ids: Sequence[int]) -> tuple[tuple[memoryview, ...], Ready | None]:
        return self.kv.block_views(layer, block_ids), None

    def _views(self, block_ids: Sequence[int]) -> ViewSource:
        ids = tuple(block_ids)

        def views(layer: int, first: int, count: int) -> tuple[memoryview, ...]:
            return self.kv.block_views(layer, ids[first : first + count])

        return views

    def source(self, transfer_id: str, block_ids: Sequence[int]) -> ViewSource:
        return self._views(block_ids)

    def ranges(self, transfer_id: str, block_ids: Sequence[int]) -> RangeSource | None:
        return None

    def sink(self, transfer_id: str, block_ids: Sequence[int]) -> ViewSource:
        return self._views(block_ids)

    def device_blocks(self, block_ids: Sequence[int]) -> tuple[int, ...] | None:
        return None

    def runs(self, block_ids: Sequence[int]) -> list[list[Run]] | None:
        return None

    def write_blocks(self, layer: int, block_ids: Sequence[int], src: memoryview) -> None:
        self.kv.write_blocks(layer, block_ids, src)

    def land(self, transfer_id: str) -> None:
        pass  # the pull wrote into the blocks themselves

    def release(self, transfer_id: str) -> None:
        pass
