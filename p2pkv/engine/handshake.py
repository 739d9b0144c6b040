"""The first exchange on every connection an engine opens: our Hello, the peer's verdict."""

from __future__ import annotations

import time

from p2pkv.errors import IncompatiblePeerError, P2pkvError, TransferError
from p2pkv.protocol import Hello, HelloReply
from p2pkv.transport.base import Connection


def client_handshake(conn: Connection, hello: Hello, deadline: float) -> None:
    """Send our layout; raise IncompatiblePeerError with the peer's reasons if it refuses us. Closes on error."""
    try:
        conn.send_frame(hello, (), deadline)
        got = conn.recv_frame(max(0.0, deadline - time.monotonic()), deadline)
        if got is None or not isinstance(got[0], HelloReply):
            raise TransferError(f"no handshake reply from {conn.peer}")
        if not got[0].accepted:
            raise IncompatiblePeerError(f"peer {conn.peer} refused us: {got[0].reason}")
    except P2pkvError:
        conn.close()
        raise
