"""The engine's view of KV caches that peers on one host open and copy from directly (cuda_ipc): this worker's
cache, exported once, and peers' exports, opened once per link. `p2pkv.staging` implements it with torch; the
engine itself stays free of torch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from p2pkv.protocol import DeviceExport

Run = tuple[int, int]  # (byte offset in a layer's storage, length)
# (layer, first_block, num_blocks) -> the blocks' byte ranges in that layer's exported storage, in payload order;
# returns once the blocks' bytes are final (the forward that wrote them has finished).
RangeSource = Callable[[int, int, int], list[Run]]


class RemoteCache(Protocol):
    """A peer's exported cache, opened in this process."""

    transport: str  # the name metrics and log lines give the copies ("cuda_ipc")

    def copy_into(self, remote: Sequence[Sequence[Run]], block_ids: Sequence[int], deadline: float) -> int:
        """Copy layer i's `remote[i]` ranges into this worker's blocks `block_ids` of layer i; return the bytes
        copied once they are in place. P2pkvError if that fails or misses the deadline."""

    def close(self) -> None:
        """Idempotent."""


class DeviceAccess(Protocol):
    kind: str  # "cuda" (or "host", the stand-in that runs without a GPU)

    def export(self) -> DeviceExport:
        """This worker's cache, for peers to open."""

    def open(self, export: DeviceExport) -> RemoteCache:
        """A peer's cache; P2pkvError saying why when it cannot be opened here."""
