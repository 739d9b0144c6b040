"""Accepts peer connections and lands pushed blocks in the receive store, one owned thread per connection."""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from p2pkv.engine.device import CacheDigest, Pipe, PipeMaker, Placed, PlaceSource
from p2pkv.engine.handshake import server_reply
from p2pkv.engine.metrics import EngineMetrics
from p2pkv.engine.occasional import Occasional
from p2pkv.engine.offers import Offer, OfferTable, ViewSource
from p2pkv.engine.pipes import PipeSlot
from p2pkv.engine.refused import RefusedPeers
from p2pkv.engine.store import ReceiveStore
from p2pkv.errors import P2pkvError, ProtocolError, TransferError
from p2pkv.integrity import digest, frame_mismatch, hasher
from p2pkv.protocol import (
    NONCE_BYTES,
    BlockPlaces,
    CmaOffer,
    DeviceExport,
    Hello,
    HelloReply,
    LayoutDigest,
    Message,
    PayloadCopied,
    PipeOpen,
    PullInstead,
    PullReply,
    PullRequest,
    PushAbort,
    PushAck,
    PushBlocks,
    RenewLeases,
)
from p2pkv.transport.base import Connection, Listener
from p2pkv.transport.shm import ShmConnection
from p2pkv.transport.threads import engine_thread
from p2pkv.way import WhyPull

log = logging.getLogger(__name__)
_POLL_S = 0.2
# After accept failed (out of descriptors) or a reader could not be started (out of threads): the pause before the
# next accept, so the listener neither spins nor gives up while the shortage lasts.
_BACKOFF_S = 0.1
_MAX_RENEWALS = 65536  # transfers renewed per frame at most (a decode instance's waiting queue is far shorter)
# A peer says hello as soon as it connects: one that has not within this long is no peer. And connections from one
# host still to say hello are capped, so that no host that holds none of the secret can fill `max_connections`.
_HELLO_S = 10.0
_WAITING_PER_HOST = 64
_NONCES_KEPT = 1 << 16  # hello nonces remembered, to refuse a hello played again
_MAX_REFUSED = 4096  # refusals remembered per connection (each answered once); forgotten all at once beyond


class Receiver:
    """Owns the listener thread and the reader threads it starts; `close()` stops and joins them all."""

    def __init__(self, listener: Listener, *, store: ReceiveStore, offers: OfferTable, layout: LayoutDigest,
                 metrics: EngineMetrics, frame_timeout_s: float, offer: CmaOffer | None = None,
                 device: DeviceExport | None = None, pipes: PipeMaker | None = None,
                 pipe_setup_s: float = 5.0, pulls_over_device: Callable[[Hello], bool] | None = None,
                 digests: bool = False, cache_digest: CacheDigest | None = None,
                 refused: RefusedPeers | None = None, max_connections: int = 256, idle_s: float = 300.0) -> None:
        """`pulls_over_device`: whether this worker would pull a client's blocks over a device path (opening its
        export, or through a pipe) rather than take them pushed through host memory. `digests`: integrity_check
        (payloads on every link carry their digest, checked where they land); `cache_digest`: how the blocks a
        pull copies cache to cache are digested here; `refused`: where the peers refused at their hello are
        noted; `max_connections`: readers at once (a connection beyond is closed as it comes); `idle_s`: a
        connection that sends no frame for this long is closed (its client reconnects at its next transfer)."""
        self.refused = refused if refused is not None else RefusedPeers()
        self._digests = digests
        self._cache_digest = cache_digest
        self._listener = listener
        self._pulls_over_device = pulls_over_device
        self._offer = offer
        self._device = device
        self._maker = pipes
        self._pipe_setup_s = pipe_setup_s
        self._store = store
        self._offers = offers
        self._layout = layout
        self._metrics = metrics
        self._frame_timeout_s = frame_timeout_s
        self._max_connections = max_connections
        self._idle_s = idle_s
        self._refusals = Occasional(log)
        self._bad_frames = Occasional(log)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._readers: dict[threading.Thread, Connection] = {}
        self._waiting: dict[str, int] = {}  # connections still to say hello, by the peer's host
        self._nonces: OrderedDict[bytes, None] = OrderedDict()
        self._serial = itertools.count()  # names each connection's transfers apart from any other's
        self._thread = engine_thread(self._accept_loop, "p2pkv-listener")

    def start(self) -> None:
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn = self._listener.accept(_POLL_S)
            except OSError as exc:  # e.g. out of file descriptors: the shortage may pass
                self._refuse("accept", "accepting a connection failed: %s", exc)
                self._stop.wait(_BACKOFF_S)
                continue
            if conn is not None:
                self._admit(conn)

    def _admit(self, conn: Connection) -> None:
        """Serve `conn` on a reader thread of its own, or close it at once: past the cap, or with no thread."""
        thread = engine_thread(functools.partial(self._serve, conn), f"p2pkv-reader-{conn.peer}")
        with self._lock:
            if self._stop.is_set():
                conn.close()
                return
            if len(self._readers) >= self._max_connections:
                self._refuse("cap", "connection cap reached (%d): closed a connection from %s",
                             self._max_connections, conn.peer)
                conn.close()
                return
            host = _host_of(conn.peer)
            if self._waiting.get(host, 0) >= _WAITING_PER_HOST:
                self._refuse("waiting", "%d connections from %s have not said hello yet: closed another",
                             _WAITING_PER_HOST, host)
                conn.close()
                return
            self._waiting[host] = self._waiting.get(host, 0) + 1
            self._readers[thread] = conn
        try:
            thread.start()
        except RuntimeError as exc:  # can't start new thread
            with self._lock:
                self._readers.pop(thread, None)
                self._said_hello(host)
            self._refuse("no_thread", "no thread to serve a connection from %s: %s", conn.peer, exc)
            conn.close()
            self._stop.wait(_BACKOFF_S)  # the shortage may pass: neither spin nor stop

    def _said_hello(self, host: str) -> None:
        """A connection from `host` is no longer waiting for its hello (it came, or will not); under the lock."""
        left = self._waiting.get(host, 0) - 1
        if left > 0:
            self._waiting[host] = left
        else:
            self._waiting.pop(host, None)

    def _refuse(self, reason: str, message: str, *args: object) -> None:
        """Count and (now and then) log a connection closed as it came."""
        self._metrics.of(self._metrics.refused_connections, reason).inc()
        self._metrics.add(f"refused_connections_{reason}", 1)
        self._refusals.note(logging.WARNING, message, *args)

    def _bad_frame(self, peer: str, exc: Exception) -> None:
        self._metrics.bad_frames.inc()
        self._metrics.add("bad_frames", 1)
        self._bad_frames.note(logging.WARNING, "dropping the connection from %s after a bad frame: %s", peer, exc)

    def _handshake(self, conn: Connection) -> tuple[Connection, bool] | None:
        """The connection to serve (shm or plain) and whether the peer holds other heads or layers than this worker
        (another tensor- or pipeline-parallel size: it pulls slices); None when the peer was refused."""
        hello_s = min(self._frame_timeout_s, _HELLO_S)
        try:
            got = conn.recv_frame(hello_s, time.monotonic() + hello_s)
        finally:
            with self._lock:
                self._said_hello(_host_of(conn.peer))
        if got is None:
            raise TransferError(f"no hello within {hello_s:g} s")
        hello, payload_len = got
        if not isinstance(hello, Hello) or payload_len:
            raise ProtocolError(f"expected a hello frame, got {type(hello).__name__}")
        if not self._fresh(hello.nonce):
            raise ProtocolError("authentication failed: a hello played again (its nonce was seen before)")
        diffs = self._layout.differences(hello.layout)
        deadline = time.monotonic() + self._frame_timeout_s
        if diffs:
            reason = "KV layout mismatch: " + "; ".join(diffs)
            # Logged once a peer: it tries again at every push, and is refused alike (still counted each time).
            news = self.refused.refused(hello.kv_address, reason, hello.launch)
            log.log(logging.ERROR if news else logging.DEBUG,
                    "refusing peer %s (engine %s, start %s, listening on %s): %s", conn.peer, hello.engine_id,
                    hello.launch or "?", hello.kv_address or "?", reason)
            self._metrics.refused_peers.inc()
            if hello.kv_address:  # GET: what it was to pull will not reach it, nor be pulled by another
                self._offers.refused(hello.kv_address, reason)
            conn.send_frame(HelloReply(accepted=False, reason=reason, hello_nonce=hello.nonce), (), deadline)
            return None
        self.refused.accepted(hello.kv_address)
        sliced = self._layout.sliced_with(hello.layout)  # pulls slices over tcp or shm: no device path for them
        pull_instead = not sliced and self._pulls_over_device is not None and self._pulls_over_device(hello)
        served = server_reply(conn, hello, self._offer, deadline, self._device,
                              self._maker.kind if self._maker is not None else "", pull_instead, self._digests,
                              self._idle_s)
        return served, sliced

    def _fresh(self, nonce: bytes) -> bool:
        """A hello's nonce is new: of the right size, and not among the latest hellos' (the oldest are forgotten;
        a hello played again after that gets a reply, but its connection's next frame fails: the key is new)."""
        if len(nonce) != NONCE_BYTES:
            return False
        with self._lock:
            if nonce in self._nonces:
                return False
            self._nonces[nonce] = None
            if len(self._nonces) > _NONCES_KEPT:
                self._nonces.popitem(last=False)
        return True

    def _join_pipe(self, conn: Connection, ask: PipeOpen, slot: PipeSlot | None) -> PipeSlot:
        """The client is making a pipe for this connection: join it on a thread of its own."""
        maker = self._maker
        if maker is None or not conn.peer_pipe or slot is not None:
            raise ProtocolError("a pipe was asked for that the handshake did not agree, or twice")
        token = ask.token
        return PipeSlot(conn.peer, maker.kind, lambda deadline: maker.join(token, deadline), self._pipe_setup_s,
                        self._metrics)

    def _serve(self, conn: Connection) -> None:
        source = f"{conn.peer}#{next(self._serial)}"
        slot: PipeSlot | None = None  # this connection's pipe (nccl), once the client asks for one
        try:
            served = self._handshake(conn)
            if served is None:
                return
            conn, sliced = served
            refused: set[str] = set()  # pushes refused on this connection (the peer holds other heads or layers)
            idle_until = time.monotonic() + self._idle_s
            while not self._stop.is_set():
                got = conn.recv_frame(_POLL_S, time.monotonic() + self._frame_timeout_s)
                if got is None:
                    if time.monotonic() > idle_until:
                        log.debug("closing the connection from %s: no frame for %.0f s", conn.peer, self._idle_s)
                        return
                    continue
                message, payload_len = got
                deadline = time.monotonic() + self._frame_timeout_s
                if len(refused) > _MAX_REFUSED:
                    refused.clear()
                if isinstance(message, PushBlocks) and sliced:
                    self._refuse_push(conn, message, payload_len, source, refused, deadline)
                elif isinstance(message, PushBlocks):
                    self._receive_chunk(conn, message, payload_len, source, refused, deadline)
                elif isinstance(message, PullRequest):
                    conn.discard_payload(payload_len, deadline)
                    self._serve_pull(conn, message, deadline, slot.ready() if slot is not None else None, sliced)
                elif isinstance(message, PipeOpen):
                    conn.discard_payload(payload_len, deadline)
                    slot = self._join_pipe(conn, message, slot)
                elif isinstance(message, PullInstead):
                    conn.discard_payload(payload_len, deadline)
                    self._store.refer(message.transfer_id, WhyPull.DEVICE_PATH.value, source, message.prompt)
                elif isinstance(message, RenewLeases):
                    conn.discard_payload(payload_len, deadline)
                    renewed = self._offers.renew(message.transfer_ids[:_MAX_RENEWALS])
                    self._metrics.of(self._metrics.lease_renewals, "renewed").inc(renewed)
                    log.debug("%s renewed the leases of %d of %d transfers", conn.peer, renewed,
                              len(message.transfer_ids))
                elif isinstance(message, PushAbort):
                    conn.discard_payload(payload_len, deadline)
                    self._store.fail(message.transfer_id, f"sender aborted: {message.reason}", create=False,
                                     source=source)
                else:
                    raise ProtocolError(f"unexpected {type(message).__name__} frame")
                idle_until = time.monotonic() + self._idle_s
        except ProtocolError as exc:
            self._bad_frame(conn.peer, exc)
        except P2pkvError as exc:  # a transfer error, or a pipe or device copy that failed
            if not self._stop.is_set():
                log.info("connection from %s ended: %s", conn.peer, exc)
        finally:
            self._store.fail_from_source(source, "connection to the sender was lost")
            if slot is not None:
                slot.close(abort=True)  # the communicator goes with its link (whose peer may be gone)
                slot.join()
            conn.close()
            with self._lock:
                self._readers.pop(threading.current_thread(), None)

    def _receive_chunk(self, conn: Connection, push: PushBlocks, payload_len: int, source: str, refused: set[str],
                       deadline: float) -> None:
        """Stage a chunk; the transfer's verdict goes back once (a refusal is remembered: later chunks of a refused
        transfer, a duplicate's say, are dropped without another, and without asking the store, where a load may
        have taken the refusal's record: they would begin a new transfer there)."""
        if push.transfer_id in refused:
            conn.discard_payload(payload_len, deadline)
            return
        view, ack = self._store.begin_chunk(push, payload_len, source, conn.name)
        if ack is not None:
            conn.queue_frame(ack)  # goes out with the next reply, or before this connection waits for input
            if not ack.accepted:
                refused.add(push.transfer_id)
        if view is None:
            conn.discard_payload(payload_len, deadline)
            return
        landed = hasher() if conn.digests else None
        whole = False
        try:
            conn.recv_payload_into(view, deadline, landed, confirm=False)
            whole = landed is None or self._digest_matches(conn, push, landed.intdigest(), source)
        finally:
            self._store.end_chunk(push, whole)  # its memory may go only now, whatever happened
        # shm's copy confirmation (and a verdict queued with it) once the bytes count as landed: a transfer's
        # last chunk is complete here before its sender's thread wakes to compete for the cores
        conn.flush(deadline)
        if whole:
            self._metrics.count_bytes("received", payload_len, conn.name)

    def _digest_matches(self, conn: Connection, push: PushBlocks, landed: int, source: str) -> bool:
        """Check a landed payload against its frame's digest; a mismatch fails the transfer (its load then fails and
        vLLM recomputes the prompt)."""
        bad = frame_mismatch(push, landed)
        self._metrics.count_digest("receive", bad is None)
        if bad is not None:
            log.error("%s (from %s over %s); the transfer is dropped", bad, conn.peer, conn.name)
            self._store.fail(push.transfer_id, str(bad), create=False, source=source)
        return bad is None

    def _refuse_push(self, conn: Connection, push: PushBlocks, payload_len: int, source: str, refused: set[str],
                     deadline: float) -> None:
        """A peer of another tensor- or pipeline-parallel size pushed whole blocks of its own heads or layers,
        which are not ours: refuse the transfer (its sender then holds the blocks, and this side pulls what it
        needs)."""
        conn.discard_payload(payload_len, deadline)
        if push.transfer_id in refused:
            return
        refused.add(push.transfer_id)
        self._store.fail(push.transfer_id, WhyPull.HEADS_DIFFER.value, source=source, frame=None, prompt=push.prompt)
        conn.queue_frame(PushAck(push.transfer_id, False, WhyPull.HEADS_DIFFER.value))

    def _sliced_source(self, pull: PullRequest, claim: Offer, sliced: bool) -> ViewSource | str:
        """What a pull reads: the whole blocks, or the heads it asked for; or why it cannot be served."""
        if pull.heads is None:
            return "the puller holds other heads or layers (another tensor-parallel or pipeline-parallel size) " \
                "and must ask for some" if sliced else claim.source
        if claim.slicer is None:
            return "these blocks cannot be pulled by heads"
        try:
            return claim.slicer(pull.heads, pull.layers)
        except P2pkvError as exc:
            return str(exc)

    def _serve_pull(self, conn: Connection, pull: PullRequest, deadline: float, pipe: Pipe | None,
                    sliced: bool = False) -> None:
        claim = self._offers.claim(pull.transfer_id, pull.first_block, pull.num_blocks, pull.pullers, pull.puller)
        if isinstance(claim, str):
            log.warning("transfer %s: refusing a pull from %s: %s", pull.transfer_id, conn.peer, claim)
            conn.send_frame(PullReply(pull.transfer_id, False, claim), (), deadline)
            return
        started, nbytes, transport = time.monotonic(), 0, conn.name
        try:
            release = pull.heads is not None and pull.heads[0] == pull.heads[1]  # no heads: only frees the blocks
            source = None if release else self._sliced_source(pull, claim, sliced)
            if isinstance(source, str) or source is None:
                # Refused (the puller recomputes), or a release: this rank needs none of our heads. Either way
                # this puller is done with the blocks.
                reason = source or ""
                if reason:
                    log.warning("transfer %s: refusing a pull from %s: %s", pull.transfer_id, conn.peer, reason)
                conn.send_frame(PullReply(pull.transfer_id, not reason, reason), (), deadline)
                return
            # Places are given only where the puller can copy the blocks itself, or receive them through a pipe.
            direct = pull.by_reference and self._device is not None
            piped = pull.by_pipe and pipe is not None and not direct
            at = self._places_at(pull, claim) if direct or piped else None
            if at is not None and direct and self._device is not None:
                nbytes = self._serve_by_reference(conn, pull, at, deadline)
                transport = "cuda_ipc" if self._device.kind == "cuda" else "host_ipc"
                return
            if at is not None and piped and pipe is not None:
                nbytes, transport = self._serve_by_pipe(conn, pull, at, pipe, deadline), pipe.transport
                return
            nbytes = self._send_blocks(conn, pull, source, deadline)
        finally:
            # TCP: sent bytes sit in the socket's buffers. shm: the puller has copied every layer, or it is gone
            # (then it reports load errors and recomputes). Either way the blocks are free to go.
            self._offers.finish(claim)
            self._metrics.count_bytes("sent", nbytes, transport)
            log.info("transfer %s served peer=%s bytes=%d ms=%.1f transport=%s", pull.transfer_id, conn.peer,
                     nbytes, (time.monotonic() - started) * 1000, transport)

    def _pulled_layers(self, pull: PullRequest) -> int:
        """How many layers a pull asked for: every layer held here, or those of its slice."""
        return self._layout.num_layers if pull.layers is None else pull.layers[1] - pull.layers[0]

    def _send_blocks(self, conn: Connection, pull: PullRequest, source: ViewSource, deadline: float) -> int:
        """The pulled blocks' bytes, every layer in one frame (they are whole layers of the puller's transfer)."""
        num_layers = self._pulled_layers(pull)
        views = [v for layer in range(num_layers) for v in source(layer, pull.first_block, pull.num_blocks)]
        push = PushBlocks(pull.transfer_id, 0, 0, pull.num_blocks, pull.num_blocks, num_layers, num_layers,
                          digest(views) if conn.digests else None)
        frames: list[tuple[Message, Sequence[memoryview]]] = [(PullReply(pull.transfer_id, True), ()),
                                                              (push, views)]
        conn.send_frames(frames, deadline)
        if isinstance(conn, ShmConnection) and conn.sends_by_reference:
            self._await_copies(conn, pull.transfer_id, deadline, num_layers)
        return sum(v.nbytes for v in views)

    @staticmethod
    def _places_at(pull: PullRequest, claim: Offer) -> PlaceSource | None:
        """Where the blocks a pull asked for lie in our storages (the heads and layers asked for, by a puller of
        another tensor- or pipeline-parallel size); None where they cannot be given (then the bytes are sent)."""
        if pull.heads is None:
            return claim.places
        if claim.slice_places is None:
            return None
        try:
            return claim.slice_places(pull.heads, pull.layers)
        except P2pkvError:
            return None

    def _block_places(self, conn: Connection, pull: PullRequest, at: PlaceSource) -> tuple[BlockPlaces, Placed]:
        """Where the blocks (or the heads and layers asked for) lie in our storages; with integrity_check, with the
        digest of their bytes as they are now."""
        placed = at(pull.first_block, pull.num_blocks)
        if len(placed.layers) != self._pulled_layers(pull):
            raise ProtocolError(f"{len(placed.layers)} layers placed for a pull of {self._pulled_layers(pull)}")
        checked = self._cache_digest(placed) if conn.digests and self._cache_digest is not None else None
        return BlockPlaces(pull.transfer_id, placed.block_ids, placed.layers, checked), placed

    def _serve_by_reference(self, conn: Connection, pull: PullRequest, at: PlaceSource, deadline: float) -> int:
        """cuda_ipc: say where the blocks (or the heads and layers asked for) lie in our exported cache; the puller
        copies them and confirms."""
        where, _ = self._block_places(conn, pull, at)
        conn.send_frames([(PullReply(pull.transfer_id, True, by_reference=True), ()), (where, ())], deadline)
        self._await_copies(conn, pull.transfer_id, deadline, len(where.layers))
        return Placed(where.block_ids, where.layers).nbytes

    def _serve_by_pipe(self, conn: Connection, pull: PullRequest, at: PlaceSource, pipe: Pipe,
                       deadline: float) -> int:
        """nccl: say where the blocks (or the heads and layers asked for) lie here; both sides then move their
        bytes in payload order, and the puller confirms once they have landed."""
        where, placed = self._block_places(conn, pull, at)
        conn.send_frames([(PullReply(pull.transfer_id, True, by_pipe=True), ()), (where, ())], deadline)
        pipe.send(placed, deadline)
        self._await_copies(conn, pull.transfer_id, deadline, len(where.layers))
        return Placed(where.block_ids, where.layers).nbytes

    def _await_copies(self, conn: Connection, transfer_id: str, deadline: float, num_layers: int = 0) -> None:
        """shm: the puller reads the blocks from this process; wait until it has copied every layer (of the
        `num_layers` sent; 0: every layer held here)."""
        num_layers = num_layers or self._layout.num_layers
        copied: set[int] = set()
        while len(copied) < num_layers:
            got = conn.recv_frame(max(0.0, deadline - time.monotonic()), deadline)
            if got is None:
                raise TransferError(f"transfer {transfer_id}: the puller did not confirm its copies in time")
            message, payload_len = got
            if not isinstance(message, PayloadCopied) or payload_len or message.transfer_id != transfer_id:
                raise ProtocolError(f"expected a copy confirmation, got {type(message).__name__}")
            copied.update(range(max(0, message.layer), min(num_layers, message.layer + message.layers)))

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._lock:
            readers = list(self._readers.items())
        for _, conn in readers:
            conn.close()
        for thread, _ in readers:
            thread.join(timeout=5)


def _host_of(peer: str) -> str:
    """The host of a peer named `host:port` (`[v6]:port` too)."""
    return peer.rpartition(":")[0] or peer
