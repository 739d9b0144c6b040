"""Which instance holds which prompt blocks, from the KV cache events their vLLM publishes.

vLLM names a cached block by a hash of its tokens and its parent's hash, seeded per instance, so the proxy cannot
compute it. Each `BlockStored` event carries the blocks' tokens, though: the index keys every block by its own
chain key (the parent's key and the block's tokens), remembers which vLLM hash stands for which key, and so can
look up a prompt's blocks from its tokens alone. Blocks whose KV depends on more than their tokens (LoRA adapters,
images, cache salts) are left out: a prompt never matches them. Lost or late events only cost hits: a request sent
where its prefix is not held is computed there, never answered wrongly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

log = logging.getLogger(__name__)
MAX_BLOCKS = 1 << 20  # blocks indexed per instance; an instance past it starts again from empty
MAX_EXPECTED = 1 << 16  # blocks expected per instance (routed there, its events not in yet)
EXPECTED_S = 30.0  # a prompt routed to an instance counts as held there this long, until its events say so
MAX_BLOCK_SIZE = 1 << 16
ROOT = 0  # the chain key of no block: the parent of a prompt's first block


def chain_keys(tokens: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """The chain key of each full block of `tokens` (after the block keyed `parent`)."""
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start:start + block_size])))
        keys.append(parent)
    return keys


_MISSING = object()


@dataclass
class InstanceBlocks:
    """One instance's cached blocks, as its events said them."""

    block_size: int = 0  # 0: no event said it yet; events of another size are not taken
    # (medium, vLLM's hash) -> chain key (None: not token-only, or its parent unknown): one entry per copy
    ours: dict[tuple[Any, Any], int | None] = field(default_factory=dict)
    chain: dict[Any, int | None] = field(default_factory=dict)  # vLLM's hash -> chain key, for later blocks' parents
    media: set[Any] = field(default_factory=set)  # the media its events named (GPU, CPU, ...)
    held: dict[int, int] = field(default_factory=dict)  # chain key -> copies holding it
    expected: dict[int, float] = field(default_factory=dict)  # chain key -> monotonic expiry
    roots: set[int] = field(default_factory=set)  # held chain keys of first blocks: one per prompt prefix held
    expected_roots: dict[int, float] = field(default_factory=dict)  # first blocks expected, with their expiry
    events: int = 0
    last_seq: int = -1
    gaps: int = 0  # batches lost (sequence numbers skipped)

    def clear(self) -> None:
        self.ours.clear()
        self.chain.clear()
        self.held.clear()
        self.expected.clear()
        self.roots.clear()
        self.expected_roots.clear()

    def _hold(self, key: int, root: bool) -> None:
        self.held[key] = self.held.get(key, 0) + 1
        self.expected.pop(key, None)
        if root:
            self.roots.add(key)
            self.expected_roots.pop(key, None)

    def _release(self, key: int) -> None:
        left = self.held.get(key, 0) - 1
        if left > 0:
            self.held[key] = left
        else:
            self.held.pop(key, None)
            self.roots.discard(key)

    def stored(self, hashes: list[Any], parent_hash: Any, tokens: list[int], block_size: int,
               plain: list[bool], medium: Any) -> None:
        if self.block_size and block_size != self.block_size:
            return  # another group's blocks, or a partial-block unit: not the prefixes this index matches
        self.block_size = block_size
        parent: int | None = ROOT if parent_hash is None else self.chain.get(parent_hash)
        if len(self.ours) + len(hashes) > MAX_BLOCKS:
            log.warning("the prefix index of one instance passed %d blocks; it starts again from empty", MAX_BLOCKS)
            self.clear()
            parent = ROOT if parent_hash is None else None
        self.media.add(medium)
        for i, block_hash in enumerate(hashes):
            key = None
            if parent is not None and plain[i]:
                key = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size])))
            slot = (medium, block_hash)
            old = self.ours.get(slot, _MISSING)
            if old != key:  # new, or said again with more known (its parent now placed): counted once per copy
                if isinstance(old, int):
                    self._release(old)
                if key is not None:
                    self._hold(key, i == 0 and parent_hash is None)
                self.ours[slot] = key
            if key is not None or block_hash not in self.chain:
                self.chain[block_hash] = key
            parent = key  # None: its children cannot be placed either

    def removed(self, hashes: list[Any], medium: Any) -> None:
        for block_hash in hashes:
            key = self.ours.pop((medium, block_hash), None)
            if key is not None:
                self._release(key)
            if not any((m, block_hash) in self.ours for m in self.media):
                self.chain.pop(block_hash, None)

    def unexpect(self, keys: Iterable[int]) -> None:
        for key in keys:
            self.expected.pop(key, None)
            self.expected_roots.pop(key, None)

    def expect(self, keys: Iterable[int], now: float) -> None:
        if len(self.expected) > MAX_EXPECTED:
            self.expected = {k: t for k, t in self.expected.items() if t > now}
            self.expected_roots = {k: t for k, t in self.expected_roots.items() if t > now}
            if len(self.expected) > MAX_EXPECTED:
                self.expected.clear()
                self.expected_roots.clear()
        for i, key in enumerate(keys):
            if key not in self.held:
                self.expected[key] = now + EXPECTED_S
                if i == 0:
                    self.expected_roots[key] = now + EXPECTED_S

    def prefix_blocks(self, keys: Sequence[int], now: float) -> int:
        """How many of `keys` from the first it holds (or is expected to), in a row."""
        n = 0
        for key in keys:
            if key in self.held or self.expected.get(key, 0.0) > now:
                n += 1
            else:
                break
        return n

    @property
    def size(self) -> int:
        return len(self.held)

    def prefixes(self, now: float) -> int:
        """How many different prompt prefixes it holds (or is expected to): a measure of its cache's load."""
        return len(self.roots) + sum(1 for k, t in self.expected_roots.items() if t > now and k not in self.roots)


def _hashes(value: Any) -> list[Any]:
    if not isinstance(value, list) or not all(isinstance(h, (bytes, int)) and not isinstance(h, bool)
                                              for h in value):
        raise ValueError("block_hashes: expected a list of bytes or integers")
    return value


class PrefixIndex:
    """Every instance's blocks (by instance name), fed by `apply` with each event batch as it arrives."""

    def __init__(self) -> None:
        self.instances: dict[str, InstanceBlocks] = {}
        self.last_error = ""  # why the latest event skipped was skipped

    def of(self, name: str) -> InstanceBlocks:
        blocks = self.instances.get(name)
        if blocks is None:
            blocks = self.instances[name] = InstanceBlocks()
        return blocks

    def forget(self, name: str) -> None:
        self.instances.pop(name, None)

    def apply(self, name: str, seq: int, payload: bytes) -> tuple[int, int]:
        """One published batch (vLLM's `KVEventBatch`, msgpack) from instance `name`: the events it applied and those
        it skipped (malformed). ValueError for a batch that is not one."""
        try:
            batch = msgspec.msgpack.decode(payload)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise ValueError(f"not msgpack: {exc!r:.200}") from None
        if not (isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list)):
            raise ValueError("expected an event batch [ts, events, ...]")
        blocks = self.of(name)
        if blocks.last_seq >= 0 and seq <= blocks.last_seq:
            # Its publisher started again (the instance restarted under the same name): what it said before is gone.
            blocks.clear()
        elif blocks.last_seq >= 0 and seq > blocks.last_seq + 1:
            blocks.gaps += seq - blocks.last_seq - 1
        blocks.last_seq = seq
        applied = skipped = 0
        for event in batch[1]:
            try:
                self._event(blocks, event)
            except (ValueError, TypeError) as exc:
                skipped += 1
                self.last_error = f"{exc!r:.200}"
            else:
                applied += 1
        blocks.events += applied
        return applied, skipped

    @staticmethod
    def _event(blocks: InstanceBlocks, event: Any) -> None:
        if not isinstance(event, dict):
            raise ValueError("an event is not a map")
        kind = event.get("type")
        if event.get("group_idx") not in (None, 0):
            return  # another KV cache group (hybrid models): its blocks are not a prompt's prefix
        medium = event.get("medium")
        if not (medium is None or isinstance(medium, str)):
            raise ValueError("medium: expected a string")
        if kind == "AllBlocksCleared":
            blocks.clear()
        elif kind == "BlockRemoved":
            blocks.removed(_hashes(event.get("block_hashes")), medium)
        elif kind == "BlockStored":
            hashes = _hashes(event.get("block_hashes"))
            tokens, size = event.get("token_ids"), event.get("block_size")
            if not (isinstance(size, int) and 0 < size <= MAX_BLOCK_SIZE):
                raise ValueError(f"block_size {size!r:.40}")
            if not (isinstance(tokens, list) and len(tokens) == len(hashes) * size
                    and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
                raise ValueError("token_ids: expected block_size integers per block")
            parent = event.get("parent_block_hash")
            if not (parent is None or (isinstance(parent, (bytes, int)) and not isinstance(parent, bool))):
                raise ValueError("parent_block_hash: expected bytes, an integer or nothing")
            extra = event.get("extra_keys")
            if extra is None:
                extra = [None] * len(hashes)
            elif not (isinstance(extra, list) and len(extra) == len(hashes)):
                extra = [True] * len(hashes)  # not said block by block: none is taken as tokens alone
            token_only = event.get("lora_id") is None and event.get("lora_name") is None
            blocks.stored(hashes, parent, tokens, size, [token_only and not e for e in extra], medium)
        else:
            raise ValueError(f"unknown event type {kind!r:.40}")

    def hits(self, names: Iterable[str], tokens: Sequence[int]) -> dict[str, int]:
        """For each instance named, the prompt tokens from the first that it holds (by events, or expected)."""
        now = time.monotonic()
        keys: dict[int, list[int]] = {}
        out = {}
        for name in names:
            blocks = self.instances.get(name)
            if blocks is None or not blocks.block_size:
                out[name] = 0
                continue
            size = blocks.block_size
            if size not in keys:
                keys[size] = chain_keys(tokens, size)
            out[name] = blocks.prefix_blocks(keys[size], now) * size
        return out

    def expect(self, name: str, tokens: Sequence[int]) -> None:
        """`tokens` were just routed to `name`: count its blocks there until its events say (or `EXPECTED_S`)."""
        blocks = self.instances.get(name)
        if blocks is not None and blocks.block_size:
            blocks.expect(chain_keys(tokens, blocks.block_size), time.monotonic())

    def prefixes(self, name: str) -> int:
        """How many different prompt prefixes instance `name` holds, as far as the index knows."""
        blocks = self.instances.get(name)
        return 0 if blocks is None else blocks.prefixes(time.monotonic())

    def unexpect(self, name: str, tokens: Sequence[int]) -> None:
        """`tokens` routed to `name` were not prefilled there after all (the prefill failed): no longer expected."""
        blocks = self.instances.get(name)
        if blocks is not None and blocks.block_size:
            blocks.unexpect(chain_keys(tokens, blocks.block_size))

    def knows(self, names: Iterable[str]) -> bool:
        """Whether any of the instances named has said its blocks (events arrived)."""
        return any((b := self.instances.get(n)) is not None and b.block_size for n in names)
