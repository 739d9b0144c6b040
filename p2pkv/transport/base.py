"""The transport seam: a framed, deadline-bound connection between two engines, and a listener for them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from p2pkv.integrity import Hasher
from p2pkv.protocol import DeviceExport, Message


class Connection(Protocol):
    """One peer link. Every call takes an absolute `time.monotonic()` deadline."""

    name: str
    peer: str
    peer_device: DeviceExport | None  # the peer's exported KV cache, when the handshake brought one (cuda_ipc)
    peer_pipe: str  # the pipe kind both sides can make (nccl), or empty
    pull_instead: bool  # client side: the listener pulls over a device path rather than take pushed blocks
    digests: bool  # either side asked for integrity checks: every payload frame carries its digest
    peer_idle_s: float  # client side: the listener closes the connection after so long without a frame; 0: never

    def send_frame(self, message: Message, payload: Sequence[memoryview], deadline: float) -> None:
        """Send one message followed by the concatenation of `payload`."""

    def send_frames(self, frames: Sequence[tuple[Message, Sequence[memoryview]]], deadline: float) -> None:
        """Several frames, in order, in as few system calls as the transport allows."""

    def bind(self, client_nonce: bytes, server_nonce: bytes, client: bool) -> None:
        """The handshake is done: later frames both ways are signed with this connection's own keys, one per
        direction (`p2pkv.protocol.FrameAuth`; `client`: this side sent the hello)."""

    def queue_frame(self, message: Message) -> None:
        """A payload-less frame to send with the next send, or before the connection next waits for input."""

    def flush(self, deadline: float) -> None:
        """Send the queued frames now."""

    def fileno(self) -> int:
        """The descriptor to poll for incoming frames."""

    def recv_frame(self, idle_timeout: float, deadline: float) -> tuple[Message, int] | None:
        """Next message and the length of its payload; None when nothing arrived within `idle_timeout`."""

    def recv_payload_into(self, view: memoryview, deadline: float, hasher: Hasher | None = None,
                          confirm: bool = True) -> None:
        """Fill `view` with the next payload bytes; `hasher` (integrity_check) is updated with them, in order, as
        they land (tcp: piece by piece, while they are in the cache). shm: the copy is confirmed to the sender at
        once, or, without `confirm`, queued for the caller's next `flush`."""

    def recv_payload_into_all(self, views: Sequence[memoryview], deadline: float,
                              hasher: Hasher | None = None) -> None:
        """Fill each view in turn with the next payload bytes (shm: with one copy where it can)."""

    def discard_payload(self, nbytes: int, deadline: float) -> None:
        """Read and drop `nbytes` payload bytes."""

    def is_alive(self) -> bool:
        """False once the peer has closed its end (a restarted peer leaves such a stale link behind)."""

    def close(self) -> None:
        """Idempotent."""


class Listener(Protocol):
    address: str

    def accept(self, timeout: float) -> Connection | None:
        """A new inbound connection, or None after `timeout` seconds."""

    def close(self) -> None:
        """Idempotent."""
