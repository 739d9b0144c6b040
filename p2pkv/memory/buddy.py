"""A binary buddy allocator over integer offsets: power-of-two blocks, split on allocate, merge on release.

Allocate and release cost O(log n) set operations. The arena need not be a power of two: it starts as the
aligned power-of-two blocks that tile it, and a block never merges with a buddy that lies outside the arena.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class BuddyStats:
    capacity: int
    bytes_in_use: int
    bytes_requested: int
    largest_free_block: int
    allocations: int

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.bytes_in_use

    @property
    def fragmentation(self) -> float:
        """1 - largest free block / free bytes: 0 when all free memory is one block."""
        return 0.0 if self.free_bytes == 0 else 1.0 - self.largest_free_block / self.free_bytes


class BuddyAllocator:
    def __init__(self, capacity: int, min_block: int = 512) -> None:
        if min_block <= 0 or min_block & (min_block - 1):
            raise ValueError(f"min_block must be a power of two, got {min_block}")
        if capacity < min_block:
            raise ValueError(f"capacity {capacity} is smaller than min_block {min_block}")
        self._min_order = min_block.bit_length() - 1
        self.capacity = capacity - capacity % min_block
        self._max_order = self.capacity.bit_length() - 1
        # free[k] holds offsets of free blocks of size 2**k.
        self._free: list[set[int]] = [set() for _ in range(self._max_order + 1)]
        self._allocated: dict[int, tuple[int, int]] = {}  # offset -> (order, requested bytes)
        self._in_use = 0
        self._requested = 0
        self._lock = threading.Lock()
        offset = 0
        for order in range(self._max_order, self._min_order - 1, -1):
            if self.capacity - offset >= 1 << order:
                self._free[order].add(offset)
                offset += 1 << order

    def _order_for(self, size: int) -> int:
        return max(self._min_order, (size - 1).bit_length())

    def allocate(self, size: int) -> int | None:
        """Offset of a block of at least `size` bytes, aligned to its power-of-two size; None when none is free."""
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        order = self._order_for(size)
        if order > self._max_order:
            return None
        with self._lock:
            found = next((k for k in range(order, self._max_order + 1) if self._free[k]), None)
            if found is None:
                return None
            # The lowest free block: reuse stays in the low, already-touched part of the arena, where the pool's
            # lazily mapped pages are resident; an arbitrary one would fault in fresh pages again and again.
            offset = min(self._free[found])
            self._free[found].discard(offset)
            while found > order:
                found -= 1
                self._free[found].add(offset + (1 << found))
            self._allocated[offset] = (order, size)
            self._in_use += 1 << order
            self._requested += size
            return offset

    def release(self, offset: int) -> None:
        with self._lock:
            entry = self._allocated.pop(offset, None)
            if entry is None:
                raise KeyError(f"offset {offset} is not allocated")
            order, size = entry
            self._in_use -= 1 << order
            self._requested -= size
            while order < self._max_order:
                buddy = offset ^ (1 << order)
                if buddy not in self._free[order]:
                    break
                self._free[order].remove(buddy)
                offset = min(offset, buddy)
                order += 1
            self._free[order].add(offset)

    def block_size(self, offset: int) -> int:
        with self._lock:
            return 1 << self._allocated[offset][0]

    def free_blocks(self) -> list[tuple[int, int]]:
        """(offset, size) of every free block, sorted: for tests and diagnostics."""
        with self._lock:
            return sorted((off, 1 << k) for k, offs in enumerate(self._free) for off in offs)

    def stats(self) -> BuddyStats:
        with self._lock:
            largest = next((1 << k for k in range(self._max_order, -1, -1) if self._free[k]), 0)
            return BuddyStats(self.capacity, self._in_use, self._requested, largest, len(self._allocated))
