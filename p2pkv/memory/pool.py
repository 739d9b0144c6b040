"""The host pool: one mapping of `mem_pool_size_gb`, made on first use, carved by a buddy allocator. Its pages
are touched only when handed out. With CUDA available the part handed out is pinned (page-locked and registered
with CUDA, `cudaHostRegister`), so device copies to and from it run at full speed and never wait for the host: one
segment (1 GiB) when the pool is prepared, then segment by segment, ahead of demand, on a thread of the pool's own
(`cudaHostRegister` takes about 0.5 s per GiB, and may not run on the forward's path). An allocation that reaches
past what is pinned is refused (its caller falls back) and asks that thread for more. Pinning every worker's whole
pool at start-up (the old connector's 32 GiB) took seconds per GiB and failed on small hosts. On a CPU-only host
nothing is pinned.
"""

from __future__ import annotations

import logging
import mmap
import platform
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from p2pkv.memory.buddy import BuddyAllocator, BuddyStats

log = logging.getLogger(__name__)
# Python's mmap module lacks MAP_NORESERVE here; Linux's value on x86-64 and arm64 (elsewhere: none).
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" and platform.machine() in
                         ("x86_64", "aarch64") else 0)
PIN_SEGMENT = 1 << 30
Pin = Callable[[memoryview, int, int], None]  # pin bytes start..end of the mapping; raises when it cannot


def cuda_pin(memory: memoryview, start: int, end: int, device: int | None = None) -> None:
    """Page-lock and register with CUDA a span of the mapping (torch's binding of cudaHostRegister), with `device`
    current: the engine's threads pin as they allocate, and a thread's current device is GPU 0 until it is set,
    where a worker on another GPU would otherwise make a CUDA context of its own."""
    import contextlib
    import ctypes

    import torch

    address = ctypes.addressof(ctypes.c_char.from_buffer(memory, start))
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        err = torch.cuda.cudart().cudaHostRegister(address, end - start, 1)  # 1: portable, pinned for every device
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {end - start} bytes failed: {err}")


def _current_device() -> int | None:
    """The CUDA device current where the pool is made (a GPU worker's own), once CUDA is up in this process."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    device: int = torch.cuda.current_device()
    return device


def _default_pin(pinned: bool | None, device: int | None) -> Pin | None:
    if pinned is False:
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None

    def pin(memory: memoryview, start: int, end: int) -> None:
        cuda_pin(memory, start, end, device)

    return pin


@dataclass(frozen=True)
class PoolBuffer:
    offset: int
    size: int
    view: memoryview


class HostPool:
    def __init__(self, capacity_bytes: int, min_block: int = 512, pinned: bool | None = None,
                 pin: Pin | None = None, segment: int = PIN_SEGMENT) -> None:
        """`pinned`: None pins with CUDA where it is available, False never; `pin` replaces CUDA's pinning. More is
        pinned once allocations come within half a segment of the end of what is."""
        self._capacity = capacity_bytes
        self._min_block = min_block
        self._pinned = pinned
        self._pin = pin
        self._device = _current_device() if pin is None and pinned is not False else None
        self._segment = segment
        self._lock = threading.Lock()
        self._grow_lock = threading.Lock()
        self._pinned_to = 0  # bytes [0, _pinned_to) of the mapping are pinned
        self._pin_failed = False
        self._allocator: BuddyAllocator | None = None
        self._memory: memoryview | None = None
        self._keepalive: object | None = None
        self._failed = False
        self._wanted = 0  # pin up to here (the pinning thread's work)
        self._wake = threading.Condition()
        self._grower: threading.Thread | None = None
        self._closed = False

    @property
    def allocated(self) -> bool:
        return self._memory is not None

    @property
    def pinned_bytes(self) -> int:
        return self._pinned_to

    def prepare(self, up_to: int = 0) -> None:
        """Map the memory, and pin its first segment (or its first `up_to` bytes), now rather than on first use
        (pinning costs about 0.5 s per GiB: at start-up, not in a transfer)."""
        ready = self._ensure()
        if ready is not None and self._pin is not None:
            self._pin_to(ready[1], min(self._capacity, max(up_to, self._segment)))
            self._start_grower()

    def _start_grower(self) -> None:
        with self._wake:
            if self._grower is None and not self._closed:
                self._grower = threading.Thread(target=self._grow, name="p2pkv-pool-pin", daemon=True)
                self._grower.start()

    def _want(self, end: int) -> None:
        """Ask the pinning thread to pin up to `end` (rounded up to a segment)."""
        with self._wake:
            if end > self._wanted:
                self._wanted = end
                self._wake.notify()
        self._start_grower()

    def _grow(self) -> None:
        """The pinning thread: pins up to what allocations asked for, a segment at a time, until the pool closes."""
        while True:
            with self._wake:
                while not self._closed and self._wanted <= self._pinned_to:
                    self._wake.wait(timeout=1.0)
                if self._closed:
                    return
                wanted = self._wanted
            memory = self._memory
            if memory is None or not self._pin_to(memory, wanted):
                with self._wake:
                    self._wanted = self._pinned_to  # pinning failed (logged once): nothing more is asked
                if self._pin_failed:
                    return

    def close(self) -> None:
        """Stop the pinning thread (idempotent); the mapping goes with the pool."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
            grower = self._grower
        if grower is not None and grower is not threading.current_thread():
            grower.join(timeout=5)

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
                if self._pin is None:
                    self._pin = _default_pin(self._pinned, self._device)
                log.info("host pool of %d bytes mapped (pinned as used: %s)", self._capacity, self._pin is not None)
            return self._allocator, self._memory

    def _pin_to(self, memory: memoryview, end: int) -> bool:
        """Pin the mapping up to `end` (rounded up to a segment); False, logged once, when that fails."""
        assert self._pin is not None
        with self._grow_lock:
            if end <= self._pinned_to:
                return True
            if self._pin_failed:
                return False
            target = min(self._capacity, -(-end // self._segment) * self._segment)
            try:
                self._pin(memory, self._pinned_to, target)
            except (OSError, RuntimeError) as exc:
                self._pin_failed = True
                log.error("host pool: pinning bytes %d..%d failed (%s); transfers beyond %d bytes of the pool get "
                          "buffers of their own", self._pinned_to, target, exc, self._pinned_to)
                return False
            log.info("host pool: %d bytes pinned", target)
            self._pinned_to = target
            return True

    def _allocate_memory(self) -> tuple[memoryview, object | None]:
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
        end = offset + size
        if self._pin is not None:
            if end > self._pinned_to:  # nothing is pinned here: the pinning thread is asked, the caller falls back
                allocator.release(offset)
                if not self._pin_failed:
                    self._want(end)
                return None
            if end + self._segment // 2 > self._pinned_to < self._capacity:
                self._want(end + self._segment // 2)  # ahead of demand
        return PoolBuffer(offset, size, memory[offset : end])

    def release(self, buffer: PoolBuffer) -> None:
        assert self._allocator is not None, "release before any allocate"
        self._allocator.release(buffer.offset)

    def stats(self) -> BuddyStats | None:
        return None if self._allocator is None else self._allocator.stats()
