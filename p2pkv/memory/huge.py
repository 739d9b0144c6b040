"""Fresh host memory backed by transparent huge pages (2 MiB), for a KV cache that other processes copy from.

The kernel's cross-process copy (`process_vm_readv`, the data path of shm pushes and pulls) pins the source's pages
one at a time. Out of 4 KiB pages it moved 1 MiB at 11 to 12 GB/s on the development machine, out of 2 MiB pages at
22 to 23 (4 MiB: 9 to 11 and 23 to 26; `docs/benchmarks.md`, twenty-second session). vLLM's CPU KV cache is one
`torch.zeros` buffer, faulted in as 4 KiB pages where the host's THP setting is `madvise` (the development
machine's).

`back_with_huge_pages` advises `MADV_HUGEPAGE` on a region's 2 MiB-aligned interior, then hands its 2 MiB chunks
that hold only zeros back to the kernel (`MADV_DONTNEED`) and touches each once, so it faults them in again as huge
pages, zeros as before. A chunk holding any other byte is left as it is (the kernel's khugepaged may merge it later),
and so is memory that is not private and anonymous (a file's, a shared mapping's). So no byte of the region changes,
provided nothing writes to it meanwhile: the caller's to ensure (vLLM registers its KV cache before any forward).
Linux only; elsewhere, or with THP off (`never`), it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

HUGE = 2 << 20
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass(frozen=True)
class HugeResult:
    mode: str  # the host's THP setting (`always`, `madvise`, `never`), "" where there is none
    advised: int  # bytes of the region advised for huge pages
    refaulted: int  # of those, bytes handed back and faulted in again (all-zero chunks)
    huge: int  # bytes of the advised part that the kernel now backs with huge pages


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


def back_with_huge_pages(address: int, nbytes: int) -> HugeResult:
    """Advise [address, address + nbytes) for huge pages and re-fault its all-zero 2 MiB chunks as such (above)."""
    mode = thp_mode()
    libc = _libc()
    if libc is None or mode in ("", "never") or nbytes <= 0:
        return HugeResult(mode, 0, 0, 0)
    start, end = -(-address // HUGE) * HUGE, (address + nbytes) // HUGE * HUGE
    if end <= start:
        return HugeResult(mode, 0, 0, 0)
    advised = refaulted = 0
    for lo, hi in _anonymous_spans(start, end):
        lo, hi = -(-lo // HUGE) * HUGE, hi // HUGE * HUGE
        if hi <= lo:
            continue
        if libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
            log.info("huge pages: madvise(MADV_HUGEPAGE) failed (errno %d); the KV cache keeps its pages",
                     ctypes.get_errno())
            continue
        advised += hi - lo
        if _huge_bytes(lo, hi) >= hi - lo:  # in huge pages already (THP `always`)
            continue
        for run_lo, run_hi in _zero_runs(libc, lo, hi):
            # One call per run of zero chunks: a call per chunk, each followed by its fault, took 30 times longer.
            if libc.madvise(run_lo, run_hi - run_lo, _MADV_DONTNEED) != 0:
                continue
            for chunk in range(run_lo, run_hi, HUGE):
                ctypes.memset(chunk, 0, 1)  # faults the chunk in again, as one huge page where the kernel has one
            refaulted += run_hi - run_lo
    huge = _huge_bytes(start, end) if advised else 0
    return HugeResult(mode, advised, refaulted, huge)


def back_kv_with_huge_pages(regions: Iterable[tuple[int, int]]) -> HugeResult:
    """`back_with_huge_pages` for each (address, nbytes) of a KV cache just allocated, the sum, and one log line."""
    started = time.monotonic()
    results = [back_with_huge_pages(address, nbytes) for address, nbytes in sorted(set(regions))]
    total = HugeResult(thp_mode(), sum(r.advised for r in results), sum(r.refaulted for r in results),
                       sum(r.huge for r in results))
    if total.advised:
        log.info("KV cache: %d MiB advised for 2 MiB pages, %d MiB faulted in again, %d MiB now in huge pages "
                 "(THP: %s; %.2f s)", total.advised >> 20, total.refaulted >> 20, total.huge >> 20, total.mode,
                 time.monotonic() - started)
    else:
        log.info("KV cache: left in its pages (THP: %s)", total.mode or "not on this host")
    return total
