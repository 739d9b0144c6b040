"""What the security tests attack engines with: a listening engine on loopback with chosen settings, raw sockets,
and connections through the hello as any peer that holds the secret makes them."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace
from typing import Any

from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.handshake import client_handshake
from p2pkv.params import Address
from p2pkv.protocol import FrameLimits, Hello
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
