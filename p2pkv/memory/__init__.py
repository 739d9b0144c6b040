"""Host memory for staging KV: a buddy allocator (pure integers) and the lazily allocated pool built on it."""

from p2pkv.memory.buddy import BuddyAllocator, BuddyStats
from p2pkv.memory.pool import HostPool, PoolBuffer

__all__ = ["BuddyAllocator", "BuddyStats", "HostPool", "PoolBuffer"]
