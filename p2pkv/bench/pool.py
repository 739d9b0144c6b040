"""`p2pkv bench pool`: buddy allocator throughput and fragmentation under a random workload."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from p2pkv.memory import BuddyAllocator


@dataclass(frozen=True)
class PoolBenchResult:
    pairs_per_second: float
    steady_pairs_per_second: float
    fragmentation: float
    occupancy: float
    failed_allocations: int


def run_pool_bench(capacity: int = 1 << 30, pairs: int = 200_000, seed: int = 0) -> PoolBenchResult:
    rng = random.Random(seed)
    allocator = BuddyAllocator(capacity, 512)
    # Hot path: allocate and release at once, sizes like a few KV blocks.
    sizes = [rng.randint(512, 4 << 20) for _ in range(1024)]
    start = time.perf_counter()
    for i in range(pairs):
        offset = allocator.allocate(sizes[i & 1023])
        assert offset is not None
        allocator.release(offset)
    hot = pairs / (time.perf_counter() - start)
    # Steady state: keep about half the arena allocated, freeing random survivors.
    live: list[int] = []
    failed = 0
    start = time.perf_counter()
    for i in range(pairs):
        offset = allocator.allocate(sizes[i & 1023])
        if offset is None:
            failed += 1
        else:
            live.append(offset)
        if live and (allocator.stats().bytes_in_use > capacity // 2 or rng.random() < 0.5):
            allocator.release(live.pop(rng.randrange(len(live))))
    steady = pairs / (time.perf_counter() - start)
    stats = allocator.stats()
    return PoolBenchResult(hot, steady, stats.fragmentation, stats.bytes_in_use / capacity, failed)


def main(capacity: int, pairs: int) -> int:
    result = run_pool_bench(capacity, pairs)
    print(f"{'metric':<44}{'value':>16}")
    print(f"{'allocate+release pairs/s (hot path)':<44}{result.pairs_per_second:>16,.0f}")
    print(f"{'allocate+release pairs/s (random workload)':<44}{result.steady_pairs_per_second:>16,.0f}")
    print(f"{'occupancy after the workload':<44}{result.occupancy:>16.1%}")
    print(f"{'fragmentation (1 - largest free / free)':<44}{result.fragmentation:>16.1%}")
    print(f"{'allocations refused (arena full)':<44}{result.failed_allocations:>16,}")
    return 0
