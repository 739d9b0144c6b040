"""The host pool: one buffer of `mem_pool_size_gb`, allocated on first use (not at start-up), carved by a buddy
allocator. With CUDA available the buffer is pinned, so device copies to and from it run at full speed; on a
CPU-only host it is ordinary memory.
"""

from __future__ import annotations

import logging
import mmap
import platform
import sys
import threading
from dataclasses import dataclass

from p2pkv.memory.buddy import BuddyAllocator, BuddyStats

log = logging.getLogger(__name__)
# Python's mmap module lacks MAP_NORESERVE here; Linux's value on x86-64 and arm64 (elsewhere: none).
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" and platform.machine() in
                         ("x86_64", "aarch64") else 0)


@dataclass(frozen=True)
class PoolBuffer:
    offset: int
    size: int
    view: memoryview


class HostPool:
    def __init__(self, capacity_bytes: int, min_block: int = 512, pinned: bool | None = None) -> None:
        self._capacity = capacity_bytes
        self._min_block = min_block
        self._pinned = pinned
        self._lock = threading.Lock()
        self._allocator: BuddyAllocator | None = None
        self._memory: memoryview | None = None
        self._keepalive: object | None = None
        self._pinned_memory = False
        self._failed = False

    @property
    def allocated(self) -> bool:
        return self._memory is not None

    def prepare(self) -> None:
        """Map (and pin) the memory now rather than on first use."""
        self._ensure()

    def _ensure(self) -> tuple[BuddyAllocator, memoryview] | None:
        """The allocator and memory, mapped on first use; None if the memory could not be had (logged once)."""
        with self._lock:
            if self._failed:
                return None
            if self._allocator is None or self._memory is None:
                try:
                    self._memory, self._keepalive = self._allocate_memory()
                except (OSError, RuntimeError) as exc:  # RuntimeError: CUDA could not pin that much
                    self._failed = True
                    log.error("host pool of %d bytes could not be mapped (%s); continuing without it: lower "
                              "mem_pool_size_gb to what this host can hold", self._capacity, exc)
                    return None
                self._allocator = BuddyAllocator(self._capacity, self._min_block)
                log.info("host pool of %d bytes mapped (pinned=%s)", self._capacity, self._pinned_memory)
            return self._allocator, self._memory

    def _allocate_memory(self) -> tuple[memoryview, object | None]:
        if self._pinned is not False:
            try:
                import torch

                if torch.cuda.is_available():
                    tensor = torch.empty(self._capacity, dtype=torch.uint8, pin_memory=True)
                    self._pinned_memory = True
                    return memoryview(tensor.numpy()), tensor
            except ImportError:
                pass
        # An anonymous mapping: pages are zero and materialise when first written, so a large pool costs
        # nothing until it is used (a bytearray would be zero-filled, touching every page at once). NORESERVE:
        # a pool larger than this host's memory is still mapped; only the bytes handed out are ever touched.
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        mapping = mmap.mmap(-1, self._capacity, flags=flags)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            mapping.madvise(mmap.MADV_HUGEPAGE)  # fewer page faults and cheaper cross-process reads
        return memoryview(mapping), mapping

    def allocate(self, size: int) -> PoolBuffer | None:
        """A buffer of exactly `size` bytes, or None when the pool has no block that large free (or no memory)."""
        if size <= 0 or size > self._capacity:
            return None
        ready = self._ensure()
        if ready is None:
            return None
        allocator, memory = ready
        offset = allocator.allocate(size)
        if offset is None:
            return None
        return PoolBuffer(offset, size, memory[offset : offset + size])

    def release(self, buffer: PoolBuffer) -> None:
        assert self._allocator is not None, "release before any allocate"
        self._allocator.release(buffer.offset)

    def stats(self) -> BuddyStats | None:
        return None if self._allocator is None else self._allocator.stats()
