"""KV reached through host buffers (the GPU path), run on CPU tensors: the same copies, buffers and engine hooks
a CUDA cache uses, with `copy_` synchronous instead of queued on a copy stream."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from p2pkv.config import ExtraConfig, Transport
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.puller import PullState
from p2pkv.engine.sender import OutState
from p2pkv.engine.store import StageState
from p2pkv.kv.buffers import TransferBuffers
from p2pkv.kv.device_copy import NoPinnedSpace, PinnedRing, as_rows, done, word_bytes
from p2pkv.kv.layout import KvBlocks
from p2pkv.kv.staging import DeviceKv, HostBuffer
from p2pkv.memory import HostPool
from p2pkv.params import Address
from tests.helpers.unit import PHYSICAL_ORDERS, SIZES, caches

BLOCK_BYTES = SIZES["H"] * SIZES["N"] * SIZES["C"] * 2  # bfloat16


def host_kv(order: str, fill: bool) -> DeviceKv:
    return DeviceKv(caches(order, fill), 16, "test", copy_timeout_s=5)


@pytest.mark.parametrize("order", PHYSICAL_ORDERS)
def test_staged_bytes_equal_the_blocks_and_land_back(order: str) -> None:
    src_layers = caches(order, True)
    src, reference = DeviceKv(src_layers, 16, "test", 5), KvBlocks.from_tensors(src_layers, 16, "test")
    assert src.digest == reference.digest
    moves = {3: 1, 4: 2, 9: 7, 10: 8}
    buffers = TransferBuffers(src)
    for layer in range(SIZES["L"]):
        (staged,), ready = buffers.push_views("t", layer, list(moves))
        assert ready(time.monotonic() + 1)
        assert bytes(staged) == b"".join(bytes(v) for v in reference.block_views(layer, list(moves)))
    dst_layers = caches(order, False)
    dst = DeviceKv(dst_layers, 16, "test", 5)
    for layer in range(SIZES["L"]):
        dst.write_blocks(layer, list(moves.values()), buffers.source("t", list(moves))(layer, 0, len(moves))[0])
        for s, d in moves.items():
            assert torch.equal(dst_layers[layer][d], src_layers[layer][s])
        untouched = [b for b in range(SIZES["B"]) if b not in moves.values()]
        assert not dst_layers[layer][untouched].any()
    buffers.release("t")
    assert len(buffers) == 0


def test_pull_sink_lands_on_land_and_frees_its_buffer() -> None:
    src_layers, dst_layers = caches("LBNHC", True), caches("LBNHC", False)
    source = TransferBuffers(DeviceKv(src_layers, 16, "test", 5)).source("t", [5, 6, 2])
    dst = TransferBuffers(DeviceKv(dst_layers, 16, "test", 5))
    sink = dst.sink("t", [0, 1, 11])
    for layer in range(SIZES["L"]):
        for first in range(3):  # block by block, as a pull in several frames would
            sink(layer, first, 1)[0][:] = source(layer, first, 1)[0]
        assert not dst_layers[layer].any(), "nothing reaches the blocks before land()"
    assert dst.land("t")()  # on the host the copies are done when issued
    dst.release("t")
    assert len(dst) == 0
    for layer in range(SIZES["L"]):
        for s, d in ((5, 0), (6, 1), (2, 11)):
            assert torch.equal(dst_layers[layer][d], src_layers[layer][s])


def test_buffers_come_from_the_pool_and_go_back() -> None:
    pool = HostPool(1 << 20, pinned=False)
    kv = host_kv("LBHNC", True)
    kv.pool = pool
    buffers = TransferBuffers(kv)
    buffers.push_views("a", 0, [1, 2, 3])
    stats = pool.stats()
    assert stats is not None and stats.bytes_requested == SIZES["L"] * 3 * BLOCK_BYTES
    buffers.release("a")
    buffers.release("a")  # idempotent
    stats = pool.stats()
    assert stats is not None and stats.bytes_in_use == 0
    full = HostBuffer(2 << 20, pool)  # larger than the pool: its own memory, same interface
    assert not full.from_pool and len(full.view) == 2 << 20
    full.release()
    with pytest.raises(NoPinnedSpace):  # on the forward's path: no memory of its own, the caller holds the blocks
        HostBuffer(2 << 20, pool, pinned_only=True)


def test_a_groups_buffer_holds_its_layers_only() -> None:
    """A KV cache group's layers, pushed under their own key: the host buffer holds those layers, each at its slot,
    not room for every layer."""
    pool = HostPool(1 << 20, pinned=False)
    layers = caches("LBHNC", True)
    kv, reference = DeviceKv(layers, 16, "test", 5), KvBlocks.from_tensors(layers, 16, "test")
    kv.pool = pool
    buffers = TransferBuffers(kv)
    held = (0, SIZES["L"] - 1)
    for layer in held:
        (staged,), ready = buffers.push_views("g#1", layer, [4, 5], layers=held)
        assert ready(time.monotonic() + 1)
        assert bytes(staged) == b"".join(bytes(v) for v in reference.block_views(layer, [4, 5]))
    stats = pool.stats()
    assert stats is not None and stats.bytes_requested == len(held) * 2 * BLOCK_BYTES
    buffers.release("g#1")
    stats = pool.stats()
    assert stats is not None and stats.bytes_in_use == 0


def test_write_blocks_checks_the_size() -> None:
    kv = host_kv("LBHNC", False)
    with pytest.raises(ValueError, match="bytes for 2 blocks"):
        kv.write_blocks(0, [1, 2], memoryview(bytes(BLOCK_BYTES)))


@pytest.fixture(params=["tcp", "shm"])
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    digest = host_kv("LBHNC", False).digest
    made = []
    for _ in range(2):
        extra = ExtraConfig(kv_host="127.0.0.1", transfer_timeout_s=5, transport=Transport(request.param))
        engine = TransferEngine(EngineSettings.from_config(extra, 0, 0), digest)
        engine.start()
        made.append(engine)
    yield made[0], made[1]
    for engine in made:
        engine.close()


def test_staged_push_through_two_engines(engines: tuple[TransferEngine, TransferEngine]) -> None:
    sender, receiver = engines
    src_layers, dst_layers = caches("LBHNC", True), caches("LBHNC", False)
    buffers = TransferBuffers(DeviceKv(src_layers, 16, "test", 5))
    buffers.kv.metrics = sender.metrics
    dst = DeviceKv(dst_layers, 16, "test", 5)
    dst.metrics = receiver.metrics
    blocks, placed = [7, 8, 9, 0], [1, 2, 3, 4]
    deadline = time.monotonic() + 10
    for layer in range(SIZES["L"]):
        views_, ready = buffers.push_views("p", layer, blocks)
        sender.push_layer("p", Address.parse(receiver.address), layer, len(blocks), views_, deadline, ready)
    out = sender.wait_outgoing("p", 10)
    assert out is not None and out.state is OutState.DONE, out
    assert receiver.wait_staged("p", 10) is StageState.COMPLETE
    item = receiver.take_staged("p")
    assert item is not None
    for layer in range(SIZES["L"]):
        dst.write_blocks(layer, placed, item.layer_view(layer))
        for s, d in zip(blocks, placed, strict=True):
            assert torch.equal(dst_layers[layer][d], src_layers[layer][s])
    receiver.release_staged(item)
    buffers.release("p")
    moved = SIZES["L"] * len(blocks) * BLOCK_BYTES
    for engine, direction in ((sender, "to_host"), (receiver, "to_device")):
        sample = engine.metrics.registry.get_sample_value("p2pkv_device_copy_bytes_total", {"direction": direction})
        assert sample == moved


def test_a_copy_that_misses_its_deadline_fails_the_transfer(engines: tuple[TransferEngine, TransferEngine]) -> None:
    sender, receiver = engines
    buffers = TransferBuffers(DeviceKv(caches("LBHNC", True), 16, "test", 5))
    peer = Address.parse(receiver.address)
    deadline = time.monotonic() + 10
    views_, ready = buffers.push_views("late", 0, [1])
    sender.push_layer("late", peer, 0, 1, views_, deadline, ready)
    while receiver.staged_state("late") is None:  # layer 0 has arrived
        assert time.monotonic() < deadline
        time.sleep(0.005)
    views_, _ = buffers.push_views("late", 1, [1])
    sender.push_layer("late", peer, 1, 1, views_, deadline, lambda _deadline: False)
    out = sender.wait_outgoing("late", 10)
    assert out is not None and out.state is OutState.FAILED
    assert "layer 1" in out.reason and "deadline" in out.reason
    assert receiver.wait_staged("late", 10) is StageState.FAILED  # the receiver is told, its staging freed
    assert receiver.store.bytes_in_use == 0


def test_staged_pull_through_two_engines(engines: tuple[TransferEngine, TransferEngine]) -> None:
    offerer, puller = engines
    src_layers, dst_layers = caches("LBHNC", True), caches("LBHNC", False)
    source = TransferBuffers(DeviceKv(src_layers, 16, "test", 5))
    sink = TransferBuffers(DeviceKv(dst_layers, 16, "test", 5))
    offerer.offer("g", 3, source.source("g", [4, 5, 6]), lease_s=10)
    puller.pull("g", Address.parse(offerer.address), 0, 3, sink.sink("g", [9, 10, 11]), time.monotonic() + 10)
    result = puller.wait_pull("g", 10)
    assert result is not None and result.state is PullState.DONE, result
    assert sink.land("g")()
    sink.release("g")
    for layer in range(SIZES["L"]):
        for s, d in ((4, 9), (5, 10), (6, 11)):
            assert torch.equal(dst_layers[layer][d], src_layers[layer][s])
    source.release("g")


@pytest.mark.parametrize("order", PHYSICAL_ORDERS)
def test_row_plans_move_what_the_byte_ranges_say(order: str) -> None:
    """One gather per storage moves exactly the bytes the layers' byte ranges name, every physical order, several
    layers at once (they share vLLM's one buffer); and one scatter puts them back where other blocks' ranges say."""
    src_layers = caches(order, True)
    kv, reference = DeviceKv(src_layers, 16, "test", 5), KvBlocks.from_tensors(src_layers, 16, "test")
    assert len(kv.flat) == 1 and kv.storage_of == [0] * SIZES["L"], "one storage for every layer"
    blocks = [9, 2, 3, 11, 0]
    out = torch.empty(SIZES["L"] * len(blocks) * BLOCK_BYTES, dtype=torch.uint8)
    assert kv.copy_out(range(SIZES["L"]), blocks, out)()
    expected = b"".join(bytes(v) for layer in range(SIZES["L"]) for v in reference.block_views(layer, blocks))
    assert out.numpy().tobytes() == expected
    (piece,) = kv.plan(range(SIZES["L"]), blocks)
    assert piece.nbytes == out.numel()
    dst_layers = caches(order, False)
    dst = DeviceKv(dst_layers, 16, "test", 5)
    placed = [4, 1, 10, 7, 5]
    assert dst.copy_in(range(SIZES["L"]), placed, out)()
    for layer in range(SIZES["L"]):
        for s_, d in zip(blocks, placed, strict=True):
            assert torch.equal(dst_layers[layer][d], src_layers[layer][s_])
        untouched = [b for b in range(SIZES["B"]) if b not in placed]
        assert not dst_layers[layer][untouched].any()


@pytest.mark.parametrize(("row", "word"), [(64, 8), (12, 4), (6, 2), (5, 1)])
def test_rows_are_read_as_the_widest_word_they_allow(row: int, word: int) -> None:
    flat = torch.randint(0, 256, (row * 10 + 3,), dtype=torch.uint8)
    assert word_bytes(row, flat.data_ptr()) == word
    rows = as_rows(flat, row, word)
    assert rows.shape[0] == 10 and rows.element_size() == word
    ids = torch.tensor([7, 2, 9])
    assert rows.index_select(0, ids).view(torch.uint8).view(3, row).equal(flat[: 10 * row].view(10, row)[ids])


def test_consecutive_rows_move_with_one_plain_copy() -> None:
    """Blocks that lie one after another are copied as they are: no indices, no gather."""
    kv = DeviceKv(caches("LBHNC", True), 16, "test", 5)
    assert kv.plan([0], [3, 4, 5, 6])[0].one_run
    assert not kv.plan([0], [3, 5, 4])[0].one_run
    assert not DeviceKv(caches("BLHNC", True), 16, "test", 5).plan([1], [3, 4])[0].one_run, \
        "other layers lie between two blocks"


def test_a_transfers_rows_are_worked_out_once_not_per_layer() -> None:
    """A transfer's layers come one after another with its one tuple of block ids: the layers that lie alike share
    one list of rows (and one upload of it to the device); another transfer's ids are worked out anew."""
    src_layers = caches("LBHNC", True)
    kv = DeviceKv(src_layers, 16, "test", 5)
    reference = KvBlocks.from_tensors(src_layers, 16, "test")
    for blocks in ((9, 2, 3, 11, 0), (5, 6, 1)):
        pieces = [kv.plan((layer,), blocks)[0] for layer in range(SIZES["L"])]
        assert all(p.rows is pieces[0].rows for p in pieces), "one list of rows for the layers of a transfer"
        for layer in range(SIZES["L"]):
            out = torch.empty(len(blocks) * BLOCK_BYTES, dtype=torch.uint8)
            assert kv.copy_out([layer], blocks, out)()
            assert out.numpy().tobytes() == b"".join(bytes(v) for v in reference.block_views(layer, blocks))


def test_block_ids_in_a_list_are_worked_out_every_time() -> None:
    """A list may change between calls: nothing is kept for it."""
    src_layers = [t.clone() for t in caches("BLHNC", True)]
    kv = DeviceKv(src_layers, 16, "test", 5)
    reference = KvBlocks.from_tensors(src_layers, 16, "test")
    ids = [1, 2, 3]
    out = torch.empty(len(ids) * BLOCK_BYTES, dtype=torch.uint8)
    for blocks in ([1, 2, 3], [7, 0, 4]):
        ids[:] = blocks
        assert kv.copy_out([0], ids, out)()
        assert out.numpy().tobytes() == b"".join(bytes(v) for v in reference.block_views(0, blocks))


def test_the_pinned_ring_reuses_what_finished_wherever_it_lies_and_refuses_what_cannot_fit() -> None:
    """Row indices go to the device through a ring of pinned memory: a span is reused once its copy is done, also
    behind one still in flight; a span whose copy could not be issued is free at once; a list larger than the ring
    is refused (the caller fails the transfer) rather than clipped."""
    ring = PinnedRing(0, host=torch.zeros(1024, dtype=torch.uint8))
    rows = np.arange(32, dtype=np.int64)  # 256 bytes
    stuck, finished = (lambda: False), (lambda: True)
    host, freed_by = ring.put(rows)
    assert host.numpy().view(np.int64).tolist() == rows.tolist()
    freed_by(stuck)  # a copy that never ends holds its span
    for _ in range(10):  # the others' spans come back, behind the stuck one
        _, freed_by = ring.put(rows)
        freed_by(finished)
    _, never_issued = ring.put(rows)  # its copy could not be issued: nothing reads it
    never_issued(done)
    _, freed_by = ring.put(rows)
    freed_by(stuck)
    with pytest.raises(NoPinnedSpace, match="ring is full"):
        for _ in range(3):
            ring.put(rows)
    with pytest.raises(NoPinnedSpace, match="more than the pinned ring holds"):
        ring.put(np.arange(200, dtype=np.int64))
