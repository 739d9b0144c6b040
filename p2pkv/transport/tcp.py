"""TCP data plane: frames and payloads on one stream socket per peer, with deadlines on every call.

The socket is non-blocking; every wait is a `poll` bounded by the call's deadline. Input is read through a small
buffer, so a burst of control frames costs one system call, and payload bytes that arrived with a frame are
copied out of it. A large payload is waited for by the MiB (the socket's low-water mark), not by the segment. Small
replies can be queued (`queue_frame`): they go out with the next send, or before the connection next waits for
input, whichever comes first.
"""

from __future__ import annotations

import ctypes
import select
import socket
import time
from collections.abc import Sequence

from p2pkv.errors import TransferError, TransferTimeout
from p2pkv.integrity import Hasher
from p2pkv.params import Address
from p2pkv.protocol import PREFIX_BYTES, DeviceExport, FrameAuth, FrameLimits, Message, decode_prefix
from p2pkv.transport import held

_SOCKET_BUFFER = 4 << 20
_READ_BUFFER = 64 << 10
_MAX_IOV = 512
_MAX_QUEUED = 64
_MAX_QUEUE_S = 0.002
_QUICKACK = getattr(socket, "TCP_QUICKACK", None)  # Linux
# A large payload is read with the socket's low-water mark raised to this much of it (at most half the receive
# buffer): the reading thread is woken once a MiB has arrived rather than every few segments. Between two engines on
# one 2-core host, pushes ran 19% faster at 4 MiB and 12% faster at 16 MiB (medians of 12 interleaved runs): the
# reader's wake-ups competed with the sending thread for the two cores.
_LOWAT = 1 << 20
_LOWAT_FROM = _READ_BUFFER


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout("deadline passed")
    return left


def tune_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)


def _bytes_view(view: memoryview | bytes) -> memoryview:
    view = memoryview(view)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _out_buffer(buffer: memoryview | bytes) -> memoryview | bytes:
    """`buffer` as `sendmsg` and `len` take it: an encoded frame (bytes) as it is, a view as bytes."""
    return buffer if type(buffer) is bytes else _bytes_view(buffer)


class TcpConnection:
    name = "tcp"
    peer_device: DeviceExport | None = None  # set by the handshake
    peer_pipe: str = ""  # set by the handshake
    pull_instead: bool = False  # set by the handshake
    digests: bool = False  # set by the handshake: payloads both ways carry their digest (integrity_check)
    peer_idle_s: float = 0.0  # set by the handshake: the listener closes the connection after so long idle

    def __init__(self, sock: socket.socket, peer: str, secret: bytes, limits: FrameLimits) -> None:
        sock.setblocking(False)
        self._sock = sock
        self.peer = peer
        self._auth = FrameAuth(secret)
        self._limits = limits
        self._closed = False
        self._readable = select.poll()
        self._readable.register(sock, select.POLLIN)
        self._writable = select.poll()
        self._writable.register(sock, select.POLLOUT)
        self._buffer = bytearray(_READ_BUFFER)
        # Its address, for reads that keep the interpreter lock (`p2pkv.transport.held`); held as an export, which
        # keeps the buffer from being resized (moved) while the connection lives
        self._pinned = (ctypes.c_char * _READ_BUFFER).from_buffer(self._buffer)
        self._buffer_at = ctypes.addressof(self._pinned)
        self._start = 0  # buffered input is self._buffer[self._start:self._end]
        self._end = 0
        self._outbox: list[bytes] = []
        self._queued_at = 0.0
        self._lowat = 1  # the socket's SO_RCVLOWAT
        self._lowat_cap = max(1, min(_LOWAT, sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 2))

    def bind(self, client_nonce: bytes, server_nonce: bytes, client: bool) -> None:
        """The handshake is done: later frames both ways are signed with this connection's own keys (`client`: this
        side sent the hello)."""
        self._auth.bind(client_nonce, server_nonce, client)

    def encode(self, message: Message, payload_len: int) -> bytes:
        """The next frame's prefix and message, signed in sequence: to be sent before any frame encoded after it."""
        return self._auth.encode(message, payload_len)

    @property
    def buffered(self) -> int:
        """Input bytes already read from the socket and not yet consumed."""
        return self._end - self._start

    def fileno(self) -> int:
        return self._sock.fileno()

    @classmethod
    def connect(cls, address: Address, deadline: float, secret: bytes, limits: FrameLimits) -> TcpConnection:
        try:
            sock = socket.create_connection((address.host, address.port), timeout=_remaining(deadline))
        except OSError as exc:
            raise TransferError(f"cannot connect to {address}: {exc}") from None
        tune_socket(sock)
        return cls(sock, str(address), secret, limits)

    # -- sending --

    def send_frame(self, message: Message, payload: Sequence[memoryview], deadline: float) -> None:
        self.send_frames([(message, payload)], deadline)

    def send_frames(self, frames: Sequence[tuple[Message, Sequence[memoryview]]], deadline: float) -> None:
        """Several frames in as few system calls as the socket allows."""
        buffers: list[memoryview | bytes] = []
        for message, payload in frames:
            buffers.append(self._auth.encode(message, sum(v.nbytes for v in payload)))
            buffers.extend(payload)
        self.send_buffers(buffers, deadline)

    def queue_frame(self, message: Message) -> None:
        """A payload-less frame sent with the next send, before the next wait for input, or once the queue is
        old or long (checked as each frame is read)."""
        if not self._outbox:
            self._queued_at = time.monotonic()
        self._outbox.append(self._auth.encode(message, 0))

    def flush(self, deadline: float) -> None:
        if self._outbox:
            self.send_buffers([], deadline)
            self._ack_promptly()

    def _ack_promptly(self) -> None:
        """Have the kernel ACK what arrives at once. Small replies on a stream that mostly flows the other way (a
        verdict per pushed transfer, a pull request per payload) put Linux's TCP into its interactive mode, which
        delays the ACKs that open the sender's window; pushes of 1 MiB ran about 15% slower on loopback."""
        if _QUICKACK is None:
            return
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
        except OSError:  # closed meanwhile: the next call reports it
            pass

    def send_buffers(self, buffers: Sequence[memoryview | bytes], deadline: float) -> None:
        """Queued frames, then `buffers`, in order, with `sendmsg` (partial writes resumed after a poll)."""
        pending = [_out_buffer(b) for b in (*self._outbox, *buffers) if len(b)]
        self._outbox = []
        first = 0
        try:
            if held.AVAILABLE and pending and sum(len(b) for b in pending) <= held.SEND_MAX:
                # Frames without a payload, or a short one: one send that keeps the interpreter lock
                data = b"".join(pending)
                sent = held.send(self._sock.fileno(), data)
                if sent == len(data):
                    return
                pending = [memoryview(data)[sent:]]
            while first < len(pending):
                try:
                    sent = self._sock.sendmsg(pending[first : first + _MAX_IOV])
                except BlockingIOError:
                    self._wait(self._writable, deadline, "send to")
                    continue
                while sent:
                    head = pending[first]
                    if sent >= len(head):
                        sent -= len(head)
                        first += 1
                    else:
                        pending[first] = head[sent:]
                        sent = 0
        except OSError as exc:
            raise TransferError(f"send to {self.peer} failed: {exc}") from None

    # -- receiving --

    def _wait(self, poller: select.poll, deadline: float, what: str) -> None:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise TransferTimeout(f"{what} {self.peer} timed out")

    def _recv_into(self, view: memoryview, deadline: float, wake_at: int = 1, address: int = 0) -> int:
        """Bytes read into `view` (at least one); waits up to the deadline for them, woken once `wake_at` bytes
        have arrived (see `_wake_at`). With `address` (where `view` lies), bytes that have arrived are read keeping
        the interpreter lock (`p2pkv.transport.held`); only a wait lets go of it."""
        while True:
            try:
                if address:
                    got = held.recv(self._sock.fileno(), address, view.nbytes)
                    if got is None:
                        raise BlockingIOError
                    n = got
                else:
                    n = self._sock.recv_into(view)
            except BlockingIOError:
                if self._outbox:
                    self.flush(deadline)
                self._wake_at(wake_at)
                self._wait(self._readable, deadline, "receive from")
                continue
            except OSError as exc:
                raise TransferError(f"receive from {self.peer} failed: {exc}") from None
            if n == 0:
                raise TransferError(f"{self.peer} closed the connection")
            return n

    def _arrived(self) -> bool:
        """Into the empty buffer, what has arrived (`p2pkv.transport.held`): whether anything had. EOF is left to
        the read that follows, which reports it."""
        if not held.AVAILABLE:
            return False
        got = held.recv(self._sock.fileno(), self._buffer_at, len(self._buffer))
        if got == 0:
            return True
        self._end += got or 0
        return got is not None

    def _fill(self, want: int, deadline: float) -> None:
        """Read until at least `want` (at most the buffer size) bytes are buffered."""
        if self._start and self._end + (want - self.buffered) > len(self._buffer):
            kept = self.buffered
            self._buffer[:kept] = self._buffer[self._start : self._end]
            self._start, self._end = 0, kept
        view = memoryview(self._buffer)
        while self.buffered < want:
            at = self._buffer_at + self._end if held.AVAILABLE else 0
            self._end += self._recv_into(view[self._end :], deadline, address=at)

    def _take_bytes(self, n: int, deadline: float) -> bytes:
        if n > len(self._buffer):
            big = bytearray(n)
            self.recv_exact_into(memoryview(big), deadline)
            return bytes(big)
        self._fill(n, deadline)
        out = bytes(self._buffer[self._start : self._start + n])
        self._start += n
        return out

    def recv_exact_into(self, view: memoryview, deadline: float, hasher: Hasher | None = None) -> None:
        """Fill `view` from the stream: buffered bytes first, then straight from the socket; `hasher` digests each
        piece just after it landed."""
        view = _bytes_view(view)
        got = min(self.buffered, view.nbytes)
        if got:
            view[:got] = self._buffer[self._start : self._start + got]
            self._start += got
            if hasher is not None:
                hasher.update(view[:got])
        writable = held.AVAILABLE and view.nbytes > got and not view.readonly and view.c_contiguous
        base = ctypes.addressof(ctypes.c_char.from_buffer(view)) if writable else 0
        try:
            while got < view.nbytes:
                left = view.nbytes - got
                wake_at = min(left, self._lowat_cap) if left >= _LOWAT_FROM else 1
                n = self._recv_into(view[got:], deadline, wake_at, base + got if base else 0)
                if hasher is not None:
                    hasher.update(view[got : got + n])
                got += n
        finally:
            if self._lowat > 1:
                try:
                    self._wake_at(1)
                except TransferError:  # the socket is gone: its next call says so, not this one's clean-up
                    pass

    def _wake_at(self, nbytes: int) -> None:
        """Have the kernel wake this side's waits for input only once `nbytes` have arrived (or the receive window
        is nearly full, or the peer closed). Never more than the bytes still due: the rest may never come. Set just
        before a wait (a read that finds its bytes there costs no system call for it), and back to one byte once a
        payload is in, before `recv_frame` or `is_alive` polls the socket."""
        if nbytes != self._lowat:
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            except OSError as exc:
                raise TransferError(f"connection to {self.peer} unusable: {exc}") from None
            self._lowat = nbytes

    def recv_frame(self, idle_timeout: float, deadline: float) -> tuple[Message, int] | None:
        if self._outbox and (len(self._outbox) >= _MAX_QUEUED or time.monotonic() - self._queued_at > _MAX_QUEUE_S):
            self.flush(deadline)
        if not self.buffered:
            self._start = self._end = 0
            if self._outbox:
                self.flush(deadline)
            try:
                # What has arrived is read keeping the interpreter lock; only a wait for more lets go of it
                if not self._arrived() and ((held.AVAILABLE and idle_timeout <= 0)
                                            or not self._readable.poll(max(0.0, idle_timeout) * 1000)):
                    return None
            except OSError as exc:
                raise TransferError(f"connection to {self.peer} unusable: {exc}") from None
        raw = self._take_bytes(PREFIX_BYTES, deadline)
        prefix = decode_prefix(raw, self._limits)
        body = self._take_bytes(prefix.message_len, deadline)
        return self._auth.decode(raw, prefix, body), prefix.payload_len

    def recv_payload_into(self, view: memoryview, deadline: float, hasher: Hasher | None = None,
                          confirm: bool = True) -> None:
        self.recv_exact_into(view, deadline, hasher)  # nothing to confirm: the bytes came on the socket
        self._ack_promptly()

    def recv_payload_into_all(self, views: Sequence[memoryview], deadline: float,
                              hasher: Hasher | None = None) -> None:
        for view in views:
            self.recv_exact_into(view, deadline, hasher)
        self._ack_promptly()

    def discard_payload(self, nbytes: int, deadline: float) -> None:
        scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
        left = nbytes
        while left > 0:
            chunk = scratch[: min(left, scratch.nbytes)]
            self.recv_exact_into(chunk, deadline)
            left -= chunk.nbytes

    def is_alive(self) -> bool:
        # Peers never send unprompted on a push link, so a readable socket means EOF or a reset (or verdicts,
        # which are data and leave it alive).
        if self._closed:
            return False
        if self.buffered:
            return True
        try:
            if held.AVAILABLE:
                return held.peek(self._sock.fileno())
            if not self._readable.poll(0):
                return True
            return bool(self._sock.recv(1, socket.MSG_PEEK))
        except BlockingIOError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class TcpListener:
    def __init__(self, host: str, port: int, secret: bytes, limits: FrameLimits) -> None:
        self._secret = secret
        self._limits = limits
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise TransferError(f"cannot bind the KV port {host}:{port}: {exc}") from None
        self._sock.listen(64)
        bound = self._sock.getsockname()
        self.address = f"{bound[0]}:{bound[1]}"
        self.port: int = bound[1]
        self._closed = False

    def accept(self, timeout: float) -> TcpConnection | None:
        try:
            ready, _, _ = select.select([self._sock], [], [], timeout)
        except (OSError, ValueError):  # closed meanwhile (by close(), from another thread)
            return None
        if not ready:
            return None
        try:
            sock, addr = self._sock.accept()
        except (BlockingIOError, ConnectionAbortedError):  # the client gave up between the select and the accept
            return None
        except OSError:
            if self._closed:
                return None
            raise  # out of descriptors, say: the caller decides whether to go on
        try:
            tune_socket(sock)
            return TcpConnection(sock, f"{addr[0]}:{addr[1]}", self._secret, self._limits)
        except OSError:  # reset already
            sock.close()
            return None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes a thread waiting in accept() at once (Linux)
            except OSError:
                pass
            self._sock.close()

