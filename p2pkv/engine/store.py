"""Staging for pushed KV on the receiving side, keyed by transfer id, bounded in bytes, with expiry."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from p2pkv.engine.metrics import EngineMetrics
from p2pkv.engine.occasional import Occasional
from p2pkv.memory import HostPool, PoolBuffer
from p2pkv.protocol import PushAck, PushBlocks
from p2pkv.way import WhyPull

log = logging.getLogger(__name__)
DISCARDED = "discarded: no request here loads it"
DUPLICATE = "duplicate transfer id"
_EMPTY = memoryview(b"")
_MIN_HEAP = 4096
_PROMPT_CHARS = 16  # a prompt's digest (`p2pkv.params.prompt_digest`)


class StageState(enum.Enum):
    RECEIVING = "receiving"
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass
class StagedTransfer:
    transfer_id: str
    num_layers: int
    total_blocks: int
    block_bytes: int
    source: str
    buffer: memoryview
    created: float
    blocks_received: int = 0
    state: StageState = StageState.RECEIVING
    reason: str = ""
    chunks: set[tuple[int, int]] = field(default_factory=set)
    pooled: PoolBuffer | None = None  # from the spill pool
    heaped: PoolBuffer | None = None  # from the first tier (kv_buffer_size)
    transport: str = "tcp"
    # The last chunk begun or finished, or when the transfer failed: what its expiry counts from.
    touched: float = field(default_factory=time.monotonic)
    layer_blocks: dict[int, int] = field(default_factory=dict)  # blocks received, per layer
    skips: dict[int, int] = field(default_factory=dict)  # layer -> blocks at its start not sent (`PushBlocks.skip`)
    arrived: dict[int, float] = field(default_factory=dict)  # layer -> when its last block was received
    # Who reads or writes the bytes besides their owner (the store, or the load that took it): the chunk being
    # written, a load landing the layers arrived. Let go by its owner while held, the memory goes when the last
    # holder lets go (`freeing`), never under a copy.
    holds: int = 0
    freeing: bool = False
    prompt: str = ""  # the digest of the prompt its sender said it was computed for ("": not said)
    # Where each layer's bytes begin in `buffer`, and where the last ends (empty: every layer holds every block)
    offsets: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def layer_view(self, layer: int) -> memoryview:
        """The blocks of `layer` received or to come: from its first block sent (`skips`) to its last."""
        if self.offsets:
            return self.buffer[self.offsets[layer] : self.offsets[layer + 1]]
        size = self.total_blocks * self.block_bytes
        return self.buffer[layer * size : (layer + 1) * size]


def _skips_agree(push: PushBlocks) -> bool:
    """A chunk's `skips` (if any) name a skip for every layer, within the transfer, its own layer's among them; a
    chunk that skips says them all."""
    if not push.skips:
        return push.skip == 0
    return (len(push.skips) == push.num_layers and all(0 <= s < push.total_blocks for s in push.skips)
            and all(push.skips[layer] == push.skip for layer in range(push.layer, push.layer + push.layers)))


def _offsets(push: PushBlocks, block_bytes: int) -> tuple[int, ...]:
    """Where each layer of the transfer begins in its staging buffer, and where the last ends, where layers skip
    blocks (`PushBlocks.skips`): only the blocks sent take room."""
    if not push.skips:
        return ()
    out = [0]
    for skip in push.skips:
        out.append(out[-1] + (push.total_blocks - skip) * block_bytes)
    return tuple(out)


class ReceiveStore:
    """Thread-safe map of transfer id to staged bytes. Payloads are written outside the lock.

    A transfer belongs to the connection (`source`) whose frame named it first: frames of another connection that
    name it are ignored and counted, and never change it (a peer cannot fail, refer or fill another's transfer)."""

    def __init__(self, budget_bytes: int, expiry_s: float, block_bytes: int, num_layers: int,
                 metrics: EngineMetrics, pool: HostPool | None = None, pinned: bool = False) -> None:
        """`pinned`: the first tier is page-locked (KV on a GPU: it is copied into the cache from there)."""
        self._pool = pool
        self._budget = budget_bytes
        # The first tier is one arena of kv_buffer_size too, mapped on first use: its pages are faulted in once
        # and reused, where a fresh buffer per transfer would be zeroed and faulted in every time.
        self._heap = HostPool(budget_bytes, pinned=None if pinned else False) if budget_bytes >= _MIN_HEAP else None
        if self._heap is not None and pinned:
            self._heap.prepare()  # at start-up: pinning is not for a transfer's path
        self._num_layers = num_layers
        self._expiry_s = expiry_s
        self._block_bytes = block_bytes
        self._metrics = metrics
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # a transfer completed or failed
        self._items: dict[str, StagedTransfer] = {}
        # Transfers no request here will load, until when: freed as they settle, without waiting for vLLM's next
        # step (an idle instance takes none); one not begun yet is taken in and dropped, so its sender holds nothing.
        self._discarded: dict[str, float] = {}
        self._writing: dict[str, StagedTransfer] = {}  # transfer id -> its item, while a chunk of it is written
        self._in_use = 0
        self._foreign = Occasional(log)

    def _foreign_locked(self, frame: str, item: StagedTransfer, source: str) -> None:
        self._metrics.of(self._metrics.foreign_frames, frame).inc()
        self._metrics.add("foreign_frames", 1)
        self._foreign.note(logging.WARNING, "ignored a %s frame from %s naming transfer %s, which %s began", frame,
                           source.partition("#")[0], item.transfer_id, item.source.partition("#")[0] or "this side")

    @property
    def bytes_in_use(self) -> int:
        with self._lock:
            return self._in_use

    def begin_chunk(self, push: PushBlocks, payload_len: int, source: str,
                    transport: str = "tcp") -> tuple[memoryview | None, PushAck | None]:
        """Where the payload of `push` goes (None: drop it), and the verdict to send on a transfer's first chunk.

        Staging takes ordinary memory up to `kv_buffer_size`, then spills into the host pool; with neither, the
        transfer is refused and the sender falls back to holding the blocks for a pull.
        """
        whole = push.first_block == 0 and push.num_blocks == push.total_blocks
        if not (push.num_layers == self._num_layers and 0 <= push.layer and push.layers >= 1
                and push.layer + push.layers <= push.num_layers and push.num_blocks > 0
                and 0 <= push.first_block and push.first_block + push.num_blocks <= push.total_blocks
                and (push.layers == 1 or whole) and payload_len == push.layers * push.num_blocks * self._block_bytes
                and 0 <= push.skip <= push.first_block and push.skip < push.total_blocks
                and len(push.prompt) <= _PROMPT_CHARS and _skips_agree(push)):
            self.fail(push.transfer_id, f"invalid chunk {push!r} with {payload_len} payload bytes", source=source,
                      frame="push")
            return None, None
        ack = None
        with self._lock:
            item = self._items.get(push.transfer_id)
            if item is None and push.transfer_id in self._discarded:
                # The discard stands until its deadline: a load may take this record before the push's last chunk,
                # which would otherwise begin a new transfer holding its bytes until expiry.
                item = self._new(push, source, _EMPTY)
                item.state, item.reason = StageState.FAILED, DISCARDED
                return None, PushAck(push.transfer_id, True, "")
            if item is None:
                item = self._admit(push, source)
                item.transport = transport
                accepted = item.state is StageState.RECEIVING
                ack = PushAck(push.transfer_id, accepted, "" if accepted else item.reason)
            elif item.source != source:
                self._foreign_locked("push", item, source)
                return None, PushAck(push.transfer_id, False, f"{DUPLICATE}: another connection pushed "
                                     f"{push.transfer_id}", duplicate=True)
            if item.state is StageState.COMPLETE and ack is None:  # every block is here: a new transfer, same id
                return None, PushAck(push.transfer_id, False, f"{DUPLICATE}: {push.transfer_id} was received already",
                                     duplicate=True)
            if item.state is not StageState.RECEIVING:
                return None, ack
            item.touched = time.monotonic()
            if ((item.num_layers, item.total_blocks) != (push.num_layers, push.total_blocks)
                    or item.offsets != _offsets(push, self._block_bytes)):
                self._fail_locked(item, "chunk disagrees with the transfer's shape")
                return None, ack
            keys = {(layer, push.first_block) for layer in range(push.layer, push.layer + push.layers)}
            if keys & item.chunks:
                self._fail_locked(item, f"duplicate chunk {min(keys & item.chunks)}")
                return None, ack
            if item.skips.setdefault(push.layer, push.skip) != push.skip:
                self._fail_locked(item, f"chunks of layer {push.layer} disagree on the blocks skipped")
                return None, ack
            item.chunks |= keys
            item.holds += 1  # until `end_chunk`: the payload is written outside the lock
            self._writing[push.transfer_id] = item
            if push.layers > 1:  # whole layers, which lie back to back in the staging buffer
                first, last = item.layer_view(push.layer), item.layer_view(push.layer + push.layers - 1)
                start = item.offsets[push.layer] if item.offsets else push.layer * first.nbytes
                return item.buffer[start : start + first.nbytes * (push.layers - 1) + last.nbytes], ack
            start = (push.first_block - push.skip) * self._block_bytes
            return item.layer_view(push.layer)[start : start + payload_len], ack

    def _admit(self, push: PushBlocks, source: str) -> StagedTransfer:
        offsets = _offsets(push, self._block_bytes)
        size = offsets[-1] if offsets else push.num_layers * push.total_blocks * self._block_bytes
        heaped = self._heap.allocate(size) if self._heap is not None and self._in_use + size <= self._budget else None
        if heaped is not None:
            self._in_use += size
            self._metrics.staging_bytes.set(self._in_use)
            item = self._new(push, source, heaped.view)
            item.heaped = heaped
            return item
        pooled = self._pool.allocate(size) if self._pool is not None else None
        if pooled is not None:
            item = self._new(push, source, pooled.view)
            item.pooled = pooled
            self._metrics.add("pool_spills", 1)
            self._metrics.pool_bytes.inc(pooled.size)
            return item
        log.warning("transfer %s refused: %d bytes do not fit; the sender keeps them for a pull",
                    push.transfer_id, size)
        self._metrics.add("refused", 1)
        item = self._new(push, source, _EMPTY)
        item.state, item.reason = StageState.FAILED, WhyPull.NO_SPACE.value
        return item

    def _new(self, push: PushBlocks, source: str, buffer: memoryview) -> StagedTransfer:
        item = StagedTransfer(push.transfer_id, push.num_layers, push.total_blocks, self._block_bytes, source,
                              buffer, time.monotonic(), prompt=push.prompt, offsets=_offsets(push, self._block_bytes))
        if push.skips:
            item.skips = {layer: skip for layer, skip in enumerate(push.skips) if skip}
        self._items[push.transfer_id] = item
        return item

    def end_chunk(self, push: PushBlocks, landed: bool) -> None:
        """The payload of `push`, whose place `begin_chunk` gave, is written (`landed`: whole and checked): its
        layers, once all their blocks are, may be landed. Called whether or not it landed, so that its memory may
        go."""
        transfer_id = push.transfer_id
        with self._lock:
            item = self._writing.pop(transfer_id, None)
            if item is None:
                return
            item.holds -= 1
            if landed and item.state is StageState.RECEIVING and self._items.get(transfer_id) is item:
                self._count_locked(item, push)
            if not item.holds and item.freeing:
                self._free_locked(item)

    def _count_locked(self, item: StagedTransfer, push: PushBlocks) -> None:
        now = time.monotonic()
        item.blocks_received += push.num_blocks * push.layers
        item.touched = now
        for layer in range(push.layer, push.layer + push.layers):
            item.layer_blocks[layer] = item.layer_blocks.get(layer, 0) + push.num_blocks
            if item.layer_blocks[layer] == item.total_blocks - item.skips.get(layer, 0):
                item.arrived[layer] = now
        if len(item.arrived) == item.num_layers:
            item.state = StageState.COMPLETE
            if item.transfer_id in self._discarded:
                self._drop_locked(item)
        self._settled.notify_all()  # a transfer settled, or more of its layers arrived

    def hold(self, transfer_id: str) -> StagedTransfer | None:
        """A load lands this transfer's layers as they arrive: their bytes stay until `unhold`, whatever becomes of
        the transfer meanwhile (it fails, is taken). None where it is not here or failed."""
        with self._lock:
            item = self._items.get(transfer_id)
            if item is None or item.state is StageState.FAILED:
                return None
            item.holds += 1
            return item

    def unhold(self, item: StagedTransfer) -> None:
        with self._lock:
            item.holds -= 1
            if not item.holds and item.freeing:
                self._free_locked(item)

    def discard(self, transfer_id: str, until: float) -> None:
        """No request here loads this transfer: its bytes are freed now if it has settled, else as soon as it does
        (a failure frees them anyway); chunks of it that begin before `until` are taken in and dropped."""
        with self._lock:
            item = self._items.get(transfer_id)
            if item is not None and item.state is StageState.COMPLETE:
                self._drop_locked(item)
            elif item is None or item.state is StageState.RECEIVING:
                self._discarded[transfer_id] = until

    def _drop_locked(self, item: StagedTransfer) -> None:
        item.state, item.reason, item.touched = StageState.FAILED, DISCARDED, time.monotonic()
        self._release_locked(item)
        self._discarded.pop(item.transfer_id, None)

    def fail(self, transfer_id: str, reason: str, create: bool = True, source: str = "",
             frame: str | None = "abort", prompt: str = "") -> None:
        """Fail a transfer; with `create`, record the failure even for an unknown id so its load fails fast. With
        `source` (a connection's `frame` asks), a transfer another connection began is left alone (and counted,
        unless `frame` is None: several connections may name it). `prompt`: what the sender said of its prompt,
        for a transfer recorded here."""
        with self._lock:
            item = self._items.get(transfer_id)
            if item is None and not create:
                return
            if item is None:
                item = StagedTransfer(transfer_id, 0, 0, self._block_bytes, source, _EMPTY, time.monotonic(),
                                      prompt=prompt if len(prompt) <= _PROMPT_CHARS else "")
                self._items[transfer_id] = item
            elif source and item.source != source:
                if frame is not None:
                    self._foreign_locked(frame, item, source)
                return
            self._fail_locked(item, reason)

    def refer(self, transfer_id: str, reason: str, source: str = "", prompt: str = "") -> None:
        """The sender holds this transfer's blocks for a pull instead of pushing them (`reason`): record that, so
        the load pulls at once. Expected, not an error: no warning. A transfer another connection than `source`
        began is left alone. `prompt`: the digest of the prompt its KV was computed for, as the sender said."""
        prompt = prompt if len(prompt) <= _PROMPT_CHARS else ""
        with self._lock:
            item = self._items.get(transfer_id)
            if item is not None and source and item.source != source:
                self._foreign_locked("pull_instead", item, source)
                return
            if item is not None:
                self._fail_locked(item, reason)
                return
            item = StagedTransfer(transfer_id, 0, 0, self._block_bytes, source, _EMPTY, time.monotonic(),
                                  prompt=prompt)
            item.state, item.reason = StageState.FAILED, reason
            self._items[transfer_id] = item
            self._settled.notify_all()

    def drop_all(self, reason: str) -> int:
        """Fail every transfer staged or arriving now, freeing its bytes (a load of it fails, and its request
        computes the prompt itself; chunks still to come are dropped); returns how many. Transfers taken by a load
        are not here any more, and are not touched."""
        with self._lock:
            live = [item for item in self._items.values() if item.state is not StageState.FAILED]
            for item in live:
                item.state, item.reason, item.touched = StageState.FAILED, reason, time.monotonic()
                self._release_locked(item)
            self._settled.notify_all()
        return len(live)

    def fail_from_source(self, source: str, reason: str) -> None:
        """A connection broke: every transfer it had not finished is failed."""
        with self._lock:
            for item in self._items.values():
                if item.source == source and item.state is StageState.RECEIVING:
                    self._fail_locked(item, reason)

    def _fail_locked(self, item: StagedTransfer, reason: str) -> None:
        if item.state is StageState.FAILED:
            return
        log.warning("transfer %s failed while receiving: %s", item.transfer_id, reason)
        item.state, item.reason, item.touched = StageState.FAILED, reason, time.monotonic()
        self._release_locked(item)
        self._settled.notify_all()

    def _release_locked(self, item: StagedTransfer) -> None:
        """The owner lets the bytes go: now, or once the last holder lets go."""
        if item.holds:
            item.freeing = True
            return
        self._free_locked(item)

    def _free_locked(self, item: StagedTransfer) -> None:
        item.freeing = False
        if item.pooled is not None:
            assert self._pool is not None
            self._pool.release(item.pooled)
            self._metrics.pool_bytes.dec(item.pooled.size)
            item.pooled = None
        elif item.heaped is not None:
            assert self._heap is not None
            self._heap.release(item.heaped)
            self._in_use -= item.heaped.size
            item.heaped = None
        item.buffer = _EMPTY
        self._metrics.staging_bytes.set(self._in_use)

    @property
    def pool_bytes_in_use(self) -> int:
        stats = self._pool.stats() if self._pool is not None else None
        return 0 if stats is None else stats.bytes_in_use

    def state(self, transfer_id: str) -> StageState | None:
        with self._lock:
            item = self._items.get(transfer_id)
            return None if item is None else item.state

    def arrived(self, transfer_id: str, known: AbstractSet[int] = frozenset()
                ) -> tuple[StageState | None, dict[int, memoryview]]:
        """A transfer's state, and the layers of it received whole so far but for `known`, each layer's bytes (a
        load lands them while the rest is on the way). The bytes stay the transfer's until it is taken or fails."""
        with self._lock:
            item = self._items.get(transfer_id)
            if item is None:
                return None, {}
            if item.state is StageState.FAILED:
                return item.state, {}
            return item.state, {layer: item.layer_view(layer) for layer in sorted(item.arrived) if layer not in known}

    def wait_arrival(self, transfer_id: str, known: int, deadline: float) -> None:
        """Until more than `known` layers of the transfer have arrived, or it has settled, or the deadline."""
        def news() -> bool:
            item = self._items.get(transfer_id)
            return item is not None and (item.state is not StageState.RECEIVING or len(item.arrived) > known)

        with self._settled:
            self._settled.wait_for(news, max(0.0, deadline - time.monotonic()))

    def wait(self, transfer_id: str, deadline: float) -> StageState | None:
        """The transfer's state once it is complete or failed, or whatever it is at the deadline."""
        def settled() -> bool:
            item = self._items.get(transfer_id)
            return item is not None and item.state is not StageState.RECEIVING

        with self._settled:
            self._settled.wait_for(settled, max(0.0, deadline - time.monotonic()))
            item = self._items.get(transfer_id)
            return None if item is None else item.state

    def prompt(self, transfer_id: str) -> str | None:
        with self._lock:
            item = self._items.get(transfer_id)
            return None if item is None else item.prompt

    def reason(self, transfer_id: str) -> str:
        with self._lock:
            item = self._items.get(transfer_id)
            return "" if item is None else item.reason

    def peek(self, transfer_id: str) -> StagedTransfer | None:
        """A transfer, left in place (what it says, such as when each layer arrived; its bytes are the taker's)."""
        with self._lock:
            return self._items.get(transfer_id)

    def take(self, transfer_id: str) -> StagedTransfer | None:
        """Remove and return a transfer; the caller frees its bytes with `release` once it has copied them."""
        with self._lock:
            return self._items.pop(transfer_id, None)

    def close(self) -> None:
        if self._heap is not None:
            self._heap.close()

    def release(self, item: StagedTransfer) -> None:
        with self._lock:
            self._release_locked(item)

    def touch(self, transfer_ids: tuple[str, ...]) -> None:
        """These transfers' requests still wait for blocks: their expiry counts from now (whatever their state: a
        refusal tells the load to pull instead)."""
        now = time.monotonic()
        with self._lock:
            for tid in transfer_ids:
                item = self._items.get(tid)
                if item is not None:
                    item.touched = now

    def expire(self) -> int:
        """Drop staging nobody claimed within the expiry; returns how many were dropped. The expiry counts from a
        transfer's last chunk (or from when it completed or failed), not from its first: a long prefill pushing
        layer by layer, or a slow link, keeps its staging for as long as chunks keep coming."""
        now = time.monotonic()
        with self._lock:
            stale = [t for t, item in self._items.items() if now - item.touched > self._expiry_s]
            for tid in [t for t, until in self._discarded.items() if now > until]:
                del self._discarded[tid]
            for tid in stale:
                item = self._items.pop(tid)
                if item.state is not StageState.FAILED:
                    self._release_locked(item)
        if stale:
            log.warning("dropped %d staged transfers nobody claimed within %.0f s", len(stale), self._expiry_s)
        return len(stale)
