"""Device layers for the tests (`p2pkv.kv.device_copy.DeviceOps`), over host tensors: one records every operation it
was asked for (which thread, after which fences), one runs the copies late, on a thread of its own, as a GPU's
stream would."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from p2pkv.engine.device import Fence
from p2pkv.kv.device_copy import HostOps, Marker, Rows


@dataclass(frozen=True)
class Call:
    kind: str  # fence, passed, index, copy, gather, scatter
    thread: str
    after: tuple[Fence, ...]  # the fences the batch it belongs to was issued after (a fence itself: itself)
    nbytes: int = 0


class RecordingOps(HostOps):
    """Does what the host does, and records each operation. `pins_host`: behave as a GPU's layer does on the
    forward's path (no pageable host memory there)."""

    def __init__(self, pins_host: bool = False) -> None:
        super().__init__()
        self.pins_host = pins_host
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._after = threading.local()

    def _note(self, kind: str, nbytes: int = 0, after: tuple[Fence, ...] | None = None) -> None:
        call = Call(kind, threading.current_thread().name,
                    after if after is not None else getattr(self._after, "fences", ()), nbytes)
        with self._lock:
            self.calls.append(call)

    def fence(self) -> Fence:
        fence = Fence(object(), threading.current_thread().name)
        self._note("fence", after=(fence,))
        return fence

    def passed(self, fence: Fence) -> bool:
        self._note("passed", after=(fence,))
        return True

    @contextlib.contextmanager
    def issue(self, after: Sequence[Fence], stream: object | None = None) -> Iterator[None]:
        self._after.fences = tuple(after)
        try:
            yield
        finally:
            self._after.fences = ()

    def wait(self, fence: Fence) -> None:
        self._note("wait", after=(*getattr(self._after, "fences", ()), fence))
        self._after.fences = (*getattr(self._after, "fences", ()), fence)

    def index(self, rows: Rows) -> torch.Tensor:
        self._note("index", rows.nbytes)
        return super().index(rows)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._note("copy", dst.numel() * dst.element_size())
        super().copy(dst, src)

    def gather(self, dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
        self._note("gather", dst.numel() * dst.element_size())
        super().gather(dst, src, index)

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        self._note("scatter", src.numel() * src.element_size())
        super().scatter(dst, index, src)

    def of(self, *kinds: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.kind in kinds]


class SlowOps(RecordingOps):
    """Copies run `delay_s` after they are issued, in order, on a thread of their own (a GPU stream that is busy);
    a marker says done once that thread has got past it."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self._delay_s = delay_s
        self._work: queue.Queue[tuple[float, Callable[[], None]] | None] = queue.Queue()
        self._issued = 0
        self._done = 0
        self._counts = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="slow-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            when, work = item
            time.sleep(max(0.0, when - time.monotonic()))
            work()
            with self._counts:
                self._done += 1

    def _later(self, work: Callable[[], None]) -> None:
        with self._counts:
            self._issued += 1
        self._work.put((time.monotonic() + self._delay_s, work))

    def mark(self) -> Marker:
        with self._counts:
            target = self._issued
        return lambda: self._done >= target

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._note("copy", dst.numel() * dst.element_size())
        self._later(lambda: dst.copy_(src))

    def gather(self, dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
        self._note("gather", dst.numel() * dst.element_size())
        self._later(lambda: torch.index_select(src, 0, index, out=dst))

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        self._note("scatter", src.numel() * src.element_size())
        self._later(lambda: dst.index_copy_(0, index, src))

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(timeout=5)


class FailingOps(SlowOps):
    """Slow, and refuses its `fail_at`-th scatter (as a device out of memory would): the scatters before it are
    queued and still run."""

    def __init__(self, delay_s: float, fail_at: int) -> None:
        super().__init__(delay_s)
        self._fail_at = fail_at

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        if len(self.of("scatter")) + 1 == self._fail_at:
            raise RuntimeError("CUDA out of memory (injected)")
        super().scatter(dst, index, src)
