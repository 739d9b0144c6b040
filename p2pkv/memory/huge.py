"""Fresh host memory backed by transparent huge pages (2 MiB), for a KV cache that other processes copy from.

The kernel's cross-process copy (`process_vm_readv`, the data path of shm pushes and pulls) pins the source's pages
one at a time. Out of 4 KiB pages it moved 1 MiB at 11 to 12 GB/s on the development machine, out of 2 MiB pages at
22 to 23 (4 MiB: 9 to 11 and 23 to 26; `docs/design.md`, "Transports"). vLLM's CPU KV cache is one
`torch.zeros` buffer, faulted in as 4 KiB pages where the host's THP setting is `madvise` (the development
machine's).

`prepare` advises `MADV_HUGEPAGE` on a region's 2 MiB-aligned interior, then hands its runs of 2 MiB chunks that
hold only zeros back to the kernel (`MADV_DONTNEED`); they read as zeros as before, and `populate` faults them in
again (`MADV_POPULATE_WRITE`, which writes nothing), as huge pages where the kernel has them. A chunk holding any
other byte is left as it is (the kernel's khugepaged may merge it later), and so is memory that is not private and
anonymous (a file's, a shared mapping's). So no byte of the region changes, provided nothing writes to it during
`prepare`: the caller's to ensure (vLLM registers its KV cache before any forward). Writes during `populate` are
safe, so a worker runs it on a thread of its own (`HugePageFiller`) at the lowest CPU priority, one huge page per
call: faulting in 2 MiB pages took up to 8.7 s per GiB on this project's virtual machine. Linux only; elsewhere, or
with THP off (`never`), nothing is done.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

HUGE = 2 << 20
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; before, handed-back chunks are faulted in by their first write
# One huge page per call. The kernel holds the process's address space (`mmap_lock`, for reading) through a call, so
# the worker's own `mmap`/`munmap` wait behind it: with 64 MiB per call (0.3 to 0.5 s here) the first request after
# start-up took 1.6 to 1.9 s instead of about 0.3 (`docs/design.md`, "Transports"). The stop event is
# checked between calls.
_POPULATE_STEP = HUGE
_BACKGROUND_NICE = 19  # the filler's niceness: a prefetch, it yields the cores to the forward passes
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass(frozen=True)
class HugeResult:
    mode: str  # the host's THP setting (`always`, `madvise`, `never`), "" where there is none
    advised: int  # bytes of the region advised for huge pages
    refaulted: int  # of those, bytes handed back (all-zero chunks) and faulted in again
    huge: int  # bytes of the advised part that the kernel now backs with huge pages


@dataclass(frozen=True)
class Prepared:
    """What `prepare` did: the region's advised interior, and the runs it handed back, to be faulted in again."""

    mode: str
    advised: int = 0
    spans: tuple[tuple[int, int], ...] = ()
    runs: tuple[tuple[int, int], ...] = ()


def thp_mode() -> str:
    """The bracketed word of the host's THP setting, "" where the kernel has none (or not Linux)."""
    try:
        text = _THP.read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        libc.memcmp.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def _anonymous_spans(start: int, end: int) -> list[tuple[int, int]]:
    """The parts of [start, end) that lie in private anonymous mappings of this process (`/proc/self/maps`)."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        name = fields[5].strip() if len(fields) > 5 else ""
        if hi <= start or lo >= end or not fields[1].endswith("p") or name not in ("", "[heap]"):
            continue
        spans.append((max(lo, start), min(hi, end)))
    return spans


def _huge_bytes(start: int, end: int) -> int:
    """Bytes of [start, end) in huge pages, from `/proc/self/smaps`, which counts them per mapping: an advised
    region is a mapping of its own (unless it borders another advised one), and a mapping's count is capped at the
    part of it inside [start, end)."""
    total, overlap = 0, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            overlap = max(0, min(hi, end) - max(lo, start))
        elif overlap and head == "AnonHugePages:":
            total += min(overlap, int(line.split()[1]) * 1024)
    return total


def _zero_runs(libc: ctypes.CDLL, start: int, end: int) -> list[tuple[int, int]]:
    """The runs of consecutive 2 MiB chunks of [start, end) that hold only zeros."""
    zeros = ctypes.create_string_buffer(HUGE)
    runs: list[tuple[int, int]] = []
    for chunk in range(start, end, HUGE):
        if int(libc.memcmp(chunk, zeros, HUGE)) != 0:
            continue
        if runs and runs[-1][1] == chunk:
            runs[-1] = (runs[-1][0], chunk + HUGE)
        else:
            runs.append((chunk, chunk + HUGE))
    return runs


def prepare(address: int, nbytes: int) -> Prepared:
    """Advise [address, address + nbytes) for huge pages and hand back its all-zero 2 MiB chunks (above)."""
    mode = thp_mode()
    libc = _libc()
    start, end = -(-address // HUGE) * HUGE, (address + nbytes) // HUGE * HUGE
    if libc is None or mode in ("", "never") or end <= start:
        return Prepared(mode)
    spans: list[tuple[int, int]] = []
    runs: list[tuple[int, int]] = []
    for lo, hi in _anonymous_spans(start, end):
        lo, hi = -(-lo // HUGE) * HUGE, hi // HUGE * HUGE
        if hi <= lo:
            continue
        if libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
            log.info("huge pages: madvise(MADV_HUGEPAGE) failed (errno %d); the KV cache keeps its pages",
                     ctypes.get_errno())
            continue
        spans.append((lo, hi))
        if _huge_bytes(lo, hi) >= hi - lo:  # in huge pages already (THP `always`)
            continue
        for run in _zero_runs(libc, lo, hi):
            # One call per run of zero chunks: a call per chunk, each followed by its fault, took 30 times longer.
            if libc.madvise(run[0], run[1] - run[0], _MADV_DONTNEED) == 0:
                runs.append(run)
    return Prepared(mode, sum(hi - lo for lo, hi in spans), tuple(spans), tuple(runs))


def populate(runs: Iterable[tuple[int, int]], stop: threading.Event | None = None) -> int:
    """Fault handed-back runs in again without writing to them; the bytes done (fewer if stopped, or where the
    kernel cannot: those are faulted in by their first write)."""
    libc = _libc()
    if libc is None:
        return 0
    done = 0
    for lo, hi in runs:
        for step in range(lo, hi, _POPULATE_STEP):
            if stop is not None and stop.is_set():
                return done
            size = min(_POPULATE_STEP, hi - step)
            if libc.madvise(step, size, _MADV_POPULATE_WRITE) != 0:
                log.info("huge pages: madvise(MADV_POPULATE_WRITE) failed (errno %d); the rest is faulted in as "
                         "it is first written", ctypes.get_errno())
                return done
            done += size
    return done


def result_of(prepared: Iterable[Prepared], refaulted: int) -> HugeResult:
    items = list(prepared)
    huge = sum(_huge_bytes(lo, hi) for p in items for lo, hi in p.spans)
    return HugeResult(thp_mode(), sum(p.advised for p in items), refaulted, huge)


def back_with_huge_pages(address: int, nbytes: int) -> HugeResult:
    """`prepare` and `populate` at once, on the calling thread."""
    prepared = prepare(address, nbytes)
    return result_of([prepared], populate(prepared.runs))


def lower_priority() -> bool:
    """Give the calling thread (not its process) the lowest CPU priority: Linux's `setpriority` takes a thread id.
    Pages it has not faulted in yet are faulted in by their first write as before, so nothing waits for it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _BACKGROUND_NICE)
    except (OSError, AttributeError):  # not Linux, or a sandbox that forbids it
        return False
    return True


class HugePageFiller:
    """A worker's KV cache: `prepare`d at once (nothing may write to it meanwhile), then faulted in again on an owned
    thread while vLLM goes on starting; stopped by `close`."""

    def __init__(self, regions: Iterable[tuple[int, int]]) -> None:
        started = time.monotonic()
        self._prepared = [prepare(address, nbytes) for address, nbytes in sorted(set(regions))]
        self._stop = threading.Event()
        self._done = threading.Event()
        self.result: HugeResult | None = None
        # A plain thread, not the engine's (which widen their CPU affinity): it keeps the registering thread's CPUs,
        # hence its NUMA node, where vLLM's worker first faulted the cache in.
        self._thread = threading.Thread(target=self._run, name="p2pkv-huge-pages", daemon=True)
        advised = sum(p.advised for p in self._prepared)
        handed = sum(hi - lo for p in self._prepared for lo, hi in p.runs)
        mode = self._prepared[0].mode if self._prepared else thp_mode()
        if advised:
            log.info("KV cache: %d MiB advised for 2 MiB pages, %d MiB of it handed back (%.2f s), to be faulted in "
                     "again as such on a thread of its own (THP: %s)", advised >> 20, handed >> 20,
                     time.monotonic() - started, mode)
        else:
            log.info("KV cache: left in its pages (THP: %s)", mode or "not on this host")

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            if not lower_priority():
                log.info("KV cache: the fault-in thread keeps its CPU priority (setpriority refused)")
            done = populate((run for p in self._prepared for run in p.runs), self._stop)
            self.result = result_of(self._prepared, done)
            if self.result.advised:
                log.info("KV cache: %d MiB faulted in again, %d MiB now in huge pages (%.2f s)", done >> 20,
                         self.result.huge >> 20, time.monotonic() - started)
        except Exception:  # a hint that failed must not take the worker down
            log.exception("KV cache: faulting in huge pages failed")
        finally:
            self._done.set()

    def wait(self, timeout_s: float) -> HugeResult | None:
        """The result once the thread is done (None if it is not within `timeout_s`, or failed)."""
        self._done.wait(timeout_s)
        return self.result

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
