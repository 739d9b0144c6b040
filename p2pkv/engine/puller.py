"""GET mode, receiving side: pulls offered blocks from a prefill engine straight into local memory."""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from dataclasses import dataclass

from p2pkv.engine.links import Connect, Links
from p2pkv.engine.metrics import EngineMetrics
from p2pkv.engine.offers import UNKNOWN_TRANSFER, ViewSource
from p2pkv.engine.threads import engine_thread
from p2pkv.errors import P2pkvError, ProtocolError, TransferError
from p2pkv.params import Address
from p2pkv.protocol import Hello, Message, PullReply, PullRequest, PushBlocks
from p2pkv.transport.base import Connection

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
class PullJob:
    """Fetch blocks `first_block ..` of a transfer into `sink(layer, 0, num_blocks)`, the local blocks."""

    transfer_id: str
    peer: Address
    first_block: int
    num_blocks: int
    sink: ViewSource
    deadline: float


@dataclass
class PullResult:
    state: PullState = PullState.PENDING
    reason: str = ""
    nbytes: int = 0
    transport: str = "tcp"


class Puller:
    def __init__(self, connect: Connect, hello: Hello, metrics: EngineMetrics, require_shm: bool = False) -> None:
        self._links = Links(connect, hello, require_shm)
        self._layout = hello.layout
        self._metrics = metrics
        self._queue: queue.Queue[PullJob] = queue.Queue()
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # a pull finished
        self._results: dict[str, PullResult] = {}
        self._stop = threading.Event()
        self._thread = engine_thread(self._loop, "p2pkv-puller")

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: PullJob) -> None:
        with self._lock:
            self._results[job.transfer_id] = PullResult()
        self._queue.put(job)

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

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            started = time.monotonic()
            try:
                nbytes, transport = self._pull_until_offered(job)
                result = PullResult(PullState.DONE, "", nbytes, transport)
            except P2pkvError as exc:
                result = PullResult(PullState.FAILED, str(exc))
            except Exception as exc:  # a bug must fail the transfer, not kill the thread and hang the load
                log.exception("transfer %s: pull crashed", job.transfer_id)
                result = PullResult(PullState.FAILED, f"internal error: {exc!r}")
            ms = (time.monotonic() - started) * 1000
            outcome = "ok" if result.state is PullState.DONE else "failed"
            self._metrics.transfers.labels("pull", outcome).inc()
            log.info("transfer %s pull %s peer=%s bytes=%d ms=%.1f transport=%s%s", job.transfer_id, outcome,
                     job.peer, result.nbytes, ms, result.transport, f" reason={result.reason}" if result.reason else "")
            with self._settled:
                if job.transfer_id in self._results:
                    self._results[job.transfer_id] = result
                self._settled.notify_all()

    def _pull_until_offered(self, job: PullJob) -> tuple[int, str]:
        """A push refused for lack of space is offered by the sender moments later: retry until the deadline."""
        while True:
            try:
                return self._pull(job)
            except NotOfferedYet:
                if time.monotonic() + _RETRY_S >= job.deadline:
                    raise TransferError("the sender never offered the transfer") from None
                time.sleep(_RETRY_S)

    def _pull(self, job: PullJob) -> tuple[int, str]:
        """Bytes pulled and the transport used. The link to each peer is kept for the next pull; after a failure
        part-way through a pull its state is unknown, so it is closed."""
        if time.monotonic() >= job.deadline:
            raise TransferError("deadline passed before the pull started")
        conn = self._links.send(job.peer, [(PullRequest(job.transfer_id, job.first_block, job.num_blocks), ())],
                                job.deadline)
        try:
            reply = self._next(conn, job.deadline)
            if not isinstance(reply[0], PullReply) or reply[0].transfer_id != job.transfer_id or reply[1]:
                raise ProtocolError(f"expected a pull reply, got {type(reply[0]).__name__}")
        except P2pkvError:
            self._links.drop(job.peer)
            raise
        if not reply[0].accepted and reply[0].reason == UNKNOWN_TRANSFER:
            raise NotOfferedYet(job.transfer_id)
        if not reply[0].accepted:
            raise TransferError(f"{job.peer} refused the pull: {reply[0].reason}")
        try:
            nbytes, layer, num_layers = 0, 0, self._layout.num_layers
            per_layer = job.num_blocks * self._layout.block_bytes
            while layer < num_layers:  # one frame may carry several layers, in order
                message, payload_len = self._next(conn, job.deadline)
                if (not isinstance(message, PushBlocks) or message.transfer_id != job.transfer_id
                        or message.layer != layer or not 1 <= message.layers <= num_layers - layer
                        or payload_len != message.layers * per_layer):
                    raise ProtocolError(f"unexpected frame while pulling layer {layer}: {message!r}")
                views = [v for at in range(layer, layer + message.layers) for v in job.sink(at, 0, job.num_blocks)]
                conn.recv_payload_into_all(views, job.deadline)
                layer += message.layers
                nbytes += payload_len
        except BaseException:
            self._links.drop(job.peer)
            raise
        self._metrics.bytes_received.labels(conn.name).inc(nbytes)
        self._metrics.add("bytes_received", nbytes)
        return nbytes, conn.name

    @staticmethod
    def _next(conn: Connection, deadline: float) -> tuple[Message, int]:
        got = conn.recv_frame(max(0.0, deadline - time.monotonic()), deadline)
        if got is None:
            raise TransferError("deadline passed waiting for the peer")
        return got

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._links.close()
