"""Pushes layers of KV to peers from one owned thread, over cached per-peer connections with reconnect."""

from __future__ import annotations

import collections
import enum
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from p2pkv.engine.links import Connect, Links
from p2pkv.engine.metrics import EngineMetrics
from p2pkv.errors import P2pkvError, ProtocolError
from p2pkv.integrity import digest
from p2pkv.params import Address
from p2pkv.protocol import Hello, Message, PayloadCopied, PullInstead, PushAbort, PushAck, PushBlocks
from p2pkv.transport import held
from p2pkv.transport.base import Connection
from p2pkv.transport.shm import ShmConnection
from p2pkv.transport.threads import engine_thread
from p2pkv.way import WhyPull, push_or_pull

log = logging.getLogger(__name__)
_POLL_S = 0.2
_MAX_BATCH = 256
# shm: how long after a transfer ended without every copy confirmed its receiver may still be reading it (a read is
# one system call, started as the frame arrives)
_COPY_GRACE_S = 5.0



@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs several times more, 8+ times a transfer
class PushJob:
    """Layers `layer .. layer + layers - 1` of one transfer: `views` are the bytes of blocks 0..total_blocks-1 of
    each layer, layer after layer."""

    transfer_id: str
    peer: Address
    layer: int
    num_layers: int
    total_blocks: int
    views: tuple[memoryview, ...]
    deadline: float
    ready: Callable[[float], bool] | None = None  # staged device KV: waits (to a deadline) until `views` hold it
    pull_instead: bool = False  # the link asked for pulls (its handshake): no views, send PullInstead for it
    layers: int = 1  # consecutive layers from `layer` (a worker that queues a whole transfer at once: one job)
    out: Outgoing | None = None  # its transfer, once submitted
    prompt: str = ""  # the digest of the prompt it was computed for (`PushBlocks.prompt`)
    skip: int = 0  # blocks at the layer's start not sent, outside its sliding window (`views` hold the rest)
    skips: tuple[int, ...] = ()  # every layer's `skip` (`PushBlocks.skips`)


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
    jobs: int = 0  # submitted and not yet handled by the sender's thread: their views may still be read
    ended: float = 0.0  # when it stopped sending

    @property
    def awaiting_ack(self) -> bool:
        """Sent something and waits for the receiver's verdict or copy confirmations."""
        if self.state is not OutState.SENDING or not self.layers_sent:
            return False
        return not self.acked or (self.by_reference and len(self.layers_copied) < len(self.layers_sent))

    @property
    def complete(self) -> bool:
        sent = len(self.layers_sent) == self.num_layers
        return self.acked and sent and (not self.by_reference or len(self.layers_copied) == self.num_layers)


def _frames(jobs: list[PushJob], digests: bool = False) -> list[tuple[PushBlocks, tuple[memoryview, ...]]]:
    """One frame per run of consecutive layers of one transfer (whole layers lie back to back at the receiver);
    with `digests` (integrity_check on the link), each carries its payload's digest."""
    frames: list[tuple[PushBlocks, tuple[memoryview, ...]]] = []
    start = 0
    while start < len(jobs):
        first = jobs[start]
        end, after = start + 1, first.layer + first.layers  # the layer that would come next in this frame
        while (end < len(jobs) and jobs[end].transfer_id == first.transfer_id and not first.skip
               and jobs[end].layer == after and jobs[end].total_blocks == first.total_blocks and not jobs[end].skip):
            after += jobs[end].layers
            end += 1
        views = first.views if end == start + 1 else tuple(v for job in jobs[start:end] for v in job.views)
        frames.append((PushBlocks(first.transfer_id, first.layer, first.skip, first.total_blocks - first.skip,
                                  first.total_blocks, first.num_layers, after - first.layer,
                                  digest(views) if digests else None, first.prompt, first.skip, first.skips), views))
        start = end
    return frames


class Sender:
    """One thread sends queued layers and reads the receivers' verdicts. It sleeps in `poll` on a wake-up pipe and
    on the connections that owe it a verdict, so it reacts to either at once and burns nothing while idle."""

    def __init__(self, connect: Connect, hello: Hello, metrics: EngineMetrics, require_shm: bool = False) -> None:
        self._links = Links(connect, hello, require_shm)
        self._metrics = metrics
        self._queue: collections.deque[PushJob] = collections.deque()  # appended under the lock, drained by the thread
        self._lock = threading.Lock()
        self._transfers: dict[str, Outgoing] = {}
        self._sending: dict[str, Outgoing] = {}  # the transfers not finished yet
        self._changed = threading.Condition(self._lock)  # a transfer finished, or the queue drained
        self._pending = 0
        self._aborts: list[tuple[Address, str]] = []  # transfers failed off the sender's thread, to tell the receiver
        self._woken = False  # a wake-up byte is in the pipe, or the thread is about to drain the queue
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = engine_thread(self._loop, "p2pkv-sender")

    def start(self) -> None:
        self._thread.start()

    def _wake(self) -> None:
        try:  # from the caller's thread (vLLM's): keeps the interpreter lock where it can (`transport.held`)
            if held.AVAILABLE:
                held.write(self._wake_w, b"\0")
            else:
                os.write(self._wake_w, b"\0")
        except OSError:  # the pipe is full (a wake-up is pending anyway) or closed
            pass

    def submit(self, job: PushJob) -> None:
        with self._lock:
            item = self._transfers.get(job.transfer_id)
            if item is None:
                item = Outgoing(job.transfer_id, job.peer, job.num_layers, time.monotonic(), job.deadline)
                self._transfers[job.transfer_id] = item
                self._sending[job.transfer_id] = item
            elif job.deadline > item.deadline:
                # Layers are pushed as a forward pass computes them, each with its own deadline: a long pass must
                # not fail the transfer at its first layer's while the last ones are still coming.
                item.deadline = job.deadline
            item.jobs += 1
            job.out = item
            self._pending += 1
            self._queue.append(job)
            wake, self._woken = not self._woken, True
        if wake:
            self._wake()

    def wait_idle(self, deadline: float) -> bool:
        """Block until every submitted job has been handled (PUT mode); False if the deadline passed."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._pending, max(0.0, deadline - time.monotonic()))

    def wait(self, transfer_id: str, deadline: float) -> Outgoing | None:
        """The transfer once it has finished and the sender's thread holds none of its jobs (or at the deadline);
        None if unknown. A verdict can end it while its jobs are still in hand, and their views still read."""
        def settled() -> bool:
            item = self._transfers.get(transfer_id)
            return item is None or (item.state is not OutState.SENDING and item.jobs == 0)

        with self._changed:
            self._changed.wait_for(settled, max(0.0, deadline - time.monotonic()))
            return self._transfers.get(transfer_id)

    def poll(self, transfer_id: str) -> Outgoing | None:
        with self._lock:
            return self._transfers.get(transfer_id)

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._transfers.pop(transfer_id, None)

    def expire(self) -> None:
        """Fail transfers whose deadline passed, so their blocks are released (once `reads` says nothing reads their
        bytes any more); the receivers are told by the sender's thread."""
        now = time.monotonic()
        with self._lock:
            expired = [item for item in self._sending.values() if now > item.deadline]
            for item in expired:
                self._finish_locked(item, OutState.FAILED, "deadline passed")
                self._aborts.append((item.peer, item.transfer_id))
        if expired:
            self._wake()

    def reads(self, transfer_id: str) -> bool:
        """Whether the transfer's bytes may still be read: jobs of it not handled yet (a send in progress among
        them), or, shm, layers the receiver has not confirmed copying, for a while after it ended."""
        with self._lock:
            item = self._transfers.get(transfer_id)
            if item is None:
                return False
            copies_due = item.by_reference and len(item.layers_copied) < len(item.layers_sent)
            return item.jobs > 0 or (copies_due and time.monotonic() < item.ended + _COPY_GRACE_S)

    def _loop(self) -> None:
        backlog = False  # the last drain stopped at its cap: look again without sleeping
        poller = select.poll()  # kept: registrations change only when the connections owing a verdict do
        poller.register(self._wake_r, select.POLLIN)
        registered: set[int] = set()
        while not self._stop.is_set():
            with self._lock:
                waiting = {t.peer for t in self._sending.values() if t.awaiting_ack}
                polled = {fd: p for p in waiting if (c := self._links.get(p)) is not None and (fd := c.fileno()) >= 0}
            for fd in registered - polled.keys():
                poller.unregister(fd)
            for fd in polled.keys() - registered:
                poller.register(fd, select.POLLIN)
            registered = set(polled)
            events = poller.poll(0 if backlog else _POLL_S * 1000)
            self._drain_wakeups()
            with self._lock:
                self._woken = False  # jobs queued from here on write a new wake-up byte
            jobs = self._drain()
            backlog = len(jobs) == _MAX_BATCH
            if jobs:
                self._handle_batch(jobs)
            with self._lock:
                aborts, self._aborts = self._aborts, []
            for peer, transfer_id in aborts:
                self._abort(peer, transfer_id, "deadline passed")
            for fd, _ in events:
                if fd in polled:
                    self._poll_acks(polled[fd])

    def _drain_wakeups(self) -> None:
        """Empty the wake-up pipe: one read unless it held a full read's worth (a read that finds it empty raises,
        and costs a system call)."""
        try:
            if held.AVAILABLE:
                while len(held.read(self._wake_r, 4096) or b"") == 4096:
                    pass
                return
            while len(os.read(self._wake_r, 4096)) == 4096:
                pass
        except BlockingIOError:
            pass

    def _drain(self) -> list[PushJob]:
        with self._lock:
            return [self._queue.popleft() for _ in range(min(len(self._queue), _MAX_BATCH))]

    def _handle_batch(self, jobs: list[PushJob]) -> None:
        """Send the jobs in order; consecutive jobs to one peer go out together."""
        try:
            start = 0
            while start < len(jobs):
                end, peer = start + 1, jobs[start].peer
                while end < len(jobs) and (jobs[end].peer is peer or jobs[end].peer == peer):  # `is`: no __eq__ call
                    end += 1
                try:
                    self._send_group(jobs[start:end])
                except Exception as exc:  # a bug must fail the transfers, not kill the thread
                    log.exception("push to %s crashed", jobs[start].peer)
                    with self._lock:
                        for job in jobs[start:end]:
                            if (item := self._sending.get(job.transfer_id)) is not None:
                                self._finish_locked(item, OutState.FAILED, f"internal error: {exc!r}")
                start = end
        finally:
            with self._changed:
                self._pending -= len(jobs)
                for job in jobs:
                    if job.out is not None:
                        job.out.jobs -= 1
                self._changed.notify_all()

    def _send_group(self, jobs: list[PushJob]) -> None:
        """Send one peer's jobs in order, each layer as soon as its copy from the device is done: the layers whose
        copies are done already go out together, then the next one is waited for (PUT_ASYNC: a layer leaves while
        the forward computes the next ones)."""
        peer = jobs[0].peer
        with self._lock:
            live = [(job, item) for job in jobs if (item := self._sending.get(job.transfer_id)) is not None]
        if not live:
            return
        deadline = min(job.deadline for job, _ in live)
        try:
            conn = self._links.open(peer, deadline)
            live, notices = self._hand_over(conn, live)
            while notices or live:
                ready, live = self._next_ready(peer, live)
                self._send(peer, notices, ready, deadline)
                notices = []
        except P2pkvError as exc:
            with self._lock:
                for _, item in live:
                    if item.state is OutState.SENDING:
                        self._finish_locked(item, OutState.FAILED, str(exc))
            for transfer_id in dict.fromkeys(job.transfer_id for job, _ in live):
                self._abort(peer, transfer_id, str(exc))

    def _send(self, peer: Address, notices: list[PullInstead], ready: list[tuple[PushJob, Outgoing]],
              deadline: float) -> None:
        """Send these notices and layers in one go, and note what was sent. A failure fails the transfers of the
        layers sent here (the caller fails those still to come)."""
        with self._lock:  # a transfer failed meanwhile (its deadline, a verdict) sends nothing more
            ready = [(job, item) for job, item in ready if item.state is OutState.SENDING]
        try:
            conn = self._links.get(peer) or self._links.open(peer, deadline)  # `send` checks the link and retries
            frames: list[tuple[Message, tuple[memoryview, ...]]] = [(n, ()) for n in notices]
            frames += _frames([job for job, _ in ready], conn.digests)
            if not frames:
                return
            conn = self._links.send(peer, frames, deadline)
        except P2pkvError as exc:
            tids = list(dict.fromkeys([*(n.transfer_id for n in notices), *(job.transfer_id for job, _ in ready)]))
            with self._lock:
                for tid in tids:
                    if (failed := self._sending.get(tid)) is not None:
                        self._finish_locked(failed, OutState.FAILED, str(exc))
            for tid in tids:
                self._abort(peer, tid, str(exc))
            raise
        by_reference = isinstance(conn, ShmConnection) and conn.sends_by_reference
        total, name = 0, conn.name
        with self._lock:
            for notice in notices:
                if (left := self._sending.get(notice.transfer_id)) is not None:
                    left.transport = name
                    self._finish_locked(left, OutState.REFUSED, WhyPull.DEVICE_PATH.value)
            sent: dict[str, Outgoing] = {}  # each transfer checked once, after all its layers here are counted
            for job, item in ready:
                nbytes = 0
                for view in job.views:
                    nbytes += view.nbytes
                total += nbytes
                item.nbytes += nbytes
                item.layers_sent.update(range(job.layer, job.layer + job.layers))
                sent[job.transfer_id] = item
            for item in sent.values():
                item.transport = name
                item.by_reference = by_reference
                self._maybe_done_locked(item)
        self._metrics.count_bytes("sent", total, name)

    def _hand_over(self, conn: Connection, live: list[tuple[PushJob, Outgoing]]
                   ) -> tuple[list[tuple[PushJob, Outgoing]], list[PullInstead]]:
        """The jobs still to push, and a PullInstead notice for each transfer that is not pushed but left for the
        receiver to pull: those its link asked for, not begun yet, and those the worker prepared without bytes
        (it found the link asking). A transfer begun on a link that did not ask, then prepared without bytes (the
        link changed under it), fails."""
        if not conn.pull_instead and not any(job.pull_instead for job, _ in live):
            return live, []  # every job is pushed: the usual case, decided without a look at each
        notices: dict[str, PullInstead] = {}
        broken: set[str] = set()
        for job, item in live:
            if job.transfer_id in notices or job.transfer_id in broken:
                continue
            if item.layers_sent and job.pull_instead:
                broken.add(job.transfer_id)
            elif not item.layers_sent and push_or_pull(device_path=job.pull_instead or conn.pull_instead).pulled:
                notices[job.transfer_id] = PullInstead(job.transfer_id, job.prompt)
        if broken:
            with self._lock:
                for transfer_id in broken:
                    if (out := self._sending.get(transfer_id)) is not None:
                        self._finish_locked(out, OutState.FAILED, "the link changed while the transfer was pushed")
            for transfer_id in broken:
                self._abort(live[0][0].peer, transfer_id, "the link changed while the transfer was pushed")
        keep = [(job, item) for job, item in live if job.transfer_id not in notices and job.transfer_id not in broken]
        return keep, list(notices.values())

    def pulls_instead(self, peer: Address) -> bool:
        """The link to `peer` is up and asked for pulls instead of pushes (no I/O)."""
        conn = self._links.get(peer)
        return conn is not None and conn.pull_instead

    def peer_reads_in_place(self, peer: Address) -> bool:
        """The link to `peer` is up and the peer copies our payloads out of our memory itself (shm; no I/O)."""
        conn = self._links.get(peer)
        return isinstance(conn, ShmConnection) and conn.sends_by_reference

    def _next_ready(self, peer: Address, live: list[tuple[PushJob, Outgoing]]
                    ) -> tuple[list[tuple[PushJob, Outgoing]], list[tuple[PushJob, Outgoing]]]:
        """The jobs to send now, and those after them: the first job's copy from the device is waited for (to its
        deadline), then every following job whose copy is done already is taken too. A copy that misses its
        deadline or fails fails its transfer (its later jobs are dropped)."""
        failed: dict[str, str] = {}
        ready: list[tuple[PushJob, Outgoing]] = []
        at = 0
        while at < len(live):
            job = live[at][0]
            if job.transfer_id in failed:
                at += 1
                continue
            if job.ready is not None:
                first = not ready
                try:
                    done = job.ready(job.deadline if first else 0.0)  # 0: asked, not waited for
                except Exception as exc:  # a device error fails this transfer, not the batch
                    failed[job.transfer_id] = f"layer {job.layer}: the copy from the device failed: {exc!r}"
                    at += 1
                    continue
                if not done and not first:
                    break  # still being copied: what is ready goes first
                if not done:
                    failed[job.transfer_id] = f"layer {job.layer}: the copy from the device missed the deadline"
                    at += 1
                    continue
            ready.append(live[at])
            at += 1
        rest = [(job, item) for job, item in live[at:] if job.transfer_id not in failed]
        if failed:
            ready = [(job, item) for job, item in ready if job.transfer_id not in failed]
            with self._lock:
                for transfer_id, reason in failed.items():
                    if (item := self._sending.get(transfer_id)) is not None:
                        self._finish_locked(item, OutState.FAILED, reason)
            for transfer_id, reason in failed.items():
                self._abort(peer, transfer_id, reason)
        return ready, rest

    def _maybe_done_locked(self, item: Outgoing) -> None:
        if item.state is OutState.SENDING and item.complete:
            self._finish_locked(item, OutState.DONE, "")

    def _poll_acks(self, peer: Address) -> None:
        """Read the receiver's verdicts that have arrived on this peer's connection, without blocking."""
        conn = self._links.get(peer)
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
            self._links.drop(peer)
            with self._lock:
                for item in list(self._sending.values()):
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
                # A duplicate (a resend on a new link, a reused id) is no pull to wait for: its blocks go.
                self._finish_locked(item, OutState.FAILED if ack.duplicate else OutState.REFUSED, ack.reason)

    def _on_copied(self, copied: PayloadCopied) -> None:
        with self._lock:
            item = self._transfers.get(copied.transfer_id)
            if item is None or item.state is not OutState.SENDING:
                return
            item.layers_copied.update(range(max(0, copied.layer), min(item.num_layers, copied.layer + copied.layers)))
            self._maybe_done_locked(item)

    def _finish_locked(self, item: Outgoing, state: OutState, reason: str) -> None:
        item.state, item.reason, item.ended = state, reason, time.monotonic()
        self._sending.pop(item.transfer_id, None)
        self._changed.notify_all()
        ms = (time.monotonic() - item.started) * 1000
        outcome = {OutState.DONE: "ok", OutState.REFUSED: "refused"}.get(state, "failed")
        if reason == WhyPull.DEVICE_PATH.value:
            outcome = "pull_instead"
        self._metrics.count_transfer("send", outcome, ms / 1000)
        log.info("transfer %s send %s peer=%s bytes=%d ms=%.1f transport=%s%s", item.transfer_id, outcome,
                 item.peer, item.nbytes, ms, item.transport, f" reason={reason}" if reason else "")

    def _abort(self, peer: Address, transfer_id: str, reason: str) -> None:
        conn = self._links.get(peer)
        if conn is None:
            return
        try:
            conn.send_frame(PushAbort(transfer_id, reason[:200]), (), time.monotonic() + 1.0)
        except P2pkvError:
            self._links.drop(peer)

    def close(self) -> None:
        self._stop.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._links.close()
