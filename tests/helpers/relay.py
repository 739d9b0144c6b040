"""TCP relays that put a fault on the wire, once: `FlipRelay` between two engines flips one byte of the stream in
one direction (a fault that the frames' authentication does not cover: it covers the control message, not the KV
payload); `CutRelay` in front of an HTTP server cuts a streamed answer off after some of its events, as a decode
instance that dies mid-stream does."""

from __future__ import annotations

import contextlib
import select
import socket
import threading

from p2pkv.params import Address

_POLL_S = 0.2


class FlipRelay:
    """Listens on `address`; each connection is relayed to `target`. The byte at offset `at` of the first
    connection's stream, client to server (`upstream`) or server to client, is inverted on its way through."""

    def __init__(self, target: str, at: int, upstream: bool) -> None:
        self._target = Address.parse(target)
        self._at = at
        self._upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL_S)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.flipped = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        first = True
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            # Each pump waits for input in select; a send that cannot go on for 10 s ends the relay.
            client.settimeout(10)
            server = socket.create_connection((self._target.host, self._target.port), timeout=10)
            pumps = [threading.Thread(target=self._pump, args=(client, server, first and self._upstream, False),
                                      daemon=True),
                     threading.Thread(target=self._pump, args=(server, client, first and not self._upstream, True),
                                      daemon=True)]
            first = False
            with self._lock:
                self._sockets += [client, server]
                self._threads += pumps
            for pump in pumps:
                pump.start()

    def _pump(self, src: socket.socket, dst: socket.socket, flip: bool, to_client: bool) -> None:
        offset = 0
        while not self._stop.is_set():
            try:
                if not select.select([src], [], [], _POLL_S)[0]:
                    continue
                data = src.recv(1 << 16)
            except OSError:
                break
            if not data:
                break
            passed = self._alter(data, offset, flip, to_client)
            offset += len(data)
            try:
                dst.sendall(passed if passed is not None else data)
            except OSError:
                break
            if passed is not None and len(passed) < len(data):  # cut off here: both connections end at once
                for sock in (src, dst):
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                return
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _alter(self, data: bytes, offset: int, flip: bool, to_client: bool) -> bytes | None:
        """What goes on of `data`, found at `offset` of its stream (None: all of it, as it is); a prefix of it
        cuts the connection there. `to_client`: server to client."""
        if flip and offset <= self._at < offset + len(data):
            chunk = bytearray(data)
            chunk[self._at - offset] ^= 0xFF
            self.flipped.set()
            return bytes(chunk)
        return None

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for thread in threads:
            thread.join(timeout=5)
        for sock in sockets:
            sock.close()


class CutRelay(FlipRelay):
    """In front of an HTTP server: the first event stream that comes back (server to client) is cut off after
    `events` of its events, with both connections closed at once."""

    def __init__(self, target: str, events: int) -> None:
        self._events = events
        self._seen = b""  # the server-to-client bytes of the stream not cut yet, from its event-stream headers on
        super().__init__(target, at=-1, upstream=True)  # no byte flipped

    def _alter(self, data: bytes, offset: int, flip: bool, to_client: bool) -> bytes | None:
        if not to_client or self.flipped.is_set():
            return None
        with self._lock:
            if self.flipped.is_set():
                return None
            seen = self._seen + data
            start = seen.find(b"text/event-stream")
            if start < 0:
                self._seen = seen[-64:]
                return None
            at, count = start, 0
            while (at := seen.find(b"data: ", at + 1)) >= 0:
                count += 1
                if count > self._events:  # the event after the last one let through begins here
                    self.flipped.set()
                    return data[: max(0, at - len(self._seen))]
            self._seen = seen
        return None
