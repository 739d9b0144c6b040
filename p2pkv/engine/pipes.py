"""A link's pipe being made off the request path: the set-up (NCCL's communicator init blocks until the peer joins)
runs on an owned thread to a deadline, and pulls go by pipe only once it is there. A set-up that fails or misses
its deadline leaves the link carrying bytes, with a warning; one that finishes after its slot was closed frees
what it made. Engine shutdown joins set-ups in flight, to their deadline: a thread that leaves a native call while
the process exits aborts it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from p2pkv.engine.device import Pipe
from p2pkv.engine.metrics import EngineMetrics
from p2pkv.transport.threads import engine_thread

log = logging.getLogger(__name__)
_JOIN_S = 1.0  # join() waits at least this long for a set-up thread (and at most to its deadline, plus this)


class PipeSlot:
    def __init__(self, peer: str, kind: str, setup: Callable[[float], Pipe], timeout_s: float,
                 metrics: EngineMetrics) -> None:
        """Counts each set-up in `p2pkv_pipes_total{kind, outcome}`: ready, failed (an error), late (made after
        its deadline or its link closed, and freed)."""
        self._peer = peer
        self._metrics = metrics
        self._kind = kind
        self._setup = setup
        self._deadline = time.monotonic() + timeout_s
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._pipe: Pipe | None = None
        self._closed = False
        self._thread = engine_thread(self._run, f"p2pkv-pipe-{peer}")
        self._thread.start()

    def _run(self) -> None:
        try:
            pipe = self._setup(self._deadline)
        except Exception as exc:  # any failure leaves the link carrying bytes, with the reason logged
            log.warning("%s pipe with %s could not be made (%s); pulls carry bytes", self._kind, self._peer, exc)
            self._metrics.pipes.labels(self._kind, "failed").inc()
            self._done.set()
            return
        with self._lock:
            keep = not self._closed and time.monotonic() <= self._deadline
            if keep:
                self._pipe = pipe
        self._metrics.pipes.labels(self._kind, "ready" if keep else "late").inc()
        if keep:
            log.info("%s pipe with %s is ready", self._kind, self._peer)
        else:
            log.warning("%s pipe with %s was made after its deadline or its link closed; freeing it", self._kind,
                        self._peer)
            pipe.close()
        self._done.set()

    def ready(self) -> Pipe | None:
        """The pipe once made; None while it is being made, or when that failed."""
        with self._lock:
            return None if self._closed else self._pipe

    def wait(self, timeout_s: float) -> Pipe | None:
        self._done.wait(timeout_s)
        return self.ready()

    def close(self, abort: bool = False) -> None:
        """Idempotent: frees the pipe; `abort` when its peer may be gone (left, restarted, broke a transfer)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pipe, self._pipe = self._pipe, None
        if pipe is not None:
            pipe.close(abort)

    @property
    def settled(self) -> bool:
        """The set-up is over (made, failed or freed): no thread is left in it."""
        return self._done.is_set()

    def join(self) -> None:
        """Wait for a set-up in flight to its deadline (a closed slot frees what it makes); for engine shutdown,
        off the request path."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(0.0, self._deadline - time.monotonic()) + _JOIN_S)
