"""Pulls by reference (cuda_ipc): the puller opens the offerer's exported cache and copies the blocks itself. Run
here with CPU caches exported as addresses and read with process_vm_readv (kind "host"): the same handshake,
protocol, bookkeeping and range pairing a GPU cache uses, without a GPU."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from p2pkv.bench import ipc_check
from p2pkv.config import ExtraConfig, Transport
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.device import Placed
from p2pkv.engine.offers import OfferState
from p2pkv.engine.puller import PullResult, PullState
from p2pkv.engine.sender import OutState
from p2pkv.engine.store import StageState
from p2pkv.errors import P2pkvError
from p2pkv.kv.ipc import CacheAccess
from p2pkv.kv.layout import ids_bytes
from p2pkv.kv.staging import DeviceKv
from p2pkv.protocol import DeviceExport, DeviceHome, LayerPlace
from p2pkv.transport import cma
from p2pkv.transport.split_read import SPLIT_FROM
from p2pkv.way import WhyPull
from tests.helpers.ipc_side import Side
from tests.helpers.unit import SIZES, caches, views

pytestmark = pytest.mark.skipif(not cma.available(), reason="needs cross-memory attach (Linux)")


MakeSide = Callable[..., Side]


@pytest.fixture
def make_side() -> Iterator[MakeSide]:
    made: list[Side] = []

    def make(fill: bool, **keys: Any) -> Side:
        made.append(Side(fill, **keys))
        return made[-1]

    yield make
    for side in made:
        side.engine.close()


def _pull(offerer: Side, puller: Side, tid: str, src_blocks: list[int], dst_blocks: list[int],
          by_ranges: bool = True) -> PullResult:
    places = offerer.buffers.offered_places(tid, src_blocks) if by_ranges else None
    offerer.engine.offer(tid, len(src_blocks), offerer.buffers.source(tid, src_blocks), 10, places)
    puller.engine.pull(tid, offerer.address, 0, len(dst_blocks), puller.buffers.sink(tid, dst_blocks),
                       time.monotonic() + 10, tuple(dst_blocks))
    result = puller.engine.wait_pull(tid, 10)
    assert result is not None and result.state is PullState.DONE, result
    return result


def _same(src: Side, dst: Side, moves: dict[int, int]) -> bool:
    return all(torch.equal(dst.layers[layer][d], src.layers[layer][s]) for layer in range(SIZES["L"])
               for s, d in moves.items())


@pytest.mark.parametrize("transport", [Transport.AUTO, Transport.CUDA_IPC])
def test_a_pull_by_reference_copies_cache_to_cache(make_side: MakeSide, transport: Transport) -> None:
    offerer, puller = make_side(True, transport=transport), make_side(False, transport=transport)
    moves = {3: 0, 4: 1, 9: 7, 1: 11}
    for round_ in range(2):  # the peer's cache is opened once per link and reused
        tid = f"ref-{round_}"
        result = _pull(offerer, puller, tid, list(moves), list(moves.values()))
        assert result.by_reference and result.transport == "host_ipc"
        assert result.nbytes == SIZES["L"] * len(moves) * offerer.kv.block_bytes
        assert _same(offerer, puller, moves)
        deadline = time.monotonic() + 5  # served once the offerer has read the puller's copy confirmation
        while offerer.engine.offer_state(tid) is not OfferState.SERVED:
            assert time.monotonic() < deadline, offerer.engine.offer_state(tid)
            time.sleep(0.002)
        assert puller.pool_in_use() == 0 and offerer.pool_in_use() == 0, "no host buffer was used on either side"
        puller.buffers.release(tid)
        offerer.buffers.release(tid)
        for layer in puller.layers:
            layer.zero_()
    received = puller.engine.metrics.registry.get_sample_value("p2pkv_bytes_received_total",
                                                               {"transport": "host_ipc"})
    assert received == 2 * SIZES["L"] * len(moves) * offerer.kv.block_bytes


def test_without_ranges_or_export_the_pull_carries_bytes(make_side: MakeSide) -> None:
    moves = {2: 5, 3: 6}
    offerer, puller = make_side(True), make_side(False)
    result = _pull(offerer, puller, "bytes-1", list(moves), list(moves.values()), by_ranges=False)
    assert not result.by_reference
    assert not _same(offerer, puller, moves), "bytes pulled into the host buffer land only with land()"
    assert puller.buffers.land("bytes-1")()
    assert _same(offerer, puller, moves)
    plain = make_side(True, exports=False)  # an offerer that exports nothing
    result = _pull(plain, puller, "bytes-2", list(moves), list(moves.values()))
    assert not result.by_reference
    puller.buffers.release("bytes-2")


def test_transport_tcp_never_pulls_by_reference(make_side: MakeSide) -> None:
    offerer = make_side(True, transport=Transport.TCP)
    puller = make_side(False, transport=Transport.TCP)
    result = _pull(offerer, puller, "tcp-1", [1, 2], [3, 4])
    assert not result.by_reference and result.transport == "tcp"
    assert puller.buffers.land("tcp-1")()
    assert _same(offerer, puller, {1: 3, 2: 4})


def test_places_outside_the_export_are_refused() -> None:
    src_layers, dst_layers = caches("LBHNC", True), caches("LBHNC", False)
    src, dst = DeviceKv(src_layers, 16, "test", 5), DeviceKv(dst_layers, 16, "test", 5)
    remote = CacheAccess(dst).open(CacheAccess(src).export())
    ours = dst.places(range(SIZES["L"]), [2])
    past = src.flat[0].numel() // src.block_bytes  # a block past the end of the peer's storage
    with pytest.raises(P2pkvError, match="outside the peer's storage 0"):
        remote.copy(src.places(range(SIZES["L"]), [past]), ours, time.monotonic() + 5)
    elsewhere = Placed(ids_bytes([2]), [LayerPlace(3, p.base, p.block_stride, p.inner) for p in ours.layers])
    with pytest.raises(P2pkvError, match="storage 3 of the peer's 1"):  # only what the peer exports
        remote.copy(elsewhere, ours, time.monotonic() + 5)
    with pytest.raises(P2pkvError, match="outside our storage"):  # our places are checked too
        remote.copy(src.places(range(SIZES["L"]), [2]), dst.places(range(SIZES["L"]), [past]),
                    time.monotonic() + 5)
    with pytest.raises(P2pkvError, match=r"hold \d+ bytes, ours"):
        remote.copy(src.places(range(SIZES["L"]), [2, 3]), ours, time.monotonic() + 5)
    assert remote.copy(src.places(range(SIZES["L"]), [5]), ours, time.monotonic() + 5) == (
        SIZES["L"] * src.block_bytes)
    assert all(torch.equal(d[2], s[5]) for d, s in zip(dst_layers, src_layers, strict=True))
    assert not any(d[[0, 1, 3]].any() for d in dst_layers), "nothing else was written"


def test_an_export_from_another_host_or_kind_is_not_opened() -> None:
    kv = DeviceKv(caches("LBHNC", False), 16, "test", 5)
    export = CacheAccess(kv).export()
    access = CacheAccess(kv)
    with pytest.raises(P2pkvError, match="another host"):
        access.open(type(export)(export.kind, "other-boot", export.pid, "", export.handles))
    with pytest.raises(P2pkvError, match="exports a cuda cache"):
        access.open(type(export)("cuda", export.boot_id, export.pid, "", export.handles))
    # What the handshake asks before it wants pulls instead of pushes: the same, without opening anything.
    assert access.reaches(DeviceHome(export.kind, export.boot_id))
    assert not access.reaches(DeviceHome(export.kind, "other-boot"))
    assert not access.reaches(DeviceHome("cuda", export.boot_id, "GPU-0"))


def test_the_cuda_ipc_row_runs_between_two_processes_on_host_caches() -> None:
    """The GPU check's cuda_ipc row on CPU caches: a child process offers, this one pulls by reference (process_vm_readv
    standing in for CUDA IPC); every byte is checked, and the rates are measured."""
    summary, rates = ipc_check.run("cpu", [1 << 20, 4 << 20], repeats=2)
    assert "byte for byte" in summary and "host_ipc" in summary
    assert "a push was left for a pull (PullInstead) and pulled over host_ipc" in summary
    assert [r.size for r in rates] == [1 << 20, 4 << 20]
    assert all(r.pull_gbps > 0 and r.copy_gbps > 0 and r.base_gbps > 0 for r in rates)


def test_a_cache_that_cannot_be_exported_still_serves_pulls_as_bytes(make_side: MakeSide) -> None:
    class Unshareable(CacheAccess):
        def export(self) -> DeviceExport:
            raise RuntimeError("memory from an allocator CUDA IPC cannot share")

    offerer = make_side(True)
    offerer.engine.close()
    extra = ExtraConfig(kv_host="127.0.0.1", transfer_timeout_s=5)
    offerer.engine = TransferEngine(EngineSettings.from_config(extra, 0, 0), offerer.kv.digest,
                                    device=Unshareable(offerer.kv))
    offerer.engine.start()  # logs a warning instead of failing the worker
    puller = make_side(False)
    result = _pull(offerer, puller, "plain", [1, 2], [3, 4])
    assert not result.by_reference
    assert puller.buffers.land("plain")()
    assert _same(offerer, puller, {1: 3, 2: 4})


def _push(sender: Side, receiver: Side, tid: str, blocks: list[int], prepared: bool = True) -> None:
    """Push every layer of `blocks` as the worker does; `prepared` False: the worker found the link asking for
    pulls and queues the layers without bytes."""
    deadline = time.monotonic() + 10
    for layer in range(SIZES["L"]):
        if prepared:
            views, ready = sender.buffers.push_views(tid, layer, blocks)
            sender.engine.push_layer(tid, receiver.address, layer, len(blocks), views, deadline, ready)
        else:
            sender.engine.push_layer(tid, receiver.address, layer, len(blocks), (), deadline, None, True)


def _sent(side: Side, outcome: str) -> float:
    value = side.engine.metrics.registry.get_sample_value("p2pkv_transfers_total",
                                                          {"direction": "send", "outcome": outcome})
    return value or 0.0


def _left_for_a_pull(sender: Side, receiver: Side, tid: str) -> None:
    assert receiver.engine.wait_staged(tid, 10) is StageState.FAILED
    assert receiver.engine.store.reason(tid) == WhyPull.DEVICE_PATH.value
    out = sender.engine.wait_outgoing(tid, 10)
    assert out is not None and out.state is OutState.REFUSED and out.reason == WhyPull.DEVICE_PATH.value
    assert out.nbytes == 0


def test_a_push_to_a_peer_that_opens_our_cache_is_left_for_it_to_pull(make_side: MakeSide) -> None:
    """The decode side can open the prefill side's export (same host, same kind): it asks in the handshake for
    pulls, the prefill side sends PullInstead instead of the blocks and offers them, and the decode side copies
    them cache to cache. Once the link is up, the worker sees it asking and copies nothing to the host."""
    prefill, decode = make_side(True), make_side(False)
    moves = {3: 0, 4: 1, 9: 7}
    _push(prefill, decode, "left-1", list(moves))
    _left_for_a_pull(prefill, decode, "left-1")
    assert prefill.engine.pulls_instead(decode.address)
    prefill.buffers.release("left-1")  # the worker frees the push's host buffer and offers the blocks instead
    result = _pull(prefill, decode, "left-1", list(moves), list(moves.values()))
    assert result.by_reference and _same(prefill, decode, moves)
    _push(prefill, decode, "left-2", list(moves), prepared=False)
    _left_for_a_pull(prefill, decode, "left-2")
    assert prefill.pool_in_use() == 0 and decode.pool_in_use() == 0
    assert _sent(prefill, "pull_instead") == 2 and _sent(prefill, "ok") == 0
    received = decode.engine.metrics.registry.get_sample_value("p2pkv_bytes_received_total", {"transport": "shm"})
    assert not received, "no pushed bytes reached the decode side"


@pytest.mark.parametrize("decode_kind", ["pull_over_device false", "transport tcp", "exports nothing"])
def test_a_peer_that_does_not_ask_for_pulls_gets_the_push(make_side: MakeSide, decode_kind: str) -> None:
    prefill = make_side(True)
    decode = make_side(False, transport=Transport.TCP if decode_kind == "transport tcp" else Transport.AUTO,
                       exports=decode_kind != "exports nothing",
                       pull_over_device=decode_kind != "pull_over_device false")
    _push(prefill, decode, "pushed-1", [2, 5])
    assert decode.engine.wait_staged("pushed-1", 10) is StageState.COMPLETE
    out = prefill.engine.wait_outgoing("pushed-1", 10)
    assert out is not None and out.state is OutState.DONE
    assert not prefill.engine.pulls_instead(decode.address)
    assert _sent(prefill, "ok") == 1 and _sent(prefill, "pull_instead") == 0


def test_layers_prepared_without_bytes_are_left_for_a_pull_even_on_a_link_that_pushes(make_side: MakeSide) -> None:
    """The worker decided from a link that asked for pulls; the link was replaced by one that does not: the
    transfer is still left for a pull (it has no bytes to push), never sent short."""
    prefill, decode = make_side(True), make_side(False, pull_over_device=False)
    _push(prefill, decode, "unprepared-1", [1, 2], prepared=False)
    _left_for_a_pull(prefill, decode, "unprepared-1")


def test_a_transfer_begun_as_a_push_then_prepared_without_bytes_fails_rather_than_go_short(
        make_side: MakeSide) -> None:
    """Layer 0 went out as a push; layer 1 comes without bytes (the worker saw a link asking for pulls, after a
    reconnect, say): the transfer cannot be completed either way, so it fails and the receiver is told."""
    prefill, decode = make_side(True), make_side(False, pull_over_device=False)
    deadline = time.monotonic() + 10
    views, ready = prefill.buffers.push_views("short", 0, [1, 2])
    prefill.engine.push_layer("short", decode.address, 0, 2, views, deadline, ready)
    assert prefill.engine.wait_sent(deadline)
    prefill.engine.push_layer("short", decode.address, 1, 2, (), deadline, None, True)
    out = prefill.engine.wait_outgoing("short", 10)
    assert out is not None and out.state is OutState.FAILED and "link changed" in out.reason
    assert decode.engine.wait_staged("short", 10) is StageState.FAILED
    assert "sender aborted" in decode.engine.store.reason("short")


def test_large_runs_of_a_host_cache_are_copied_on_two_threads() -> None:
    big = {"L": 1, "B": 20, "H": 8, "N": 16, "C": 2048}  # 10 MiB of bfloat16: at least SPLIT_FROM
    src = DeviceKv(views("LBHNC", torch.bfloat16, big, True), 16, "test", 5)
    dst = DeviceKv(views("LBHNC", torch.bfloat16, big, False), 16, "test", 5)
    nbytes = src.flat[0].numel()
    assert nbytes >= SPLIT_FROM
    remote = CacheAccess(dst).open(CacheAccess(src).export())
    whole = Placed(ids_bytes([0]), [LayerPlace(0, 0, nbytes, ((0, nbytes),))])
    try:
        assert remote.copy(whole, whole, time.monotonic() + 10) == nbytes
        assert torch.equal(dst.storages[0], src.storages[0])
        assert [t.name for t in threading.enumerate() if t.name.startswith("p2pkv-copy-")] != []
    finally:
        remote.close()
    assert [t.name for t in threading.enumerate() if t.name.startswith("p2pkv-copy-")] == []
