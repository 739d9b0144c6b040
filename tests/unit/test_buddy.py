"""BuddyAllocator against a simple reference model of allocated intervals (hypothesis)."""

from __future__ import annotations

import itertools
import threading

import pytest
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
