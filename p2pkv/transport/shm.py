"""The shm transport: control frames on the TCP connection, payload bytes read straight from the sender's memory.

After a handshake in which both sides proved they can read each other (`p2pkv.transport.cma`), a payload is not
written to the socket: the frame is followed by a descriptor, the list of (address, length) ranges of the payload
in the sender's memory, and the reader copies it with one `process_vm_readv` into its destination (a staging
buffer, or the decode instance's KV blocks when it pulls); payloads of 8 MiB and up are copied half by the reading
thread and half by a helper thread the connection owns (`p2pkv.transport.split_read`). The reader then sends
`PayloadCopied`; until it arrives, the sender keeps that memory unchanged (its transfer is not done).

Each direction is agreed on its own: `sends_by_reference` (the peer reads my payloads) and `reads_by_reference`
(I read the peer's). A direction that could not be set up carries payload bytes on the socket, as TCP does.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from p2pkv.errors import ProtocolError, TransferError
from p2pkv.integrity import Hasher
from p2pkv.protocol import CmaStatus, DeviceExport, Message, PayloadCopied, PushBlocks
from p2pkv.transport import cma
from p2pkv.transport.split_read import SplitReader
from p2pkv.transport.tcp import TcpConnection

MAX_RANGES = 1 << 16
_COUNT = struct.Struct("!I")
_RANGE = struct.Struct("!QQ")


def encode_ranges(payload: Sequence[memoryview]) -> bytes:
    """The descriptor of a payload: its (address, length) ranges in our memory, in order, merged where one ends
    where the next starts (a transfer's layers often lie back to back: one range for the reader, not one each)."""
    flat: list[int] = []  # address, length, address, length, ...
    end = -1
    for view in payload:
        n = view.nbytes
        if not n:
            continue
        address = cma.address_of(view)
        if address == end:
            flat[-1] += n
        else:
            flat += (address, n)
        end = address + n
    count = len(flat) // 2
    if count > MAX_RANGES:
        raise TransferError(f"a payload of {count} ranges exceeds the cap of {MAX_RANGES}")
    return _COUNT.pack(count) + struct.pack(f"!{len(flat)}Q", *flat)


class ShmConnection:
    name = "shm"
    peer_device: DeviceExport | None = None  # set by the handshake
    peer_pipe: str = ""  # set by the handshake
    pull_instead: bool = False  # set by the handshake
    digests: bool = False  # set by the handshake: payloads both ways carry their digest (integrity_check)
    peer_idle_s: float = 0.0  # set by the handshake: the listener closes the connection after so long idle

    def __init__(self, inner: TcpConnection, peer_pid: int, sends_by_reference: bool,
                 reads_by_reference: bool) -> None:
        self._inner = inner
        self.peer = inner.peer
        self.peer_pid = peer_pid
        self.sends_by_reference = sends_by_reference
        self.reads_by_reference = reads_by_reference
        self._reader = SplitReader(peer_pid)  # no thread until a large payload is read
        # The payload being read: its frame, and the peer's ranges not yet copied.
        self._frame: PushBlocks | None = None
        self._ranges: list[tuple[int, int]] = []
        self._left = 0

    def fileno(self) -> int:
        return self._inner.fileno()

    def send_frame(self, message: Message, payload: Sequence[memoryview], deadline: float) -> None:
        self.send_frames([(message, payload)], deadline)

    def send_frames(self, frames: Sequence[tuple[Message, Sequence[memoryview]]], deadline: float) -> None:
        if not self.sends_by_reference:
            self._inner.send_frames(frames, deadline)
            return
        buffers: list[bytes] = []
        for message, payload in frames:
            total = sum(v.nbytes for v in payload)
            buffers.append(self._inner.encode(message, total))
            if total:
                buffers.append(encode_ranges(payload))
        self._inner.send_buffers(buffers, deadline)

    def bind(self, client_nonce: bytes, server_nonce: bytes, client: bool) -> None:
        self._inner.bind(client_nonce, server_nonce, client)

    def queue_frame(self, message: Message) -> None:
        self._inner.queue_frame(message)

    def flush(self, deadline: float) -> None:
        self._inner.flush(deadline)

    def recv_frame(self, idle_timeout: float, deadline: float) -> tuple[Message, int] | None:
        while True:
            got = self._inner.recv_frame(idle_timeout, deadline)
            if got is None:
                return None
            message, payload_len = got
            if isinstance(message, CmaStatus):
                # The client's answer to our offer; it precedes every other frame from that client.
                self.sends_by_reference = message.reads_you
                continue
            if payload_len and self.reads_by_reference:
                if not isinstance(message, PushBlocks):
                    raise ProtocolError(f"a {type(message).__name__} frame carries no payload")
                self._read_ranges(message, payload_len, deadline)
            return message, payload_len

    def _read_ranges(self, frame: PushBlocks, payload_len: int, deadline: float) -> None:
        raw = bytearray(_COUNT.size)
        self._inner.recv_exact_into(memoryview(raw), deadline)
        (count,) = _COUNT.unpack(raw)
        if count > MAX_RANGES:
            raise ProtocolError(f"a descriptor of {count} ranges exceeds the cap of {MAX_RANGES}")
        body = bytearray(count * _RANGE.size)
        self._inner.recv_exact_into(memoryview(body), deadline)
        flat = struct.unpack(f"!{2 * count}Q", body)
        ranges = list(zip(flat[::2], flat[1::2], strict=True))
        if sum(flat[1::2]) != payload_len:
            raise ProtocolError(f"descriptor ranges hold {sum(flat[1::2])} bytes, the frame says {payload_len}")
        self._frame, self._ranges, self._left = frame, ranges, payload_len

    def _take(self, nbytes: int) -> list[tuple[int, int]]:
        """The next `nbytes` of the peer's ranges."""
        if nbytes > self._left:
            raise ProtocolError(f"asked for {nbytes} payload bytes, {self._left} left in the frame")
        taken, self._ranges = cma.split_ranges(self._ranges, nbytes)
        return taken

    def _consumed(self, nbytes: int, deadline: float, confirm: bool = True) -> None:
        self._left -= nbytes
        if self._left == 0 and self._frame is not None:
            frame, self._frame = self._frame, None
            # At once (or at the caller's flush, right after it counted the bytes in), with the transfer's verdict
            # if it is queued: the sender finishes the transfer and pushes the next one while we copy the frames
            # already here. (Holding confirmations back while more frames were buffered, to send them together,
            # stalled the sender's window: 3.1 to 3.5 GB/s at 1 MiB, against 4.5 to 5.3 flushed at once.)
            self._inner.queue_frame(PayloadCopied(frame.transfer_id, frame.layer, frame.layers))
            if confirm:
                self._inner.flush(deadline)

    def recv_payload_into(self, view: memoryview, deadline: float, hasher: Hasher | None = None,
                          confirm: bool = True) -> None:
        self.recv_payload_into_all((view,), deadline, hasher, confirm)

    def recv_payload_into_all(self, views: Sequence[memoryview], deadline: float,
                              hasher: Hasher | None = None, confirm: bool = True) -> None:
        if not self.reads_by_reference:
            self._inner.recv_payload_into_all(views, deadline, hasher)
            return
        views = [v.cast("B") if v.format != "B" else v for v in views]
        total = sum(v.nbytes for v in views)
        self._reader.read(views, self._take(total))
        self._consumed(total, deadline, confirm)  # the sender may go on; the digest is ours to take
        if hasher is not None:
            for view in views:
                hasher.update(view)

    def discard_payload(self, nbytes: int, deadline: float) -> None:
        if not self.reads_by_reference:
            self._inner.discard_payload(nbytes, deadline)
            return
        if nbytes:
            self._take(nbytes)
            self._consumed(nbytes, deadline)

    def is_alive(self) -> bool:
        return self._inner.is_alive()

    def close(self) -> None:
        self._reader.close()
        self._inner.close()
