"""TCP data plane: frames and payloads on one stream socket per peer, with deadlines on every call."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Sequence

from p2pkv.errors import TransferError, TransferTimeout
from p2pkv.params import Address
from p2pkv.protocol import PREFIX_BYTES, FrameLimits, Message, decode_message, decode_prefix, encode_frame

_SOCKET_BUFFER = 4 << 20


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout("deadline passed")
    return left


def tune_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)


class TcpConnection:
    name = "tcp"

    def __init__(self, sock: socket.socket, peer: str, secret: bytes, limits: FrameLimits) -> None:
        self._sock = sock
        self.peer = peer
        self._secret = secret
        self._limits = limits
        self._closed = False

    @property
    def secret(self) -> bytes:
        return self._secret

    @classmethod
    def connect(cls, address: Address, deadline: float, secret: bytes, limits: FrameLimits) -> TcpConnection:
        try:
            sock = socket.create_connection((address.host, address.port), timeout=_remaining(deadline))
        except OSError as exc:
            raise TransferError(f"cannot connect to {address}: {exc}") from None
        tune_socket(sock)
        return cls(sock, str(address), secret, limits)

    def send_frame(self, message: Message, payload: Sequence[memoryview], deadline: float) -> None:
        total = sum(v.nbytes for v in payload)
        self.send_raw(encode_frame(message, total, self._secret), payload, deadline)

    def send_raw(self, head: bytes, payload: Sequence[memoryview], deadline: float) -> None:
        """`head`, then the payload views, as they are."""
        try:
            self._sock.settimeout(_remaining(deadline))
            self._sock.sendall(head)
            for view in payload:
                self._sock.settimeout(_remaining(deadline))
                self._sock.sendall(view)
        except TimeoutError:
            raise TransferTimeout(f"send to {self.peer} timed out") from None
        except OSError as exc:
            raise TransferError(f"send to {self.peer} failed: {exc}") from None

    def recv_exact_into(self, view: memoryview, deadline: float) -> None:
        """Fill `view` from the stream."""
        got = 0
        try:
            while got < view.nbytes:
                self._sock.settimeout(_remaining(deadline))
                n = self._sock.recv_into(view[got:])
                if n == 0:
                    raise TransferError(f"{self.peer} closed the connection")
                got += n
        except TimeoutError:
            raise TransferTimeout(f"receive from {self.peer} timed out") from None
        except OSError as exc:
            raise TransferError(f"receive from {self.peer} failed: {exc}") from None

    def recv_frame(self, idle_timeout: float, deadline: float) -> tuple[Message, int] | None:
        try:
            ready, _, _ = select.select([self._sock], [], [], max(0.0, idle_timeout))
        except (OSError, ValueError) as exc:
            raise TransferError(f"connection to {self.peer} unusable: {exc}") from None
        if not ready:
            return None
        raw = bytearray(PREFIX_BYTES)
        self.recv_exact_into(memoryview(raw), deadline)
        prefix = decode_prefix(bytes(raw), self._limits)
        body = bytearray(prefix.message_len)
        self.recv_exact_into(memoryview(body), deadline)
        return decode_message(bytes(raw), prefix, bytes(body), self._secret), prefix.payload_len

    def recv_payload_into(self, view: memoryview, deadline: float) -> None:
        self.recv_exact_into(view.cast("B") if view.format != "B" else view, deadline)

    def discard_payload(self, nbytes: int, deadline: float) -> None:
        scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
        left = nbytes
        while left > 0:
            chunk = scratch[: min(left, scratch.nbytes)]
            self.recv_exact_into(chunk, deadline)
            left -= chunk.nbytes

    def is_alive(self) -> bool:
        # Peers never send unprompted on a push link, so a readable socket means EOF or a reset.
        if self._closed:
            return False
        try:
            ready, _, _ = select.select([self._sock], [], [], 0)
            if not ready:
                return True
            return bool(self._sock.recv(1, socket.MSG_PEEK))
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
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready:
            return None
        try:
            sock, addr = self._sock.accept()
        except OSError:
            return None
        tune_socket(sock)
        return TcpConnection(sock, f"{addr[0]}:{addr[1]}", self._secret, self._limits)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()

