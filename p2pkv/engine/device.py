"""The engine's view of KV caches that it moves without carrying their bytes itself: caches that peers on one host
open and copy from directly (cuda_ipc: this worker's cache, exported once, and peers' exports, opened once per
link), and pipes, communicators shared with one peer each (nccl). `p2pkv.kv.staging` implements it with torch; the
engine itself stays free of torch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from p2pkv.protocol import DeviceExport, DeviceHome, LayerPlace

Run = tuple[int, int]  # (byte offset in a layer's storage, length)


class Fence:
    """Where the work queued on vLLM's stream had got to when vLLM's thread recorded it (`p2pkv.kv.device_copy`):
    copies into or out of the blocks are issued after it. `event`: the device's record of it (a CUDA event), None
    where work is done as it is issued (the host)."""

    __slots__ = ("event", "thread")

    def __init__(self, event: object, thread: str) -> None:
        self.event = event
        self.thread = thread  # the thread that recorded it
Piece = tuple[int, int, int]  # (storage, byte offset in it, length)


class Placed(NamedTuple):
    """Some blocks of a cache, and where they lie: the block ids (little-endian int32) and, per layer in payload
    order, where that layer's blocks lie in the cache's storages. Either side lists their bytes from it with numpy;
    it stays small whatever the number of blocks."""

    block_ids: bytes
    layers: list[LayerPlace]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids) // 4

    @property
    def nbytes(self) -> int:
        """The payload: every layer's runs of every block."""
        return self.num_blocks * sum(n for p in self.layers for _, n in p.inner)


# (first_block, num_blocks) -> where those blocks of an offer lie in this worker's exported storages; returns once
# their bytes are final (the forward that wrote them has finished).
PlaceSource = Callable[[int, int], Placed]
# integrity_check: the digest of some blocks of this worker's cache, layer after layer (None: its bytes are not
# digested).
CacheDigest = Callable[[Placed], int | None]


class RemoteCache(Protocol):
    """A peer's exported cache, opened in this process."""

    transport: str  # the name metrics and log lines give the copies ("cuda_ipc")

    def copy(self, theirs: Placed, ours: Placed, deadline: float, after: Fence | None = None) -> int:
        """Copy the peer's blocks `theirs` into this worker's `ours` (the same bytes in the same payload order: whole
        blocks, or some heads of some layers), after `after`; return the bytes copied once they are in place.
        P2pkvError if that fails or misses the deadline."""

    def close(self) -> None:
        """Idempotent."""


class DeviceAccess(Protocol):
    kind: str  # "cuda" (or "host", the stand-in that runs without a GPU)

    def export(self) -> DeviceExport:
        """This worker's cache, for peers to open."""

    def open(self, export: DeviceExport) -> RemoteCache:
        """A peer's cache; P2pkvError saying why when it cannot be opened here."""

    def reaches(self, home: DeviceHome) -> bool:
        """Whether a cache exported at `home` would open here: same kind, same host, its GPU visible. Cheap: no
        export is opened."""

    def places(self, block_ids: Sequence[int]) -> Placed:
        """Where these blocks (every layer, every head held here) lie in this worker's storages."""

    def bytes_digest(self, placed: Placed) -> int | None:
        """integrity_check: the digest of these blocks of this worker's cache; None where its bytes are not
        digested (a cache on a GPU)."""



class Pipe(Protocol):
    """A communicator shared with one peer (nccl): blocks go from one cache into the other with no host copy and
    no socket in the data path. Both peers move the same bytes in payload order, in the same chunks."""

    transport: str  # "nccl" (or "gloo", the stand-in that runs without a GPU)

    def send(self, placed: Placed, deadline: float) -> None:
        """Send these blocks of this worker's cache; returns once they have left it. TransferError on a failure
        or a missed deadline, after which the pipe is unusable."""

    def recv(self, placed: Placed, deadline: float, after: Fence | None = None) -> None:
        """Receive into these blocks of this worker's cache, after `after`; returns once they are there."""

    def close(self, abort: bool = False) -> None:
        """Idempotent; frees the communicator. `abort`: the peer may be gone or operations pending (NCCL's abort,
        which does not wait for either)."""


class PipeMaker(Protocol):
    """Makes pipes for links: the client creates (rank 0) and sends the token over the control plane; the listener
    joins with it (rank 1). Both block to a deadline, on threads of their own (`p2pkv.engine.pipes`)."""

    kind: str

    def create(self) -> tuple[bytes, Callable[[float], Pipe]]:
        """The token for the peer, and the call that makes this side's pipe once the peer joins."""

    def join(self, token: bytes, deadline: float) -> Pipe:
        """The listener's side of a pipe the peer created."""

    def places(self, block_ids: Sequence[int]) -> Placed:
        """As `DeviceAccess.places`."""

    def bytes_digest(self, placed: Placed) -> int | None:
        """As `DeviceAccess.bytes_digest`."""
