"""Large cross-memory reads on two threads: the caller copies the first half, an owned helper thread the second.

The kernel's cross-process copy pins and copies the peer's pages one at a time, and one thread of it moved only
0.35x to 0.78x of a memcpy of the same bytes at 8 to 256 MiB on the 2-core development machine; two threads, each
on half of the bytes, moved 1.3x to 2.1x as much (`docs/design.md`, "Transports"). Below `SPLIT_FROM` the
hand-over to the helper costs more than it saves, so smaller reads stay on the caller's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from p2pkv.errors import TransferError
from p2pkv.transport import cma
from p2pkv.transport.threads import engine_thread

SPLIT_FROM = 8 << 20
_ALIGN = 4096
# The helper's half is one bounded system call, like the caller's own half; it is waited for past the transfer's
# deadline because until it returns the kernel may still write into the destination, which the caller is about to
# hand back for reuse. Only a stalled machine reaches this cap.
_HELPER_CAP_S = 30.0


def split_views(views: Sequence[memoryview], nbytes: int) -> tuple[list[memoryview], list[memoryview]]:
    """The first `nbytes` of the buffers `views` (one may be cut in two), and the rest."""
    head: list[memoryview] = []
    for at, view in enumerate(views):
        if nbytes >= view.nbytes:
            head.append(view)
            nbytes -= view.nbytes
            continue
        if nbytes:
            head.append(view[:nbytes])
        return head, [view[nbytes:], *views[at + 1 :]]
    return head, []


class SplitReader:
    """Reads a peer's memory ranges into local buffers, splitting reads of `split_from` bytes or more across the
    calling thread and one helper thread, started on the first such read and stopped by `close()`. One caller at a
    time (a connection is read by one thread)."""

    def __init__(self, pid: int, split_from: int = SPLIT_FROM) -> None:
        self._pid = pid
        self._split_from = max(2 * _ALIGN, split_from)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._job: tuple[list[memoryview], list[tuple[int, int]]] | None = None
        self._finished = threading.Event()
        self._error: TransferError | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.split_reads = 0  # reads that were shared with the helper (tests check it)

    def read(self, local: Sequence[memoryview], remote: Sequence[tuple[int, int]]) -> None:
        """Fill `local` in turn from the peer's `remote` ranges (their lengths must add up)."""
        total = sum(v.nbytes for v in local)
        mine = self._hand_over(local, remote, total) if total >= self._split_from else None
        if mine is None:
            cma.read_remote_scattered(self._pid, local, remote)
            return
        try:
            cma.read_remote_scattered(self._pid, *mine)
        finally:
            finished = self._finished.wait(_HELPER_CAP_S)
        if not finished:
            with self._lock:
                self._closed = True  # its late finish must not be taken for a later read's: no more hand-overs
            raise TransferError(f"the helper's half of a {total}-byte read did not finish in {_HELPER_CAP_S:.0f} s")
        error, self._error = self._error, None
        if error is not None:
            try:
                raise error
            finally:
                del error  # else this frame, the error and its traceback keep each other (and the views) alive

    def _hand_over(self, local: Sequence[memoryview], remote: Sequence[tuple[int, int]], total: int
                   ) -> tuple[list[memoryview], list[tuple[int, int]]] | None:
        """Give the second half to the helper (started if need be) and return the first; None if closed."""
        if sum(n for _, n in remote) != total:
            return None  # the plain read reports the mismatch
        half = total // 2 // _ALIGN * _ALIGN
        mine, theirs = split_views(local, half)
        near, far = cma.split_ranges(remote, half)
        with self._lock:
            if self._closed:
                return None
            if self._thread is None:
                self._thread = engine_thread(self._run, f"p2pkv-copy-{self._pid}")
                self._thread.start()
            self._error = None
            self._finished.clear()
            self._job = (theirs, far)
            self.split_reads += 1
            self._work.notify()
        return mine, near

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._job is None and not self._closed:
                    self._work.wait(1.0)
                if self._job is None:
                    return
                local, remote = self._job
                self._job = None
            try:
                cma.read_remote_scattered(self._pid, local, remote)
            except TransferError as exc:  # without its traceback, whose frames hold views of the destination
                self._error = exc.with_traceback(None)
            except Exception as exc:  # a bug must reach the caller, not end the helper silently
                self._error = TransferError(f"the helper's half of a read failed: {exc!r}")
            # Hold no view of the destination once the read is over: its owner may close or reuse that memory.
            del local, remote
            self._finished.set()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
            self._work.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
