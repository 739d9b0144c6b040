"""The first exchange on every connection: Hello and the verdict, and the shm data path when both sides can set
it up (same host, each able to read the other's memory); otherwise the connection stays plain TCP."""

from __future__ import annotations

import logging
import os
import time

import msgspec

from p2pkv.errors import IncompatiblePeerError, P2pkvError, ProtocolError, TransferError
from p2pkv.protocol import NONCE_BYTES, CmaOffer, CmaStatus, DeviceExport, Hello, HelloReply
from p2pkv.transport import cma
from p2pkv.transport.base import Connection
from p2pkv.transport.shm import ShmConnection
from p2pkv.transport.tcp import TcpConnection

log = logging.getLogger(__name__)
_warned: set[str] = set()


def local_offer() -> CmaOffer | None:
    """This process's shm offer, or None where cross-memory attach does not exist."""
    if not cma.available():
        return None
    cma.allow_readers()
    address, token = cma.token()
    return CmaOffer(os.getpid(), cma.boot_id(), address, token)


def why_unreadable(offer: CmaOffer | None) -> str:
    """Empty when the peer's memory can be read directly; otherwise the reason."""
    if offer is None:
        return "the peer does not offer shm"
    if offer.boot_id != cma.boot_id():
        return "the peer is on another host"
    return cma.probe(offer.pid, offer.token_address, offer.token)


def _note_fallback(peer: str, reason: str, loud: bool) -> None:
    if peer in _warned:
        return
    _warned.add(peer)
    (log.warning if loud else log.info)("shm with %s is not possible (%s); using tcp", peer, reason)


def client_handshake(conn: Connection, hello: Hello, deadline: float, require_shm: bool = False) -> Connection:
    """Send our layout (under a nonce of its own); raise IncompatiblePeerError with the peer's reasons if it refuses
    us. Closes on error. Returns the connection to use, bound to its own key: `conn` itself, or an shm connection
    over it."""
    hello = msgspec.structs.replace(hello, nonce=os.urandom(NONCE_BYTES))
    try:
        conn.send_frame(hello, (), deadline)
        try:
            got = conn.recv_frame(max(0.0, deadline - time.monotonic()), deadline)
        except TransferError as exc:
            # A listener that cannot check our hello closes at once and says nothing (nor does one at its cap).
            raise TransferError(f"{conn.peer} closed the connection at our hello (authentication failed? "
                                f"auth_secret must be the same on both sides): {exc}") from None
        if got is None or not isinstance(got[0], HelloReply):
            raise TransferError(f"no handshake reply from {conn.peer}")
        reply = got[0]
        if reply.hello_nonce != hello.nonce:
            raise ProtocolError(f"authentication failed: the reply of {conn.peer} answers another hello")
        if not reply.accepted:
            raise IncompatiblePeerError(f"peer {conn.peer} refused us: {reply.reason}")
        conn.bind(hello.nonce, reply.nonce, client=True)
        conn.peer_device = reply.device
        conn.peer_pipe = reply.pipe_kind if reply.pipe_kind == hello.pipe_kind else ""
        conn.pull_instead = reply.pull_instead
        conn.digests = hello.digests or reply.digests
        conn.peer_idle_s = reply.idle_s
        if hello.cma is None or not isinstance(conn, TcpConnection):
            return conn
        reason = why_unreadable(reply.cma)
        if reply.cma is not None:
            conn.send_frame(CmaStatus(reads_you=not reason), (), deadline)
        if reason and not reply.reads_you:
            _note_fallback(conn.peer, reason, require_shm)
            return conn
        pid = reply.cma.pid if reply.cma is not None else 0
        shm = ShmConnection(conn, pid, sends_by_reference=reply.reads_you, reads_by_reference=not reason)
        shm.peer_device, shm.peer_pipe, shm.pull_instead = reply.device, conn.peer_pipe, reply.pull_instead
        shm.digests, shm.peer_idle_s = conn.digests, reply.idle_s
        return shm
    except P2pkvError:
        conn.close()
        raise


def server_reply(conn: Connection, hello: Hello, offer: CmaOffer | None, deadline: float,
                 device: DeviceExport | None = None, pipe_kind: str = "", pull_instead: bool = False,
                 digests: bool = False, idle_s: float = 0.0) -> Connection:
    """Accept a compatible client; with shm on both sides, answer with our offer and wrap the connection. Our
    device export goes to a client that can open that kind (cuda_ipc); a pipe is agreed when both make its kind.
    `pull_instead`: ask the client to leave its pushes for us to pull over that device path. `digests`: we check
    integrity; the link does when either side asks. `idle_s`: how long we keep the connection without a frame."""
    export = device if device is not None and hello.device_kind == device.kind else None
    pipe = pipe_kind if pipe_kind and hello.pipe_kind == pipe_kind else ""
    nonce = os.urandom(NONCE_BYTES)
    if offer is None or hello.cma is None or not isinstance(conn, TcpConnection):
        conn.send_frame(HelloReply(accepted=True, device=export, pipe_kind=pipe, pull_instead=pull_instead,
                                   digests=digests, idle_s=idle_s, nonce=nonce, hello_nonce=hello.nonce), (),
                        deadline)
        conn.bind(hello.nonce, nonce, client=False)
        conn.peer_pipe, conn.digests = pipe, digests or hello.digests
        return conn
    reason = why_unreadable(hello.cma)
    conn.send_frame(HelloReply(accepted=True, cma=offer, reads_you=not reason, device=export, pipe_kind=pipe,
                               pull_instead=pull_instead, digests=digests, idle_s=idle_s, nonce=nonce,
                               hello_nonce=hello.nonce), (), deadline)
    conn.bind(hello.nonce, nonce, client=False)
    # The client answers our offer with a CmaStatus frame, which the shm connection consumes.
    shm = ShmConnection(conn, hello.cma.pid, sends_by_reference=False, reads_by_reference=not reason)
    shm.peer_pipe, shm.digests = pipe, digests or hello.digests
    return shm
