"""The receive store: where each chunk's bytes land, frames of several whole layers, and waiting for a verdict."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from p2pkv.config import ExtraConfig
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.metrics import EngineMetrics
from p2pkv.engine.store import ReceiveStore, StageState
from p2pkv.kv.device_copy import NoPinnedSpace
from p2pkv.kv.staging import HostBuffer
from p2pkv.memory import HostPool
from p2pkv.protocol import LayoutDigest, PushBlocks

LAYERS, BLOCKS, BLOCK = 4, 3, 64


def store() -> ReceiveStore:
    return ReceiveStore(1 << 20, 60, BLOCK, LAYERS, EngineMetrics())


def land(s: ReceiveStore, push: PushBlocks, fill: int) -> bool:
    """Write `fill` over the chunk's bytes; False when the store dropped it."""
    nbytes = push.layers * push.num_blocks * BLOCK
    view, _ = s.begin_chunk(push, nbytes, "src")
    if view is None:
        return False
    assert view.nbytes == nbytes
    view[:] = bytes([fill]) * nbytes
    s.end_chunk(push, True)
    return True


def test_a_frame_of_several_whole_layers_lands_layer_after_layer() -> None:
    s = store()
    assert land(s, PushBlocks("t", 0, 0, BLOCKS, BLOCKS, LAYERS, 3), 7)
    assert s.state("t") is StageState.RECEIVING
    assert land(s, PushBlocks("t", 3, 0, BLOCKS, BLOCKS, LAYERS, 1), 9)
    assert s.state("t") is StageState.COMPLETE
    item = s.take("t")
    assert item is not None
    assert [bytes(item.layer_view(layer)) for layer in range(LAYERS)] == (
        [bytes([7]) * BLOCKS * BLOCK] * 3 + [bytes([9]) * BLOCKS * BLOCK])
    s.release(item)
    assert s.bytes_in_use == 0


def test_frames_of_several_layers_must_carry_whole_layers_within_the_transfer() -> None:
    s = store()
    assert not land(s, PushBlocks("partial", 0, 1, 2, BLOCKS, LAYERS, 2), 1)
    assert s.state("partial") is StageState.FAILED
    assert not land(s, PushBlocks("past-end", 2, 0, BLOCKS, BLOCKS, LAYERS, 3), 1)
    assert s.state("past-end") is StageState.FAILED
    assert not land(s, PushBlocks("none", 0, 0, BLOCKS, BLOCKS, LAYERS, 0), 1)
    assert s.state("none") is StageState.FAILED


def test_overlapping_frames_fail_the_transfer_as_duplicates() -> None:
    s = store()
    assert land(s, PushBlocks("t", 0, 0, BLOCKS, BLOCKS, LAYERS, 2), 1)
    assert not land(s, PushBlocks("t", 1, 0, BLOCKS, BLOCKS, LAYERS, 2), 2)
    assert s.state("t") is StageState.FAILED and "duplicate" in s.reason("t")
    assert s.bytes_in_use == 0


def test_wait_returns_when_the_transfer_completes_or_at_its_deadline() -> None:
    s = store()
    started = time.monotonic()
    assert s.wait("unknown", time.monotonic() + 0.2) is None
    assert 0.15 < time.monotonic() - started < 2
    later = threading.Timer(0.2, land, (s, PushBlocks("t", 0, 0, BLOCKS, BLOCKS, LAYERS, LAYERS), 3))
    later.start()
    started = time.monotonic()
    assert s.wait("t", time.monotonic() + 10) is StageState.COMPLETE
    assert time.monotonic() - started < 5
    later.join()
    s.fail("gone", "sender aborted")
    assert s.wait("gone", time.monotonic() + 10) is StageState.FAILED


def test_expiry_counts_from_the_last_chunk_not_the_first() -> None:
    s = ReceiveStore(1 << 20, 1.0, BLOCK, LAYERS, EngineMetrics())
    assert land(s, PushBlocks("slow", 0, 0, BLOCKS, BLOCKS, LAYERS, 1), 1)
    for layer in range(1, LAYERS):  # a long prefill: one layer every 0.4 s, 1.2 s from the first to the last
        time.sleep(0.4)
        assert s.expire() == 0
        assert land(s, PushBlocks("slow", layer, 0, BLOCKS, BLOCKS, LAYERS, 1), layer + 1)
    assert s.state("slow") is StageState.COMPLETE
    time.sleep(0.4)
    assert s.expire() == 0  # completed 0.4 s ago: nobody has had the expiry's time to claim it yet
    s.refer("pulled", "pull it instead")  # a record with no bytes expires the same way
    time.sleep(1.1)
    assert s.expire() == 2
    assert s.state("slow") is None and s.state("pulled") is None
    assert s.bytes_in_use == 0


def test_a_cache_reset_drops_what_is_staged_and_arriving_but_not_what_a_load_took() -> None:
    """vLLM reset its caches (a weight update): KV staged before must not be loaded after. Complete and half-arrived
    transfers fail with the reset's reason and free their bytes; later chunks of a half-arrived one are dropped;
    one a load already took is the load's; a transfer that begins after the reset is staged as usual."""
    s = store()
    assert land(s, PushBlocks("done", 0, 0, BLOCKS, BLOCKS, LAYERS, LAYERS), 1)
    assert land(s, PushBlocks("half", 0, 0, BLOCKS, BLOCKS, LAYERS, 2), 2)
    assert land(s, PushBlocks("taken", 0, 0, BLOCKS, BLOCKS, LAYERS, LAYERS), 3)
    taken = s.take("taken")
    assert taken is not None
    s.fail("refused", "no staging space")
    assert s.drop_all("dropped by a cache reset") == 2
    assert s.state("done") is StageState.FAILED and s.reason("done") == "dropped by a cache reset"
    assert s.state("half") is StageState.FAILED
    assert s.reason("refused") == "no staging space"
    assert not land(s, PushBlocks("half", 2, 0, BLOCKS, BLOCKS, LAYERS, 2), 4)
    assert s.bytes_in_use == taken.nbytes
    assert s.wait("done", time.monotonic() + 10) is StageState.FAILED
    s.release(taken)
    assert s.bytes_in_use == 0
    assert land(s, PushBlocks("after", 0, 0, BLOCKS, BLOCKS, LAYERS, LAYERS), 5)
    assert s.state("after") is StageState.COMPLETE


def test_a_discarded_transfer_is_freed_as_it_settles_and_one_not_begun_is_taken_in_and_dropped() -> None:
    """No step needed: an idle decode instance frees a discarded push when its last chunk lands; a push that
    begins after the discard is accepted (its sender holds nothing for a pull) and its bytes dropped."""
    s = store()
    until = time.monotonic() + 30
    assert land(s, PushBlocks("arriving", 0, 0, BLOCKS, BLOCKS, LAYERS, 2), 1)
    assert s.bytes_in_use > 0
    s.discard("arriving", until)
    assert s.bytes_in_use > 0, "still receiving: its remaining chunks land where the first did"
    assert land(s, PushBlocks("arriving", 2, 0, BLOCKS, BLOCKS, LAYERS, 2), 2)
    assert s.state("arriving") is StageState.FAILED and s.bytes_in_use == 0

    assert land(s, PushBlocks("landed", 0, 0, BLOCKS, BLOCKS, LAYERS, LAYERS), 3)
    s.discard("landed", until)
    assert s.state("landed") is StageState.FAILED and s.bytes_in_use == 0

    s.discard("later", until)
    nbytes = LAYERS * BLOCKS * BLOCK
    view, ack = s.begin_chunk(PushBlocks("later", 0, 0, BLOCKS, BLOCKS, LAYERS, LAYERS), nbytes, "src")
    assert view is None and ack is not None and ack.accepted
    assert s.state("later") is StageState.FAILED and s.bytes_in_use == 0

    s.discard("expired", time.monotonic() - 1)
    s.expire()
    assert land(s, PushBlocks("expired", 0, 0, BLOCKS, BLOCKS, LAYERS, LAYERS), 4)
    assert s.state("expired") is StageState.COMPLETE, "a discard past its deadline is forgotten"


def test_a_discarded_push_stays_dropped_after_a_load_took_its_record() -> None:
    """The decode request of a one-token prompt, sent alongside its prefill, discards the push before it begins; its
    first chunk is dropped and the load takes the record of it; the rest of the push (its other layers, one frame)
    is dropped too, and holds nothing (it began a transfer held until expiry). The same for one that failed after
    the discard."""
    s = store()
    until = time.monotonic() + 30
    for tid in ("first-layer", "failed"):
        if tid == "failed":  # begun before the discard, then its connection broke: the sender may push again
            assert land(s, PushBlocks(tid, 0, 0, BLOCKS, BLOCKS, LAYERS), 1)
            s.discard(tid, until)
            s.fail_from_source("src", "connection to the sender was lost")
        else:
            s.discard(tid, until)
            assert not land(s, PushBlocks(tid, 0, 0, BLOCKS, BLOCKS, LAYERS), 1)
        assert s.state(tid) is StageState.FAILED
        taken = s.take(tid)
        assert taken is not None
        s.release(taken)
        assert not land(s, PushBlocks(tid, 1, 0, BLOCKS, BLOCKS, LAYERS, LAYERS - 1), 2)
        assert s.bytes_in_use == 0 and s.state(tid) is not StageState.RECEIVING


def test_a_sliding_window_layer_is_complete_without_the_blocks_it_skips_and_takes_room_for_those_sent_only() -> None:
    """Layer 1 sends only its last block (the blocks before are outside its window, not held by the sender), every
    chunk saying each layer's skip: the transfer is staged in room for the blocks sent, each layer's view holds its
    own, and it completes with them. Chunks that disagree on what is skipped fail the transfer; a chunk that skips
    without saying every layer's skip is invalid."""
    s = store()
    skips = (0, BLOCKS - 1, 0, 0)
    for layer in range(LAYERS):
        skip = skips[layer]
        push = PushBlocks("window", layer, skip, BLOCKS - skip, BLOCKS, LAYERS, skip=skip, skips=skips)
        assert land(s, push, layer + 1)
        if layer == 0:
            assert s.bytes_in_use == (LAYERS * BLOCKS - (BLOCKS - 1)) * BLOCK, "room for the blocks sent only"
    assert s.state("window") is StageState.COMPLETE
    item = s.take("window")
    assert item is not None
    for layer in range(LAYERS):
        assert bytes(item.layer_view(layer)) == bytes([layer + 1]) * (BLOCKS - skips[layer]) * BLOCK
    s.release(item)
    assert land(s, PushBlocks("disagree", 0, 1, 1, BLOCKS, LAYERS, skip=1, skips=(1, 0, 0, 0)), 1)
    assert not land(s, PushBlocks("disagree", 0, 2, 1, BLOCKS, LAYERS, skip=2, skips=(2, 0, 0, 0)), 1)
    assert s.state("disagree") is StageState.FAILED
    for bad in (PushBlocks("bad-0", 0, 0, BLOCKS, BLOCKS, LAYERS, skip=1, skips=(1, 0, 0, 0)),  # sends one it skips
                PushBlocks("bad-1", 0, 0, BLOCKS, BLOCKS, LAYERS, LAYERS, skip=1, skips=(1,) * LAYERS),  # whole layers
                PushBlocks("bad-2", 0, 1, BLOCKS - 1, BLOCKS, LAYERS, skip=1),  # skips without saying every layer's
                PushBlocks("bad-3", 0, 1, BLOCKS - 1, BLOCKS, LAYERS, skip=1, skips=(1, 0)),  # not every layer's
                PushBlocks("bad-4", 0, 1, BLOCKS - 1, BLOCKS, LAYERS, skip=1, skips=(2, 0, 0, 0))):  # not its own
        assert not land(s, bad, 1)
        assert s.state(bad.transfer_id) is StageState.FAILED


GIB = 1 << 30


def gpu_worker_engine() -> TransferEngine:
    """A GPU worker's engine with the default keys, its pool pinned as the worker pins it at registration (the pin
    itself recorded: there is no CUDA here). Llama-3-8B: 32 layers, blocks of 16 tokens of 8 KV heads of 128, bf16."""
    extra = ExtraConfig()
    pool = HostPool(int(extra.mem_pool_size_gb * GIB), pin=lambda memory, start, end: None)
    settings = replace(EngineSettings.from_config(extra, 0, 0), host="127.0.0.1", pinned_staging=True)
    engine = TransferEngine(settings, LayoutDigest(32, 16, 64 << 10, "bfloat16", (8, 16, 256), "cuda"), pool=pool)
    engine.pin_pool()
    return engine


def test_four_8k_token_llama_3_8b_requests_stage_at_the_defaults_on_both_sides() -> None:
    """Four 8,192-token Llama-3-8B requests (32 layers x 512 blocks of 64 KiB: 1 GiB each) pushed at once are all
    staged in pinned memory on the decode side, and all get pinned send buffers on the prefill side, without waiting
    for pinning (which may not happen on a transfer's path: a push that finds none is held for a pull)."""
    decode, prefill = gpu_worker_engine(), gpu_worker_engine()
    try:
        for request in range(4):
            push = PushBlocks(f"r{request}", 0, 0, 512, 512, 32, 32)
            view, ack = decode.store.begin_chunk(push, 32 * 512 * (64 << 10), "src")
            assert ack is not None and ack.accepted, f"request {request}: {ack}"
            assert view is not None and view.nbytes == GIB
        for request in range(4):
            try:
                HostBuffer(GIB, prefill.pool, pinned_only=True)  # the buffer its layers are copied into
            except NoPinnedSpace as exc:
                raise AssertionError(f"request {request}: {exc}") from None
    finally:
        decode.close()
        prefill.close()


def test_layers_arrive_once_all_their_blocks_have_and_a_wait_wakes_for_each() -> None:
    s = store()
    half = PushBlocks("t", 0, 0, 2, BLOCKS, LAYERS, 1)  # blocks 0..1 of layer 0: not the whole layer yet
    assert land(s, half, 1)
    assert s.arrived("t") == (StageState.RECEIVING, {})
    assert land(s, PushBlocks("t", 0, 2, 1, BLOCKS, LAYERS, 1), 2)
    state, arrived = s.arrived("t")
    assert state is StageState.RECEIVING and list(arrived) == [0]
    assert bytes(arrived[0]) == bytes([1]) * 2 * BLOCK + bytes([2]) * BLOCK
    later = threading.Timer(0.2, land, (s, PushBlocks("t", 1, 0, BLOCKS, BLOCKS, LAYERS, 2), 3))
    later.start()
    started = time.monotonic()
    s.wait_arrival("t", 1, time.monotonic() + 10)  # wakes as layers 1 and 2 arrive, not at the deadline
    assert time.monotonic() - started < 5
    later.join()
    assert list(s.arrived("t", known={0})[1]) == [1, 2]
    s.fail("t", "sender aborted")
    assert s.arrived("t") == (StageState.FAILED, {})


def test_bytes_being_written_or_landed_are_freed_only_when_let_go() -> None:
    """A chunk's payload is written outside the lock, and a load copies arrived layers out while the rest comes:
    the transfer failing or being dropped meanwhile frees its memory only once they let go (else the next transfer
    given that memory would be overwritten, or read from, by the old one)."""
    s = store()
    push = PushBlocks("w", 0, 0, BLOCKS, BLOCKS, LAYERS, 1)
    view, _ = s.begin_chunk(push, BLOCKS * BLOCK, "src")
    assert view is not None and s.bytes_in_use > 0
    s.drop_all("cache reset")  # on vLLM's thread, while the receiver writes
    assert s.bytes_in_use > 0, "freed under the writer"
    view[:] = bytes(BLOCKS * BLOCK)
    s.end_chunk(push, True)
    assert s.state("w") is StageState.FAILED and s.bytes_in_use == 0
    assert land(s, PushBlocks("h", 0, 0, BLOCKS, BLOCKS, LAYERS, 1), 4)
    held = s.hold("h")  # a load lands layer 0 while the rest comes
    assert held is not None
    s.fail("h", "connection to the sender was lost")
    assert s.bytes_in_use > 0, "freed under the load's copy"
    s.unhold(held)
    assert s.bytes_in_use == 0
    assert s.hold("h") is None  # failed: nothing to hold
