"""Connections to peers, one per peer, kept between transfers: the handshake runs on first use, and a link found
stale (the peer restarted) is replaced, with one retry of the send that found it so. A link unused for half the
time its listener keeps an idle connection is replaced before use, so no send races the listener's close."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from p2pkv.engine.handshake import client_handshake
from p2pkv.errors import TransferError
from p2pkv.params import Address
from p2pkv.protocol import Hello, Message
from p2pkv.transport.base import Connection

log = logging.getLogger(__name__)

Connect = Callable[[Address, float], Connection]
Frames = Sequence[tuple[Message, Sequence[memoryview]]]


class Links:
    """Thread-safe; the I/O on a link is its user's to serialise (each engine thread uses its own `Links`)."""

    def __init__(self, connect: Connect, hello: Hello, require_shm: bool = False) -> None:
        self._connect = connect
        self._hello = hello
        self._require_shm = require_shm
        self._lock = threading.Lock()
        self._conns: dict[Address, Connection] = {}
        self._used: dict[Address, float] = {}  # when each link last carried our frames (the listener's idle clock)

    def get(self, peer: Address) -> Connection | None:
        """The cached link, if any; no I/O."""
        with self._lock:
            return self._conns.get(peer)

    def _open(self, peer: Address, deadline: float) -> tuple[Connection, bool]:
        """The cached link if it still looks alive (True), else a new one after a handshake (False)."""
        now = time.monotonic()
        with self._lock:
            conn = self._conns.get(peer)
            idle = now - self._used.get(peer, now)
        if conn is not None and conn.peer_idle_s and idle > conn.peer_idle_s / 2:
            log.debug("connection to %s idle for %.0f s; reconnecting before the peer closes it", peer, idle)
            self.drop(peer)
        elif conn is not None and conn.is_alive():
            return conn, True
        elif conn is not None:
            log.info("connection to %s was closed by the peer; reconnecting", peer)
            self.drop(peer)
        conn = client_handshake(self._connect(peer, deadline), self._hello, deadline, self._require_shm)
        with self._lock:
            self._conns[peer] = conn
            self._used[peer] = time.monotonic()
        return conn, False

    def open(self, peer: Address, deadline: float) -> Connection:
        """The link to `peer`, connected and through the handshake; no other I/O (its user sends at once)."""
        conn = self._open(peer, deadline)[0]
        self._sent(peer)
        return conn

    def _sent(self, peer: Address) -> None:
        with self._lock:
            if peer in self._conns:
                self._used[peer] = time.monotonic()

    def send(self, peer: Address, frames: Frames, deadline: float) -> Connection:
        """Send `frames` to `peer`; a send that fails on a cached link is tried once more on a new one."""
        conn, cached = self._open(peer, deadline)
        try:
            conn.send_frames(frames, deadline)
            self._sent(peer)
            return conn
        except TransferError as exc:
            self.drop(peer)
            if not cached:
                raise
            log.info("reconnecting to %s after: %s", peer, exc)
        conn, _ = self._open(peer, deadline)
        try:
            conn.send_frames(frames, deadline)
        except TransferError:
            self.drop(peer)
            raise
        self._sent(peer)
        return conn

    def drop(self, peer: Address) -> None:
        with self._lock:
            conn = self._conns.pop(peer, None)
            self._used.pop(peer, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
            self._used.clear()
        for conn in conns:
            conn.close()
