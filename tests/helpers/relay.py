"""A TCP relay between two engines that flips one byte of the stream in one direction, once: a fault on the wire
that the frames' authentication does not cover (it covers the control message, not the KV payload)."""

from __future__ import annotations

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
            pumps = [threading.Thread(target=self._pump, args=(client, server, first and self._upstream), daemon=True),
                     threading.Thread(target=self._pump, args=(server, client, first and not self._upstream),
                                      daemon=True)]
            first = False
            with self._lock:
                self._sockets += [client, server]
                self._threads += pumps
            for pump in pumps:
                pump.start()

    def _pump(self, src: socket.socket, dst: socket.socket, flip: bool) -> None:
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
            if flip and offset <= self._at < offset + len(data):
                chunk = bytearray(data)
                chunk[self._at - offset] ^= 0xFF
                data = bytes(chunk)
                self.flipped.set()
            offset += len(data)
            try:
                dst.sendall(data)
            except OSError:
                break
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for thread in threads:
            thread.join(timeout=5)
        for sock in sockets:
            sock.close()
