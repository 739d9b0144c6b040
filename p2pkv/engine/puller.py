"""GET mode, receiving side: pulls offered blocks from a prefill engine straight into local memory."""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from p2pkv.engine.device import CacheDigest, DeviceAccess, Fence, Pipe, PipeMaker, Placed, RemoteCache
from p2pkv.engine.links import Connect, Links
from p2pkv.engine.metrics import EngineMetrics
from p2pkv.engine.offers import UNKNOWN_TRANSFER, ViewSource
from p2pkv.engine.pipes import PipeSlot
from p2pkv.errors import P2pkvError, ProtocolError, TransferError
from p2pkv.integrity import frame_mismatch, hasher, mismatch
from p2pkv.params import Address
from p2pkv.protocol import (
    BlockPlaces,
    Hello,
    Message,
    PayloadCopied,
    PipeOpen,
    PullReply,
    PullRequest,
    PushBlocks,
    RenewLeases,
)
from p2pkv.transport.base import Connection
from p2pkv.transport.threads import engine_thread

log = logging.getLogger(__name__)
_POLL_S = 0.2
_RETRY_S = 0.02


class NotOfferedYet(TransferError):
    pass


class PullState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class PullKey:
    """What a pull's result is kept under when one transfer is pulled in several pulls: from the peer rank at
    `slot` (None: the transfer's one peer), and `release`, a pull of no heads that only frees the peer's blocks."""

    transfer_id: str
    slot: int | None = None
    release: bool = False

    def __str__(self) -> str:
        at = "" if self.slot is None else f"@{self.slot}"
        return f"{self.transfer_id}{at}{'#release' if self.release else ''}"


@dataclass(frozen=True, kw_only=True)
class HeadSlice:
    """Pull only heads `heads` of the peer's blocks (its numbering; empty: none, the pull just tells the peer its
    blocks may go), `block_bytes` per block, of the model's layers `layers` (None: every layer, as many as here).
    `pullers` decode ranks pull that peer; this one is `puller`. The result is kept under `key`, since one transfer
    is then pulled from several peers."""

    heads: tuple[int, int]
    block_bytes: int
    pullers: int
    puller: int
    key: str
    layers: tuple[int, int] | None = None
    # For a pull by reference (the peer's cache opens here) or by pipe: where this slice of the pulled blocks lies
    # in our storages.
    places: Placed | None = None

    @property
    def release_only(self) -> bool:
        return self.heads[0] == self.heads[1]


@dataclass(frozen=True)
class PullJob:
    """Fetch blocks `first_block ..` of a transfer into `sink(layer, 0, num_blocks)`, the local blocks; or, where
    the peer's cache can be opened here (cuda_ipc) or the link has a pipe (nccl), move them straight into local
    blocks `device_blocks`."""

    transfer_id: str
    peer: Address
    first_block: int
    num_blocks: int
    sink: ViewSource
    deadline: float
    device_blocks: tuple[int, ...] | None = None
    part: HeadSlice | None = None  # a peer of another tensor-parallel size: some of its heads only
    # Copies into the device blocks come after this (vLLM's thread recorded it once the blocks were allocated,
    # after vLLM zeroed them).
    after: Fence | None = None

    @property
    def result_key(self) -> str:
        return self.part.key if self.part is not None else self.transfer_id


@dataclass(frozen=True)
class Renewal:
    """Ask `peer` to keep holding these transfers' blocks for a pull (their requests still wait here)."""

    peer: Address
    transfer_ids: tuple[str, ...]
    deadline: float


@dataclass
class PullResult:
    state: PullState = PullState.PENDING
    reason: str = ""
    nbytes: int = 0
    transport: str = "tcp"
    by_reference: bool = False  # copied or received into the device blocks (cuda_ipc, nccl); the sink was not written


class Puller:
    def __init__(self, connect: Connect, hello: Hello, metrics: EngineMetrics, require_shm: bool = False,
                 device: DeviceAccess | None = None, pipes: PipeMaker | None = None,
                 pipe_setup_s: float = 5.0, cache_digest: CacheDigest | None = None) -> None:
        """`cache_digest` (integrity_check): how blocks that a pull copied into this worker's cache are digested."""
        self._links = Links(connect, hello, require_shm)
        self._cache_digest = cache_digest
        self._device = device
        self._remotes: dict[Address, tuple[Connection, RemoteCache | None]] = {}  # puller thread only
        self._maker = pipes
        self._pipe_setup_s = pipe_setup_s
        self._pipes: dict[Address, tuple[Connection, PipeSlot]] = {}  # puller thread only
        self._retired: list[PipeSlot] = []  # closed, maybe still setting up: joined at close()
        self._layout = hello.layout
        self._metrics = metrics
        self._queue: queue.Queue[PullJob | Renewal | None] = queue.Queue()  # None: wake up (to stop)
        # Pulls whose offer was not there yet, to try again: (when, order, job, when it first started); the thread's.
        self._later: list[tuple[float, int, PullJob, float]] = []
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # a pull finished
        self._results: dict[str, PullResult] = {}
        self._stop = threading.Event()
        self._thread = engine_thread(self._loop, "p2pkv-puller")
        self._on_idle: Callable[[Puller], bool] | None = None
        self._idle_s = 0.0
        self._active = time.monotonic()  # when it last had something to do

    def start(self, retire: Callable[[Puller], bool] | None = None, idle_s: float = 0.0) -> None:
        """`retire`: asked once the puller has been idle `idle_s` (nothing queued or to try again); when it says yes,
        the puller's thread lets its links, pipes and opened caches go and ends."""
        self._on_idle, self._idle_s = retire, idle_s
        self._thread.start()

    def running(self) -> bool:
        return self._thread.is_alive()

    def idle(self) -> bool:
        """Nothing queued (its owner asks, holding what serialises its submits)."""
        return self._queue.empty()

    def submit(self, job: PullJob) -> None:
        with self._lock:
            self._results[job.result_key] = PullResult()
        self._queue.put(job)

    def renew(self, renewal: Renewal) -> None:
        """Sent on the peer's link in turn with the pulls from it (so a renewal may wait for a pull before it)."""
        self._queue.put(renewal)

    def poll(self, transfer_id: str) -> PullResult | None:
        with self._lock:
            return self._results.get(transfer_id)

    def wait(self, transfer_id: str, deadline: float) -> PullResult | None:
        """The pull's result once it is done or failed (or at the deadline, still pending); None if unknown."""
        def settled() -> bool:
            result = self._results.get(transfer_id)
            return result is None or result.state is not PullState.PENDING

        with self._settled:
            self._settled.wait_for(settled, max(0.0, deadline - time.monotonic()))
            return self._results.get(transfer_id)

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._results.pop(transfer_id, None)

    def _take(self) -> tuple[PullJob | Renewal | None, float]:
        """The next thing to do, and when its pull first started: a pull whose retry is due, else what was queued
        (waiting at most until the next retry)."""
        now = time.monotonic()
        if self._later and self._later[0][0] <= now:
            _, _, job, started = heapq.heappop(self._later)
            return job, started
        timeout = _POLL_S if not self._later else min(_POLL_S, self._later[0][0] - now)
        try:
            return self._queue.get(timeout=timeout), now
        except queue.Empty:
            return None, now

    def _loop(self) -> None:
        while not self._stop.is_set():
            job, started = self._take()
            if job is None:
                if (self._on_idle is not None and not self._later
                        and time.monotonic() - self._active > self._idle_s and self._on_idle(self)):
                    self._let_go()
                    return
                continue
            self._active = time.monotonic()
            if isinstance(job, Renewal):
                self._renew(job)
                continue
            try:
                nbytes, transport, by_reference = self._pull(job)
                result = PullResult(PullState.DONE, "", nbytes, transport, by_reference)
            except NotOfferedYet:
                # A push refused for lack of space is offered by the sender moments later: tried again, while the
                # peer's other pulls go on, until the deadline.
                if time.monotonic() + _RETRY_S < job.deadline:
                    heapq.heappush(self._later, (time.monotonic() + _RETRY_S, next(self._order), job, started))
                    continue
                result = PullResult(PullState.FAILED, "the sender never offered the transfer")
            except P2pkvError as exc:
                result = PullResult(PullState.FAILED, str(exc))
            except Exception as exc:  # a bug must fail the transfer, not kill the thread and hang the load
                log.exception("transfer %s: pull crashed", job.transfer_id)
                result = PullResult(PullState.FAILED, f"internal error: {exc!r}")
            ms = (time.monotonic() - started) * 1000
            outcome = "ok" if result.state is PullState.DONE else "failed"
            self._metrics.count_transfer("pull", outcome, ms / 1000)
            heads = f" heads={job.part.heads[0]}-{job.part.heads[1]}" if job.part is not None else ""
            if job.part is not None and job.part.layers is not None:
                heads += f" layers={job.part.layers[0]}-{job.part.layers[1]}"
            log.info("transfer %s pull %s peer=%s%s bytes=%d ms=%.1f transport=%s%s", job.transfer_id, outcome,
                     job.peer, heads, result.nbytes, ms, result.transport,
                     f" reason={result.reason}" if result.reason else "")
            with self._settled:
                if job.result_key in self._results:
                    self._results[job.result_key] = result
                self._settled.notify_all()

    def _renew(self, renewal: Renewal) -> None:
        if time.monotonic() >= renewal.deadline:
            return  # overtaken by the next renewal
        try:
            self._links.send(renewal.peer, [(RenewLeases(list(renewal.transfer_ids)), ())], renewal.deadline)
        except P2pkvError as exc:  # the peer is gone or slow: its pulls will tell
            log.info("could not renew the leases of %d transfers at %s: %s", len(renewal.transfer_ids),
                     renewal.peer, exc)
        else:
            self._metrics.of(self._metrics.lease_renewals, "asked").inc(len(renewal.transfer_ids))

    def _remote(self, peer: Address, conn: Connection) -> RemoteCache | None:
        """The peer's exported cache opened here, once per link; None where there is none or it cannot be."""
        known = self._remotes.get(peer)
        if known is not None and known[0] is conn:
            return known[1]
        if known is not None and known[1] is not None:
            known[1].close()
        remote = None
        if self._device is not None and conn.peer_device is not None:
            try:
                remote = self._device.open(conn.peer_device)
                log.info("pulls from %s copy from its cache directly (%s)", peer, remote.transport)
            except P2pkvError as exc:
                log.warning("cannot open the cache of %s (%s); pulling its bytes over %s", peer, exc, conn.name)
        self._remotes[peer] = (conn, remote)
        return remote

    def _pipe(self, peer: Address, conn: Connection, deadline: float) -> Pipe | None:
        """The link's pipe once it is made; the first pull on a link starts making it (off the request path: that
        pull and those until it is ready carry bytes)."""
        known = self._pipes.get(peer)
        if known is not None and known[0] is conn:
            return known[1].ready()
        if known is not None:
            self._retire(known[1])  # the peer restarted or the link broke: its communicator goes with it
            del self._pipes[peer]
        if self._maker is None or not conn.peer_pipe:
            return None
        try:
            token, setup = self._maker.create()
        except Exception as exc:  # e.g. CuPy present but NCCL unusable: pulls carry bytes from now on
            log.warning("cannot make %s pipes (%r); pulls carry bytes", self._maker.kind, exc)
            self._maker = None
            return None
        try:
            conn.send_frame(PipeOpen(token), (), deadline)
        except TransferError as exc:  # the link is gone: this pull reconnects and carries bytes
            log.info("could not ask %s to join a pipe: %s", peer, exc)
            self._links.drop(peer)
            return None
        self._pipes[peer] = (conn, PipeSlot(str(peer), self._maker.kind, setup, self._pipe_setup_s, self._metrics))
        return None

    def _drop(self, peer: Address) -> None:
        """After a failure part-way through a pull: the link's state, and its pipe's, are unknown."""
        self._links.drop(peer)
        known = self._pipes.pop(peer, None)
        if known is not None:
            self._retire(known[1])

    def _retire(self, slot: PipeSlot) -> None:
        slot.close(abort=True)
        self._retired = [s for s in self._retired if not s.settled]
        self._retired.append(slot)

    def _pull(self, job: PullJob) -> tuple[int, str, bool]:
        """Bytes pulled, the transport used and whether by reference. The link to each peer is kept for the next
        pull; after a failure part-way through a pull its state is unknown, so it is closed."""
        if time.monotonic() >= job.deadline:
            raise TransferError("deadline passed before the pull started")
        by_reference, ours = False, None
        part = job.part
        where: DeviceAccess | PipeMaker | None = self._device if self._device is not None else self._maker
        if part is None and job.device_blocks is not None and where is not None:
            ours = where.places(job.device_blocks)
        elif part is not None:
            ours = part.places
        by_pipe = False
        if ours is not None and (self._device is not None or self._maker is not None):
            conn = self._links.open(job.peer, job.deadline)
            by_reference = self._device is not None and self._remote(job.peer, conn) is not None
            by_pipe = not by_reference and self._maker is not None and self._pipe(job.peer, conn,
                                                                                   job.deadline) is not None
        request = PullRequest(job.transfer_id, job.first_block, job.num_blocks, by_reference, by_pipe)
        if part is not None:
            request = PullRequest(job.transfer_id, job.first_block, job.num_blocks, by_reference, by_pipe,
                                  heads=part.heads, pullers=part.pullers, puller=part.puller, layers=part.layers)
        conn = self._links.send(job.peer, [(request, ())], job.deadline)
        try:
            reply = self._next(conn, job.deadline)
            if not isinstance(reply[0], PullReply) or reply[0].transfer_id != job.transfer_id or reply[1]:
                raise ProtocolError(f"expected a pull reply, got {type(reply[0]).__name__}")
        except P2pkvError:
            self._drop(job.peer)
            raise
        if not reply[0].accepted and reply[0].reason == UNKNOWN_TRANSFER:
            raise NotOfferedYet(job.transfer_id)
        if not reply[0].accepted:
            raise TransferError(f"{job.peer} refused the pull: {reply[0].reason}")
        if reply[0].by_reference or reply[0].by_pipe:
            if ours is None or not (by_reference or by_pipe):
                self._drop(job.peer)
                raise ProtocolError("a pull answered by reference or by pipe that was not asked for")
            return self._move_direct(conn, job, reply[0].by_pipe, by_reference, ours)
        if part is not None and part.release_only:
            return 0, conn.name, False  # none of the peer's heads are needed here
        try:
            nbytes, layer, num_layers = 0, 0, self._layout.num_layers
            if part is not None and part.layers is not None:
                num_layers = part.layers[1] - part.layers[0]
            per_layer = job.num_blocks * (part.block_bytes if part is not None else self._layout.block_bytes)
            while layer < num_layers:  # one frame may carry several layers, in order
                message, payload_len = self._next(conn, job.deadline)
                if (not isinstance(message, PushBlocks) or message.transfer_id != job.transfer_id
                        or message.layer != layer or not 1 <= message.layers <= num_layers - layer
                        or payload_len != message.layers * per_layer):
                    raise ProtocolError(f"unexpected frame while pulling layer {layer}: {message!r}")
                views = [v for at in range(layer, layer + message.layers) for v in job.sink(at, 0, job.num_blocks)]
                landed = hasher() if conn.digests else None
                conn.recv_payload_into_all(views, job.deadline, landed)
                if landed is not None:
                    self._check_digest(conn, message, landed.intdigest())
                layer += message.layers
                nbytes += payload_len
        except BaseException:
            self._drop(job.peer)
            raise
        self._count(conn.name, nbytes)
        return nbytes, conn.name, False

    def _layers(self, job: PullJob) -> int:
        """How many layers a pull moves: every layer held here, or those of its slice."""
        part = job.part
        return self._layout.num_layers if part is None or part.layers is None else part.layers[1] - part.layers[0]

    def _places(self, conn: Connection, job: PullJob, ours: Placed) -> BlockPlaces:
        """The peer's BlockPlaces frame: where the pulled blocks lie in its cache, checked against the pull and
        against where they are to land here (the same bytes)."""
        message, payload_len = self._next(conn, job.deadline)
        if (not isinstance(message, BlockPlaces) or message.transfer_id != job.transfer_id or payload_len
                or len(message.layers) != self._layers(job) or len(message.block_ids) != 4 * job.num_blocks
                or Placed(message.block_ids, message.layers).nbytes != ours.nbytes):
            raise ProtocolError(f"unexpected frame for a pull by reference or pipe: {type(message).__name__}")
        return message

    def _move_direct(self, conn: Connection, job: PullJob, by_pipe: bool, by_reference: bool,
                     ours: Placed) -> tuple[int, str, bool]:
        """The peer said where the blocks lie in its cache: move them into ours (copied from its opened cache,
        cuda_ipc; or received through the link's pipe, nccl), then confirm."""
        try:
            where = self._places(conn, job, ours)
            theirs = Placed(where.block_ids, where.layers)
            if by_pipe:
                known = self._pipes.get(job.peer)
                pipe = known[1].ready() if known is not None and known[0] is conn else None
                if pipe is None:
                    raise ProtocolError("a pull answered by pipe that was not asked for")
                pipe.recv(ours, job.deadline, job.after)
                nbytes, transport = ours.nbytes, pipe.transport
            else:
                remote = self._remote(job.peer, conn)  # the link the request went over (a reconnect opens anew)
                if remote is None or not by_reference:
                    raise ProtocolError("a pull answered by reference that was not asked for")
                nbytes, transport = remote.copy(theirs, ours, job.deadline, job.after), remote.transport
            conn.send_frame(PayloadCopied(job.transfer_id, 0, self._layers(job)), (), job.deadline)
        except BaseException:
            self._drop(job.peer)
            raise
        if conn.digests and where.digest is not None:
            self._check_copied(conn, job, ours, where.digest, transport)
        self._count(transport, nbytes)
        return nbytes, transport, True

    def _check_copied(self, conn: Connection, job: PullJob, ours: Placed, sent: int, transport: str) -> None:
        """integrity_check: digest the blocks a pull copied cache to cache where they landed, against the digest
        the peer took of its own (a cache in host memory); a mismatch fails the pull."""
        landed = self._cache_digest(ours) if self._cache_digest is not None else None
        if landed is None:
            raise TransferError(f"transfer {job.transfer_id}: the peer digested the blocks, this side cannot")
        bad = mismatch(f"transfer {job.transfer_id} (copied by {transport})", sent, landed)
        self._metrics.count_digest("pull", bad is None)
        if bad is not None:
            log.error("%s (pulled from %s)", bad, conn.peer)
            raise bad

    def _check_digest(self, conn: Connection, push: PushBlocks, landed: int) -> None:
        """Check pulled bytes against the frame's digest; a mismatch fails the pull (the load then fails and vLLM
        recomputes the prompt)."""
        bad = frame_mismatch(push, landed)
        self._metrics.count_digest("pull", bad is None)
        if bad is not None:
            log.error("%s (pulled from %s over %s)", bad, conn.peer, conn.name)
            raise bad

    def _count(self, transport: str, nbytes: int) -> None:
        self._metrics.count_bytes("received", nbytes, transport)

    @staticmethod
    def _next(conn: Connection, deadline: float) -> tuple[Message, int]:
        got = conn.recv_frame(max(0.0, deadline - time.monotonic()), deadline)
        if got is None:
            raise TransferError("deadline passed waiting for the peer")
        return got

    def close(self) -> None:
        self._stop.set()
        self._queue.put(None)  # the thread stops now rather than at its next poll
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._let_go()

    def _let_go(self) -> None:
        """Close the links, pipes and opened caches (idempotent; the puller's thread has ended or is ending)."""
        self._links.close()
        slots = [slot for _, slot in self._pipes.values()] + self._retired
        for slot in slots:
            slot.close()
        for slot in slots:
            slot.join()
        self._pipes.clear()
        self._retired.clear()
        for _, remote in self._remotes.values():
            if remote is not None:
                remote.close()
        self._remotes.clear()
