"""What the security tests attack engines with: a listening engine on loopback with chosen settings, raw sockets,
connections through the hello as any peer that holds the secret makes them, and a recording man in the middle."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np

from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.handshake import client_handshake
from p2pkv.engine.store import StageState
from p2pkv.params import Address
from p2pkv.protocol import PREFIX_BYTES, FrameLimits, Hello, decode_prefix
from p2pkv.transport.base import Connection
from p2pkv.transport.tcp import TcpConnection
from tests.helpers.peer import engine_config, layout
from tests.helpers.procs import BLOCK_BYTES, LAYERS


def listening(secret: str, **settings: Any) -> TransferEngine:
    """A started engine on loopback with the test's layout; `settings` replace fields of its EngineSettings."""
    base = EngineSettings.from_config(engine_config(kv_host="127.0.0.1", auth_secret=secret), 0, 0)
    engine = TransferEngine(replace(base, **settings), layout(LAYERS, BLOCK_BYTES))
    engine.start()
    return engine


def raw(address: str) -> socket.socket:
    peer = Address.parse(address)
    return socket.create_connection((peer.host, peer.port), timeout=5)


def closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    """The listener closed this connection (EOF or reset) within `within_s`; anything it sent first is skipped."""
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if sock.recv(65536) == b"":
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


def handshaken(address: str, secret: str, sock: socket.socket | None = None) -> Connection:
    """A connection through the hello (on `sock` if given), as a peer with the secret makes one."""
    deadline = time.monotonic() + 5
    if sock is None:
        conn = TcpConnection.connect(Address.parse(address), deadline, secret.encode(), FrameLimits())
    else:
        conn = TcpConnection(sock, address, secret.encode(), FrameLimits())
    return client_handshake(conn, Hello("attacker", 0, layout(LAYERS, BLOCK_BYTES)), deadline)


def readers() -> int:
    """Reader threads of the listeners in this process."""
    return sum(1 for t in threading.enumerate() if t.name.startswith("p2pkv-reader"))


def wait_for(check: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return bool(check())


class Recorder:
    """A man in the middle on loopback: relays each connection to `target`, records what each client sent, and
    plays bytes into the latest connection towards the server (`inject`, between the client's frames)."""

    def __init__(self, target: str) -> None:
        self._target = Address.parse(target)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.sent: list[bytearray] = []  # per connection, the client's bytes
        self._servers: list[socket.socket] = []
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.create_connection((self._target.host, self._target.port), timeout=5)
            record = bytearray()
            pumps = [threading.Thread(target=self._pump, args=(client, server, record), daemon=True),
                     threading.Thread(target=self._pump, args=(server, client, None), daemon=True)]
            with self._lock:
                self.sent.append(record)
                self._servers.append(server)
                self._sockets += [client, server]
                self._threads += pumps
            for pump in pumps:
                pump.start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
        while not self._stop.is_set():
            try:
                if not select.select([src], [], [], 0.2)[0]:
                    continue
                data = src.recv(1 << 16)
                if not data:
                    break
                with self._lock:
                    if record is not None:
                        record += data
                    dst.sendall(data)
            except OSError:
                break
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def inject(self, data: bytes) -> None:
        with self._lock:
            self._servers[-1].sendall(data)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5)
        for sock in self._sockets:
            sock.close()


def frames(stream: bytes) -> list[bytes]:
    """A recorded tcp stream cut into whole frames (prefix, message and payload each)."""
    out: list[bytes] = []
    at = 0
    while at + PREFIX_BYTES <= len(stream):
        prefix = decode_prefix(stream[at : at + PREFIX_BYTES], FrameLimits())
        end = at + PREFIX_BYTES + prefix.message_len + prefix.payload_len
        out.append(stream[at:end])
        at = end
    return out


def landed_exact(receiver: TransferEngine, tid: str, data: np.ndarray) -> bool:
    """The transfer completed on `receiver` holding exactly `data` (a row per layer); taken and let go."""
    assert receiver.wait_staged(tid, 10) is StageState.COMPLETE
    item = receiver.take_staged(tid)
    assert item is not None
    try:
        return all(np.array_equal(np.frombuffer(item.layer_view(layer), dtype=np.uint8), data[layer])
                   for layer in range(LAYERS))
    finally:
        receiver.release_staged(item)
