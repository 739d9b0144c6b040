"""The device layer: every operation p2pkv asks of the device that holds a KV cache goes through a `DeviceOps`.

- A `Fence` says where vLLM's forward pass has got to. It is recorded only on vLLM's own thread, in the connector's
  hooks, where the current stream is the forward's (vLLM runs it on a per-thread, non-default stream). An engine
  thread's current stream is the default stream and says nothing about the forward: no engine thread records one.
- Copies run on a side stream, each batch after the fences it names (`issue`), and a `Marker` says when a batch
  is done (a CUDA event, queried; never waited on by vLLM's thread).
- Blocks move as rows of a `[rows, row bytes]` view of a cache's storage: one `gather` or `scatter` moves every
  block of a request, with indices built by numpy (`p2pkv.kv.layout.LayerGeometry.rows`) and handed over with
  `index`.

`TorchOps` does this with torch: CUDA streams and events on a GPU; on the host every operation completes when it
is issued. The tests substitute layers that record what they were asked, by which thread, after which fences, or
that run the copies late.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from p2pkv.engine.device import Fence
from p2pkv.errors import P2pkvError

log = logging.getLogger(__name__)
Marker = Callable[[], bool]  # True once the copies issued before it have finished
Ready = Callable[[float], bool]  # wait until an absolute monotonic deadline; False if it passed first
Rows = npt.NDArray[np.int64]


def done() -> bool:
    return True


class NoPinnedSpace(P2pkvError):
    """No page-locked host memory is free for a copy issued where none may be allocated (the forward's path)."""


class PartialCopy(P2pkvError):
    """Issuing a batch of copies failed part-way: those issued before still run. `pending` says when they are done:
    the memory they touch is not given back, nor the load reported, before it does."""

    def __init__(self, cause: BaseException, pending: Marker) -> None:
        super().__init__(f"a device copy could not be issued: {cause!r}")
        self.cause = cause
        self.pending = pending


SPIN_S = 300e-6  # markers are asked without sleeping this long: a short copy is seen done within microseconds


def wait_marker(marker: Marker, deadline: float) -> bool:
    """Until the marker says done (True) or the deadline passes (False). First asked in a loop that yields the GIL
    and the core but does not sleep (a sleep lasts 50 us or more past what it asks); then between sleeps of an
    eighth of the time waited so far (1 ms at most), so the wait ends within about an eighth of the copy's time
    after it."""
    if marker():
        return True
    started = time.monotonic()
    spin_until = started + SPIN_S
    while not marker():
        now = time.monotonic()
        if now >= deadline:
            return False
        if now < spin_until:
            os.sched_yield()  # lets other threads run; time.sleep(0) would sleep 50 us or more (timer slack)
            continue
        time.sleep(min(max((now - started) / 8, 20e-6), 1e-3, deadline - now))
    return True


def settle(markers: Sequence[Marker], deadline: float, grace_s: float) -> bool:
    """Wait for the markers to the deadline. When it passes first, wait up to `grace_s` more before answering False,
    so that no copy is still writing when its caller gives the memory back or reports the load failed."""
    if all(wait_marker(m, deadline) for m in markers):
        return True
    if not all(wait_marker(m, time.monotonic() + grace_s) for m in markers):
        log.error("device copies still running after their deadline and %.0f s more", grace_s)
    return False


def all_done(markers: Sequence[Marker]) -> Marker:
    """One marker for several."""
    return lambda: all(m() for m in markers)


class DeviceOps(Protocol):
    device: torch.device
    # Copies between the device and host memory run without waiting for the host only from page-locked memory:
    # on the forward's path such memory is taken from the pinned pool or not at all (NoPinnedSpace).
    pins_host: bool

    def fence(self) -> Fence:
        """Record where the calling thread's current stream has got to. Only on vLLM's thread, in its hooks."""

    def passed(self, fence: Fence) -> bool:
        """Whether the work before the fence is done (a query; any thread)."""

    def issue(self, after: Sequence[Fence], stream: object | None = None) -> contextlib.AbstractContextManager[None]:
        """The operations issued inside run on the side stream (or on `stream`, a pipe's), after the work before
        these fences."""

    def wait(self, fence: Fence) -> None:
        """The operations issued after this (in the same `issue`) run after the work before `fence` too."""

    def mark(self) -> Marker:
        """A marker for the operations issued so far."""

    def empty(self, count: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Scratch on the device (`count` elements), for the operations issued with it."""

    def index(self, rows: Rows) -> torch.Tensor:
        """Row indices on the device (int64). NoPinnedSpace where the host memory they go through is full."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst[:] = src (same shape; either may be host memory)."""

    def gather(self, dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
        """dst[i] = src[index[i]], rows of the same width (both on the device)."""

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        """dst[index[i]] = src[i] (both on the device)."""


def _thread() -> str:
    return threading.current_thread().name


class HostOps:
    """A cache in host memory, handled as a device's (`P2PKV_STAGE_KV=1`): every operation is done when issued."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.pins_host = False

    def fence(self) -> Fence:
        return Fence(None, _thread())

    def passed(self, fence: Fence) -> bool:
        return True

    def issue(self, after: Sequence[Fence], stream: object | None = None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def wait(self, fence: Fence) -> None:
        pass

    def mark(self) -> Marker:
        return done

    def empty(self, count: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        return torch.empty(count, dtype=dtype)

    def index(self, rows: Rows) -> torch.Tensor:
        return torch.from_numpy(rows)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def gather(self, dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
        torch.index_select(src, 0, index, out=dst)

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        dst.index_copy_(0, index, src)


def event_marker(event: torch.cuda.Event, device: torch.device) -> Marker:
    """A marker for a recorded CUDA event, queried with its device current: engine threads ask, and a thread's
    current device is GPU 0 until it is set (a query there could make a CUDA context on GPU 0)."""

    def query() -> bool:
        with torch.cuda.device(device):
            return bool(event.query())

    return query


class _Span:
    __slots__ = ("end", "marker", "start")

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.marker: Marker = lambda: False  # until the copy that reads it is issued


class PinnedRing:
    """Page-locked host memory for row indices on their way to the device, allocated once (at registration, never
    on the forward's path) and reused in order as the copies that read it finish."""

    def __init__(self, nbytes: int, host: torch.Tensor | None = None) -> None:
        """`host`: the memory to use (the tests' own), else `nbytes` of page-locked memory."""
        self._host = host if host is not None else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._lock = threading.Lock()
        self._spans: deque[_Span] = deque()  # in the order they were handed out
        self._head = 0

    def put(self, data: Rows) -> tuple[torch.Tensor, Callable[[Marker], None]]:
        """Host memory holding `data`, and the call that names the marker after which it may be reused (the caller
        names one, `done` where its copy could not be issued)."""
        n = -(-data.nbytes // 64) * 64
        if n > self._host.numel():
            raise NoPinnedSpace(f"{data.nbytes} bytes of row indices: more than the pinned ring holds")
        with self._lock:
            self._spans = deque(s for s in self._spans if not s.marker())  # any finished span, not only the oldest
            size = self._host.numel()
            free = (c for c in (self._head, 0, *(s.end for s in self._spans))  # after the last, else after any
                    if c + n <= size and not any(c < s.end and s.start < c + n for s in self._spans))
            start = next(free, None)
            if start is None:
                raise NoPinnedSpace(f"{data.nbytes} bytes of row indices: the pinned ring is full")
            span = _Span(start, start + n)
            self._spans.append(span)
            self._head = start + n
        host = self._host[start : start + data.nbytes]
        try:
            host.numpy()[:] = data.view(np.uint8)
        except BaseException:
            span.marker = done
            raise

        def freed_by(marker: Marker) -> None:
            span.marker = marker

        return host, freed_by


INDEX_RING_BYTES = 16 << 20


class CudaOps:
    """A GPU cache: one side stream per worker; fences and markers are CUDA events (no host synchronisation)."""

    def __init__(self, device: torch.device, ring_bytes: int = INDEX_RING_BYTES) -> None:
        self.device = device
        self.pins_host = True
        with torch.cuda.device(device):
            self._stream = torch.cuda.Stream(device=device)
            self._ring = PinnedRing(ring_bytes)
        self._active = threading.local()  # the stream of the `issue` a thread is in

    def fence(self) -> Fence:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return Fence(event, _thread())

    def passed(self, fence: Fence) -> bool:
        if not isinstance(fence.event, torch.cuda.Event):
            return True
        with torch.cuda.device(self.device):
            return bool(fence.event.query())

    @contextlib.contextmanager
    def issue(self, after: Sequence[Fence], stream: object | None = None) -> Iterator[None]:
        use = stream if isinstance(stream, torch.cuda.Stream) else self._stream
        with torch.cuda.device(self.device):
            for fence in after:
                if isinstance(fence.event, torch.cuda.Event):
                    use.wait_event(fence.event)
            with torch.cuda.stream(use):
                previous, self._active.stream = getattr(self._active, "stream", None), use
                try:
                    yield
                finally:
                    self._active.stream = previous

    def mark(self) -> Marker:
        """Recorded on the stream of the `issue` it is called in (the side stream outside one)."""
        event = torch.cuda.Event()
        event.record(getattr(self._active, "stream", None) or self._stream)
        return event_marker(event, self.device)

    def empty(self, count: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        return torch.empty(count, dtype=dtype, device=self.device)

    def index(self, rows: Rows) -> torch.Tensor:
        host, freed_by = self._ring.put(rows)
        try:
            out = torch.empty(len(rows), dtype=torch.int64, device=self.device)
            out.view(torch.uint8).copy_(host, non_blocking=True)
        except BaseException:
            freed_by(done)  # nothing reads it
            raise
        freed_by(self.mark())
        return out

    def wait(self, fence: Fence) -> None:
        stream = getattr(self._active, "stream", None) or self._stream
        if isinstance(fence.event, torch.cuda.Event):
            stream.wait_event(fence.event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def gather(self, dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
        torch.index_select(src, 0, index, out=dst)

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        dst.index_copy_(0, index, src)


def ops_for(device: torch.device) -> DeviceOps:
    return CudaOps(device) if device.type == "cuda" else HostOps()


WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_bytes(row: int, *addresses: int) -> int:
    """The widest integer word (8, 4, 2 or 1 bytes) rows of `row` bytes starting at these addresses can be read as:
    the indexing kernels move words, and as bytes they run at a fraction of a plain copy."""
    for size in (8, 4, 2):
        if row % size == 0 and all(a % size == 0 for a in addresses):
            return size
    return 1


def as_rows(flat: torch.Tensor, row: int, word: int) -> torch.Tensor:
    """A flat uint8 tensor as [rows, row bytes], read in words of `word` bytes (its tail past the last whole row
    left out)."""
    whole = flat[: flat.numel() // row * row]
    return whole.view(-1, row).view(WORDS[word])
