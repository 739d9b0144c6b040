"""The engine's view of KV caches that it moves without carrying their bytes itself: caches that peers on one host
open and copy from directly (cuda_ipc: this worker's cache, exported once, and peers' exports, opened once per
link), and pipes, communicators shared with one peer each (nccl). `p2pkv.staging` implements it with torch; the
engine itself stays free of torch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from p2pkv.errors import P2pkvError
from p2pkv.protocol import DeviceExport, DeviceHome

Run = tuple[int, int]  # (byte offset in a layer's storage, length)
# (layer, first_block, num_blocks) -> the blocks' byte ranges in that layer's exported storage, in payload order;
# returns once the blocks' bytes are final (the forward that wrote them has finished).
RangeSource = Callable[[int, int, int], list[Run]]
Piece = tuple[int, int, int]  # (layer, byte offset in that layer's storage, length)
# integrity_check: the digest of pieces of this worker's cache, in order (None: its bytes are not digested).
CacheDigest = Callable[[Sequence[Piece]], int | None]


class RemoteCache(Protocol):
    """A peer's exported cache, opened in this process."""

    transport: str  # the name metrics and log lines give the copies ("cuda_ipc")

    def copy_into(self, remote: Sequence[Sequence[Run]], block_ids: Sequence[int], deadline: float) -> int:
        """Copy layer i's `remote[i]` ranges into this worker's blocks `block_ids` of layer i; return the bytes
        copied once they are in place. P2pkvError if that fails or misses the deadline."""

    def copy_runs(self, pairs: Sequence[tuple[int, int, Sequence[Run], Sequence[Run]]], deadline: float) -> int:
        """Per (their layer, our layer, their ranges, our runs): copy the bytes of those ranges of the peer's
        storage into those runs of ours, in order (some heads of some layers: a pull by slices). As `copy_into`."""

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

    def runs(self, layer: int, block_ids: Sequence[int]) -> list[Run]:
        """Where these blocks lie in this worker's storage of `layer`, in payload order."""

    def bytes_digest(self, pieces: Sequence[Piece]) -> int | None:
        """integrity_check: the digest of these pieces of this worker's cache, in order; None where its bytes are
        not digested (a cache on a GPU)."""



def pair_ranges(remote: Sequence[Run], local: Sequence[Run]) -> list[tuple[int, int, int]]:
    """Two lists of ranges holding the same bytes in the same order, as (remote offset, local offset, length)
    pieces, cut where either side's range ends. Both peers of a pipe cut the same way from the same two lists."""
    out: list[tuple[int, int, int]] = []
    r = [list(x) for x in remote if x[1]]
    lo = [list(x) for x in local if x[1]]
    i = j = 0
    while i < len(r) and j < len(lo):
        n = min(r[i][1], lo[j][1])
        out.append((r[i][0], lo[j][0], n))
        for ranges, k in ((r, i), (lo, j)):
            ranges[k][0] += n
            ranges[k][1] -= n
        if not r[i][1]:
            i += 1
        if not lo[j][1]:
            j += 1
    if i < len(r) or j < len(lo):
        raise P2pkvError("the remote ranges and the local blocks hold different numbers of bytes")
    return out


class Pipe(Protocol):
    """A communicator shared with one peer (nccl): blocks go from one cache into the other with no host copy and
    no socket in the data path. Both peers post the same pieces, in the same order."""

    transport: str  # "nccl" (or "gloo", the stand-in that runs without a GPU)

    def send(self, pieces: Sequence[Piece], deadline: float) -> None:
        """Send these pieces of this worker's cache; returns once they have left it. TransferError on a failure
        or a missed deadline, after which the pipe is unusable."""

    def recv(self, pieces: Sequence[Piece], deadline: float) -> None:
        """Receive into these pieces of this worker's cache; returns once they are there."""

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

    def runs(self, layer: int, block_ids: Sequence[int]) -> list[Run]:
        """Where these blocks lie in this worker's storage of `layer`, in payload order."""

    def bytes_digest(self, pieces: Sequence[Piece]) -> int | None:
        """As `DeviceAccess.bytes_digest`."""
