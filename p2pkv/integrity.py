"""End-to-end KV integrity (`integrity_check`): the sender puts a 64-bit digest (xxHash's XXH3) of each frame's
payload in the frame, the receiver digests the bytes where they landed and drops the transfer on a mismatch, so a
decode never runs on KV that was damaged on the way (a flipped bit on the wire, a bug in a copy, or the sender's
blocks overwritten before the receiver read them); vLLM then recomputes the prompt."""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

from p2pkv.errors import ProtocolError, TransferError
from p2pkv.protocol import PushBlocks

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


def frame_mismatch(push: PushBlocks, landed: int) -> DigestMismatch | None:
    """None when the payload that landed (digest `landed`) is the one `push` announced; else the mismatch. On a link
    that agreed digests, a frame without one is a protocol error."""
    if push.digest is None:
        raise ProtocolError(f"transfer {push.transfer_id}: a payload without a digest on a link that checks them")
    return mismatch(f"transfer {push.transfer_id} layers {push.layer}-{push.layer + push.layers}", push.digest,
                    landed)


def mismatch(what: str, sent: int, landed: int) -> DigestMismatch | None:
    """None when the digests agree; else the mismatch, naming `what` moved."""
    if landed == sent:
        return None
    return DigestMismatch(f"{what}: the received bytes do not match the sender's digest ({landed:016x} != "
                          f"{sent:016x})")
