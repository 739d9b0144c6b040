"""Fresh memory backed by huge pages (`p2pkv.memory.huge`): zeroed 2 MiB chunks of a private anonymous region are
faulted in again as huge pages, every byte stays as it was (also bytes written while they are faulted in), and
memory that is not private and anonymous, or a host with THP off, is left alone."""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from p2pkv.memory import huge
from p2pkv.memory.huge import HUGE, HugePageFiller, back_with_huge_pages, populate, prepare, thp_mode

needs_thp = pytest.mark.skipif(thp_mode() in ("", "never"), reason="this host has no transparent huge pages")


def zeroed(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """An anonymous private mapping faulted in by writing zeros, as torch.zeros does a KV cache (4 KiB pages where
    THP is `madvise`)."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    data = np.frombuffer(region, np.uint8)
    data[:] = 0
    return region, data


def interior(address: int, nbytes: int) -> tuple[int, int]:
    return -(-address // HUGE) * HUGE, (address + nbytes) // HUGE * HUGE


@needs_thp
def test_the_zeroed_chunks_of_a_region_are_faulted_in_again_as_huge_pages_and_no_byte_changes() -> None:
    _, data = zeroed(9 * HUGE)
    lo, hi = interior(data.ctypes.data + 100, data.nbytes - 200)
    assert hi - lo >= 7 * HUGE
    kept = lo + 2 * HUGE + 12345 - data.ctypes.data  # a byte of data in the third chunk: that chunk stays as it is
    data[kept] = 7
    data[10] = 9  # and one before the aligned interior, which is not touched at all
    if thp_mode() == "madvise":
        assert huge._huge_bytes(lo, hi) == 0  # what torch.zeros leaves: 4 KiB pages

    result = back_with_huge_pages(data.ctypes.data + 100, data.nbytes - 200)

    assert result.advised == hi - lo
    assert result.refaulted == hi - lo - HUGE
    assert result.huge >= result.refaulted
    assert huge._huge_bytes(lo, hi) == result.huge
    assert np.count_nonzero(data) == 2 and data[kept] == 7 and data[10] == 9


def test_a_region_without_a_whole_aligned_chunk_is_left_alone() -> None:
    _, data = zeroed(3 * HUGE)
    start = -(-data.ctypes.data // HUGE) * HUGE - data.ctypes.data + 4096
    result = back_with_huge_pages(data.ctypes.data + start, HUGE)
    assert (result.advised, result.refaulted, result.huge) == (0, 0, 0)


@needs_thp
def test_a_private_mapping_of_a_file_is_not_handed_back(tmp_path: Path) -> None:
    # Handing back a private file mapping's pages would bring back the file's bytes under the zeros written over
    # them: 0xAB here.
    path = tmp_path / "kv"
    path.write_bytes(b"\xab" * (4 * HUGE))
    with path.open("r+b") as f:
        region = mmap.mmap(f.fileno(), 4 * HUGE, flags=mmap.MAP_PRIVATE)
    data = np.frombuffer(region, np.uint8)
    data[:] = 0
    result = back_with_huge_pages(data.ctypes.data, data.nbytes)
    assert (result.advised, result.refaulted) == (0, 0)
    assert np.count_nonzero(data) == 0


@needs_thp
def test_a_shared_mapping_is_not_handed_back() -> None:
    region = mmap.mmap(-1, 4 * HUGE, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    data = np.frombuffer(region, np.uint8)
    data[:] = 0
    result = back_with_huge_pages(data.ctypes.data, data.nbytes)
    assert (result.advised, result.refaulted) == (0, 0)


def test_with_thp_off_nothing_is_advised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge, "_THP", setting)
    _, data = zeroed(4 * HUGE)
    result = back_with_huge_pages(data.ctypes.data, data.nbytes)
    assert result == huge.HugeResult("never", 0, 0, 0)
    assert thp_mode() == "never"


def test_the_setting_is_read_from_its_brackets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setting = tmp_path / "enabled"
    monkeypatch.setattr(huge, "_THP", setting)
    assert thp_mode() == ""  # no such file: no THP on this kernel
    setting.write_text("always [madvise] never\n")
    assert thp_mode() == "madvise"


@needs_thp
def test_bytes_written_between_the_hand_back_and_the_fault_are_kept() -> None:
    # A worker faults its cache in on a thread of its own while vLLM goes on: a forward may write first.
    _, data = zeroed(6 * HUGE)
    prepared = prepare(data.ctypes.data, data.nbytes)
    assert len(prepared.runs) == 1 and prepared.runs[0][1] - prepared.runs[0][0] >= 4 * HUGE
    first = prepared.runs[0][0] - data.ctypes.data
    data[first + HUGE] = 5  # the first byte of a handed-back chunk
    data[first + 3 * HUGE + 77] = 6
    assert populate(prepared.runs) == prepared.runs[0][1] - prepared.runs[0][0]
    assert np.count_nonzero(data) == 2 and data[first + HUGE] == 5 and data[first + 3 * HUGE + 77] == 6
    assert huge._huge_bytes(*prepared.runs[0]) == prepared.runs[0][1] - prepared.runs[0][0]


@needs_thp
def test_the_filler_faults_the_cache_in_on_its_thread_and_stops_when_closed() -> None:
    _, data = zeroed(9 * HUGE)
    filler = HugePageFiller([(data.ctypes.data, data.nbytes)])
    filler.start()
    result = filler.wait(60)
    assert result is not None and result.refaulted >= 8 * HUGE and result.huge >= result.refaulted
    filler.close()

    _, big = zeroed(512 * HUGE)
    stopped = HugePageFiller([(big.ctypes.data, big.nbytes)])
    stopped.close()  # before it starts: it faults nothing in and ends at once
    stopped.start()
    result = stopped.wait(10)
    assert result is not None and result.refaulted == 0 and result.advised >= 510 * HUGE


def test_each_call_faults_in_one_huge_page_so_the_address_space_is_not_held_for_long(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel holds the process's mmap_lock through a call; the worker's mmap/munmap wait behind it (with 64 MiB
    # per call the first request after start-up took 1.6 to 1.9 s here).
    calls: list[tuple[int, int, int]] = []

    class Libc:
        def madvise(self, address: int, size: int, advice: int) -> int:
            calls.append((address, size, advice))
            return 0

    monkeypatch.setattr(huge, "_libc", lambda: Libc())
    runs = [(10 * HUGE, 50 * HUGE), (80 * HUGE, 81 * HUGE)]
    assert populate(runs) == 41 * HUGE
    assert [a for a, _, _ in calls] == [*range(10 * HUGE, 50 * HUGE, HUGE), 80 * HUGE]
    assert {(size, advice) for _, size, advice in calls} == {(HUGE, huge._MADV_POPULATE_WRITE)}


def test_the_filler_runs_at_the_lowest_priority_and_leaves_the_other_threads_as_they_were(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    def record(runs: object, stop: object = None) -> int:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return 0

    monkeypatch.setattr(huge, "populate", record)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    filler = HugePageFiller([])
    filler.start()
    assert filler.wait(10) is not None
    filler.close()
    assert seen == [19]
    assert before < 19 and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
