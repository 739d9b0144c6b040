"""End-to-end KV integrity (`integrity_check`): the sender puts a 64-bit digest (xxHash's XXH3) of each frame's
payload in the frame, the receiver digests the bytes where they landed and drops the transfer on a mismatch, so a
decode never runs on KV that was damaged on the way (a flipped bit on the wire, a bug in a copy, or the sender's
blocks overwritten before the receiver read them); vLLM then recomputes the prompt."""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

from p2pkv.errors import TransferError

Hasher = xxhash.xxh3_64  # a running digest: `update(bytes)` as they land, then `intdigest()`


class DigestMismatch(TransferError):
    """The bytes that landed are not the bytes that were sent."""


def hasher() -> Hasher:
    return xxhash.xxh3_64()


def digest(views: Iterable[memoryview]) -> int:
    """The digest of the views' bytes, one after another (the same as of their concatenation)."""
    state = hasher()
    for view in views:
        state.update(view)
    return state.intdigest()


def check(expected: int, got: int, what: str) -> None:
    """Raise DigestMismatch, naming `what`, when the landed bytes' digest `got` is not the frame's `expected`."""
    if got != expected:
        raise DigestMismatch(f"{what}: the received bytes do not match the sender's digest "
                             f"({got:016x} != {expected:016x})")
