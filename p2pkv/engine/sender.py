"""Pushes layers of KV to peers from one owned thread, over cached per-peer connections with reconnect."""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from p2pkv.engine.handshake import client_handshake
from p2pkv.engine.metrics import EngineMetrics
from p2pkv.engine.threads import engine_thread
from p2pkv.errors import P2pkvError, ProtocolError, TransferError
from p2pkv.params import Address
from p2pkv.protocol import Hello, PayloadCopied, PushAbort, PushAck, PushBlocks
from p2pkv.transport.base import Connection
from p2pkv.transport.shm import ShmConnection

log = logging.getLogger(__name__)
_POLL_S = 0.2
_ACK_POLL_S = 0.0005

Connect = Callable[[Address, float], Connection]


@dataclass(frozen=True)
class PushJob:
    """One layer of one transfer: `views` are the bytes of blocks 0..total_blocks-1, in order."""

    transfer_id: str
    peer: Address
    layer: int
    num_layers: int
    total_blocks: int
    views: tuple[memoryview, ...]
    deadline: float


class OutState(enum.Enum):
    SENDING = "sending"
    DONE = "done"  # every layer sent and the receiver accepted the transfer
    FAILED = "failed"
    REFUSED = "refused"  # the receiver had no space: keep the blocks for it to pull


@dataclass
class Outgoing:
    transfer_id: str
    peer: Address
    num_layers: int
    started: float
    deadline: float
    layers_sent: set[int] = field(default_factory=set)
    nbytes: int = 0
    state: OutState = OutState.SENDING
    reason: str = ""
    acked: bool = False
    transport: str = "tcp"
    by_reference: bool = False  # shm: the receiver reads the layers from our memory and confirms each copy
    layers_copied: set[int] = field(default_factory=set)

    @property
    def awaiting_ack(self) -> bool:
        """Sent something and waits for the receiver's verdict or copy confirmations."""
        copies_due = self.by_reference and len(self.layers_copied) < len(self.layers_sent)
        return self.state is OutState.SENDING and bool(self.layers_sent) and (not self.acked or copies_due)

    @property
    def complete(self) -> bool:
        sent = len(self.layers_sent) == self.num_layers
        return self.acked and sent and (not self.by_reference or len(self.layers_copied) == self.num_layers)


class Sender:
    def __init__(self, connect: Connect, hello: Hello, metrics: EngineMetrics, require_shm: bool = False) -> None:
        self._connect = connect
        self._hello = hello
        self._metrics = metrics
        self._require_shm = require_shm
        self._queue: queue.Queue[PushJob] = queue.Queue()
        self._conns: dict[Address, Connection] = {}
        self._lock = threading.Lock()
        self._transfers: dict[str, Outgoing] = {}
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._stop = threading.Event()
        self._thread = engine_thread(self._loop, "p2pkv-sender")

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: PushJob) -> None:
        with self._lock:
            item = self._transfers.get(job.transfer_id)
            if item is None:
                item = Outgoing(job.transfer_id, job.peer, job.num_layers, time.monotonic(), job.deadline)
                self._transfers[job.transfer_id] = item
            self._pending += 1
        self._queue.put(job)

    def wait_idle(self, deadline: float) -> bool:
        """Block until every submitted job has been handled (PUT mode); False if the deadline passed."""
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
            return True

    def poll(self, transfer_id: str) -> Outgoing | None:
        with self._lock:
            return self._transfers.get(transfer_id)

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._transfers.pop(transfer_id, None)

    def expire(self) -> None:
        """Fail transfers whose deadline passed, so their blocks are released."""
        now = time.monotonic()
        with self._lock:
            for item in self._transfers.values():
                if item.state is OutState.SENDING and now > item.deadline:
                    self._finish_locked(item, OutState.FAILED, "deadline passed")

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                waiting = {t.peer for t in self._transfers.values() if t.awaiting_ack}
            try:
                job = self._queue.get(timeout=_ACK_POLL_S if waiting else _POLL_S)
            except queue.Empty:
                for peer in waiting:
                    self._poll_acks(peer)
                continue
            try:
                self._handle(job)
            except Exception as exc:  # a bug must fail the transfer, not kill the thread
                log.exception("transfer %s: push crashed", job.transfer_id)
                with self._lock:
                    item = self._transfers.get(job.transfer_id)
                    if item is not None and item.state is OutState.SENDING:
                        self._finish_locked(item, OutState.FAILED, f"internal error: {exc!r}")
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _handle(self, job: PushJob) -> None:
        with self._lock:
            item = self._transfers.get(job.transfer_id)
            if item is None or item.state is not OutState.SENDING:
                return
        try:
            conn = self._send_with_retry(job)
        except P2pkvError as exc:
            with self._lock:
                self._finish_locked(item, OutState.FAILED, str(exc))
            self._abort(job, str(exc))
            return
        nbytes = sum(v.nbytes for v in job.views)
        self._metrics.bytes_sent.labels(conn.name).inc(nbytes)
        self._metrics.add("bytes_sent", nbytes)
        with self._lock:
            item.transport = conn.name
            item.by_reference = isinstance(conn, ShmConnection) and conn.sends_by_reference
            item.nbytes += nbytes
            item.layers_sent.add(job.layer)
            self._maybe_done_locked(item)
        self._poll_acks(job.peer)

    def _maybe_done_locked(self, item: Outgoing) -> None:
        if item.state is OutState.SENDING and item.complete:
            self._finish_locked(item, OutState.DONE, "")

    def _poll_acks(self, peer: Address) -> None:
        """Read the receiver's verdicts that have arrived on this peer's connection, without blocking."""
        with self._lock:
            conn = self._conns.get(peer)
        if conn is None:
            return
        try:
            while (got := conn.recv_frame(0, time.monotonic() + 5)) is not None:
                message, payload_len = got
                conn.discard_payload(payload_len, time.monotonic() + 5)
                if isinstance(message, PayloadCopied):
                    self._on_copied(message)
                elif isinstance(message, PushAck):
                    self._on_ack(message)
                else:
                    raise ProtocolError(f"unexpected {type(message).__name__} frame from a receiver")
        except P2pkvError as exc:
            self._drop(peer)
            with self._lock:
                for item in self._transfers.values():
                    if item.peer == peer and item.awaiting_ack:
                        self._finish_locked(item, OutState.FAILED, f"connection lost before the verdict: {exc}")

    def _on_ack(self, ack: PushAck) -> None:
        with self._lock:
            item = self._transfers.get(ack.transfer_id)
            if item is None or item.state is not OutState.SENDING:
                return
            if ack.accepted:
                item.acked = True
                self._maybe_done_locked(item)
            else:
                self._finish_locked(item, OutState.REFUSED, ack.reason)

    def _on_copied(self, copied: PayloadCopied) -> None:
        with self._lock:
            item = self._transfers.get(copied.transfer_id)
            if item is None or item.state is not OutState.SENDING:
                return
            item.layers_copied.add(copied.layer)
            self._maybe_done_locked(item)

    def _finish_locked(self, item: Outgoing, state: OutState, reason: str) -> None:
        item.state, item.reason = state, reason
        ms = (time.monotonic() - item.started) * 1000
        outcome = {OutState.DONE: "ok", OutState.REFUSED: "refused"}.get(state, "failed")
        self._metrics.transfers.labels("send", outcome).inc()
        self._metrics.transfer_seconds.labels("send").observe(ms / 1000)
        log.info("transfer %s send %s peer=%s bytes=%d ms=%.1f transport=%s%s", item.transfer_id, outcome,
                 item.peer, item.nbytes, ms, item.transport, f" reason={reason}" if reason else "")

    def _send_with_retry(self, job: PushJob) -> Connection:
        message = PushBlocks(job.transfer_id, job.layer, 0, job.total_blocks, job.total_blocks, job.num_layers)
        for attempt in (1, 2):
            conn = self._connection(job.peer, job.deadline)
            try:
                conn.send_frame(message, job.views, job.deadline)
                return conn
            except TransferError as exc:
                self._drop(job.peer)
                if attempt == 2 or time.monotonic() >= job.deadline:
                    raise
                log.info("reconnecting to %s after: %s", job.peer, exc)
        raise AssertionError("unreachable")

    def _abort(self, job: PushJob, reason: str) -> None:
        with self._lock:
            conn = self._conns.get(job.peer)
        if conn is None:
            return
        try:
            conn.send_frame(PushAbort(job.transfer_id, reason[:200]), (), time.monotonic() + 1.0)
        except P2pkvError:
            self._drop(job.peer)

    def _connection(self, peer: Address, deadline: float) -> Connection:
        with self._lock:
            conn = self._conns.get(peer)
        if conn is not None and conn.is_alive():
            return conn
        if conn is not None:
            log.info("connection to %s was closed by the peer; reconnecting", peer)
            self._drop(peer)
        conn = client_handshake(self._connect(peer, deadline), self._hello, deadline, self._require_shm)
        with self._lock:
            self._conns[peer] = conn
        return conn

    def _drop(self, peer: Address) -> None:
        with self._lock:
            conn = self._conns.pop(peer, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
        for conn in conns:
            conn.close()
