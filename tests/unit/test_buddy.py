"""BuddyAllocator against a simple reference model of allocated intervals (hypothesis)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pkv.memory import BuddyAllocator, HostPool

MIN = 512

ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(min_value=1, max_value=70_000)),
        st.tuples(st.just("free"), st.integers(min_value=0, max_value=10_000)),
    ),
    max_size=120,
)


def check_invariants(a: BuddyAllocator, live: dict[int, int]) -> None:
    spans = sorted((off, a.block_size(off)) for off in live)
    for (o1, s1), (o2, _) in itertools.pairwise(spans):
        assert o1 + s1 <= o2, "allocated blocks overlap"
    free = a.free_blocks()
    every = sorted(spans + free)
    # Allocated and free blocks tile the arena exactly: no gaps, no overlap, nothing lost.
    position = 0
    for off, size in every:
        assert off == position
        position += size
    assert position == a.capacity
    assert a.stats().bytes_in_use == sum(s for _, s in spans)


@settings(max_examples=300, deadline=None)
@given(capacity_blocks=st.integers(min_value=1, max_value=300), program=ops)
def test_matches_reference_model(capacity_blocks: int, program: list[tuple[str, int]]) -> None:
    a = BuddyAllocator(capacity_blocks * MIN, MIN)
    initial = a.free_blocks()
    live: dict[int, int] = {}
    for op, arg in program:
        if op == "alloc":
            largest_before = a.stats().largest_free_block
            offset = a.allocate(arg)
            if offset is None:
                assert largest_before < max(MIN, 1 << (arg - 1).bit_length()), "refused although a block fit"
            else:
                size = a.block_size(offset)
                assert size >= arg and size & (size - 1) == 0 and offset % size == 0
                live[offset] = arg
        elif live:
            offset = sorted(live)[arg % len(live)]
            a.release(offset)
            del live[offset]
        check_invariants(a, live)
    for offset in list(live):
        a.release(offset)
    assert a.free_blocks() == initial
    assert a.stats().bytes_in_use == 0


def test_power_of_two_arena_merges_back_to_one_block() -> None:
    a = BuddyAllocator(1 << 20, MIN)
    offsets = [a.allocate(1000) for _ in range(1025)]
    assert all(o is not None for o in offsets[:1024]) and offsets[1024] is None
    for o in offsets:
        if o is not None:
            a.release(o)
    assert a.free_blocks() == [(0, 1 << 20)]
    assert a.stats().fragmentation == 0.0


def test_errors() -> None:
    a = BuddyAllocator(4096, MIN)
    with pytest.raises(ValueError):
        a.allocate(0)
    assert a.allocate(8192) is None
    with pytest.raises(KeyError):
        a.release(512)
    with pytest.raises(ValueError):
        BuddyAllocator(4096, 500)


def test_thread_safety() -> None:
    a = BuddyAllocator(1 << 22, MIN)

    def worker() -> None:
        for _ in range(2000):
            o = a.allocate(700)
            assert o is not None
            a.release(o)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert a.free_blocks() == [(0, 1 << 22)]


def test_pool_is_allocated_lazily_and_hands_out_disjoint_views() -> None:
    pool = HostPool(1 << 16, MIN, pinned=False)
    assert not pool.allocated and pool.stats() is None
    first, second = pool.allocate(1000), pool.allocate(3000)
    assert pool.allocated and first is not None and second is not None
    first.view[:] = b"\x01" * 1000
    second.view[:] = b"\x02" * 3000
    assert bytes(first.view) == b"\x01" * 1000
    assert pool.allocate(1 << 17) is None
    pool.release(first)
    pool.release(second)
    stats = pool.stats()
    assert stats is not None and stats.bytes_in_use == 0


def test_bench_pool_command_prints_its_figures(capsys: pytest.CaptureFixture[str]) -> None:
    from p2pkv.cli.main import main

    assert main(["bench", "pool", "--capacity", str(1 << 24), "--pairs", "2000"]) == 0
    out = capsys.readouterr().out
    assert "allocate+release pairs/s (hot path)" in out and "fragmentation" in out
    rate = int(out.splitlines()[1].split()[-1].replace(",", ""))
    assert rate > 0


def test_a_pool_that_cannot_be_mapped_hands_out_nothing_instead_of_raising() -> None:
    pool = HostPool(1 << 50, pinned=False)  # a PiB: more address space than the kernel gives a process
    assert pool.allocate(4096) is None
    assert pool.allocate(4096) is None  # logged once, not retried
    assert pool.stats() is None


def test_a_pool_larger_than_this_host_is_mapped_lazily() -> None:
    pool = HostPool(64 << 30, pinned=False)  # more than the 24 GiB of CI machines: only touched pages count
    buf = pool.allocate(1 << 20)
    assert buf is not None
    buf.view[:] = b"\x01" * (1 << 20)
    pool.release(buf)


class Pins:
    """Records what the pool asks to pin (CUDA's cudaHostRegister on a GPU host); fails from `fail_from` bytes."""

    def __init__(self, fail_from: int | None = None) -> None:
        self.spans: list[tuple[int, int]] = []
        self.threads: list[str] = []
        self.fail_from = fail_from

    def __call__(self, memory: memoryview, start: int, end: int) -> None:
        assert 0 <= start < end <= len(memory)
        self.threads.append(threading.current_thread().name)
        if self.fail_from is not None and end > self.fail_from:
            raise RuntimeError("cudaErrorMemoryAllocation")
        self.spans.append((start, end))


def _until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 5
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_the_pool_pins_one_segment_when_prepared_and_more_ahead_of_demand_on_its_own_thread() -> None:
    """A GPU worker's pool is not pinned whole at start-up (the old connector pinned 32 GiB per worker), and
    pinning more never runs on the thread that allocates (vLLM's, in the forward's hooks)."""
    seg = 1 << 20
    pins = Pins()
    pool = HostPool(16 * seg, MIN, pin=pins, segment=seg)
    try:
        pool.prepare()  # at registration, on the caller's thread
        assert pins.spans == [(0, seg)] and pool.pinned_bytes == seg
        pins.threads.clear()
        small = pool.allocate(seg // 4)  # inside the pinned segment, far from its end: nothing more is pinned
        assert small is not None
        time.sleep(0.05)
        assert pins.spans == [(0, seg)]
        big = pool.allocate(3 * seg)  # reaches past what is pinned: refused (the caller falls back), more is asked for
        assert big is None
        _until(lambda: pool.pinned_bytes >= 4 * seg, "the pool did not pin ahead of the refused allocation")
        big = pool.allocate(3 * seg)
        assert big is not None and big.offset + big.size <= pool.pinned_bytes
        _until(lambda: pool.pinned_bytes >= big.offset + big.size + seg // 2, "no headroom was pinned")
        assert pins.threads and set(pins.threads) == {"p2pkv-pool-pin"}, pins.threads
        assert all(a[1] == b[0] for a, b in itertools.pairwise(pins.spans)), "pinned spans are contiguous"
        pool.release(big)
        count = len(pins.spans)
        again = pool.allocate(3 * seg)  # reuse of pinned memory pins nothing new
        assert again is not None and len(pins.spans) == count
    finally:
        pool.close()
    assert not any(t.name == "p2pkv-pool-pin" for t in threading.enumerate())


def test_an_allocation_that_cannot_be_pinned_is_refused_and_the_pool_keeps_working() -> None:
    seg = 1 << 20
    pins = Pins(fail_from=2 * seg)
    pool = HostPool(16 * seg, MIN, pin=pins, segment=seg)
    try:
        pool.prepare()
        first = pool.allocate(seg // 4)
        assert first is not None and pins.spans == [(0, seg)]
        assert pool.allocate(4 * seg) is None  # past what can be pinned: the caller gets a buffer of its own
        _until(lambda: len(pins.threads) >= 2, "the pinning thread did not try")
        stats = pool.stats()
        assert stats is not None and stats.bytes_in_use == seg // 4, "the refused block went back to the pool"
        pool.release(first)
        again = pool.allocate(seg // 4)  # what is pinned is still handed out
        assert again is not None and again.offset + again.size <= pool.pinned_bytes
        tries = len(pins.threads)
        assert pool.allocate(4 * seg) is None  # the failure is logged once, not retried per allocation
        time.sleep(0.05)
        assert len(pins.threads) == tries and pins.spans == [(0, seg)]
    finally:
        pool.close()


def test_pinned_by_default_only_where_cuda_is() -> None:
    pool = HostPool(1 << 20, MIN)  # pinned=None: CUDA's pinning where CUDA is available
    buf = pool.allocate(4096)
    assert buf is not None
    assert pool.pinned_bytes == (1 << 20 if torch.cuda.is_available() else 0)
    assert HostPool(1 << 20, MIN, pinned=False).pinned_bytes == 0
