"""Pulls by pipe (the nccl transport's engine protocol), run over gloo pipes between host caches: a communicator per
link made off the request path, both sides' blocks moved in payload order in the same chunks, a confirmation before
the offer is freed, a set-up that fails leaving the link on bytes, and teardown with the link. NCCL's call sequence
runs through a fake library in test_nccl.py; NCCL itself is checked on a GPU (scripts/gpu_check.sh)."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from multiprocessing.connection import Connection

import pytest
import torch

from p2pkv.bench import ipc_check
from p2pkv.config import ExtraConfig, Transport
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.device import Fence, Placed
from p2pkv.engine.metrics import EngineMetrics
from p2pkv.engine.pipes import PipeSlot
from p2pkv.engine.puller import PullState
from p2pkv.engine.sender import OutState
from p2pkv.engine.store import StageState
from p2pkv.errors import TransferError
from p2pkv.kv.buffers import TransferBuffers
from p2pkv.kv.pipes import ChannelPipe, GlooPipes
from p2pkv.kv.staging import DeviceKv
from p2pkv.params import Address
from p2pkv.way import WhyPull
from tests.helpers.pipe_sides import SETUP_S, TIMEOUT_S, RecordingPipes, Side, pull, pull_until_by_pipe, push, same
from tests.helpers.unit import SIZES, views


@pytest.mark.parametrize("order", ["LBHNC", "LHBNC"])  # one run per block, and one per head of each block
def test_pulls_go_by_pipe_once_it_is_made(sides: list[Side], order: str) -> None:
    offerer, puller = Side(order, True), Side(order, False)
    sides += [offerer, puller]
    moves = {3: 0, 4: 1, 5: 2, 9: 7, 1: 11}  # runs that pair differently on the two sides
    results = pull_until_by_pipe(offerer, puller, moves, "p")
    assert all(r.transport != "gloo" for r in results[:-1]) and results[-1].transport == "gloo"
    nbytes = SIZES["L"] * len(moves) * offerer.kv.block_bytes
    assert results[-1].nbytes == nbytes
    again = pull(offerer, puller, "again", {6: 3, 7: 4})  # the pipe is made once per link and reused
    assert again.transport == "gloo" and same(offerer, puller, {6: 3, 7: 4})
    assert len(puller.pipes.made) == 1 and len(offerer.pipes.made) == 1
    for side in (offerer, puller):
        assert side.engine.metrics.registry.get_sample_value("p2pkv_pipes_total",
                                                             {"kind": "gloo", "outcome": "ready"}) == 1
    received = puller.engine.metrics.registry.get_sample_value("p2pkv_bytes_received_total", {"transport": "gloo"})
    assert received == nbytes + SIZES["L"] * 2 * offerer.kv.block_bytes
    sent = offerer.engine.metrics.registry.get_sample_value("p2pkv_bytes_sent_total", {"transport": "gloo"})
    assert sent == received
    stats = puller.kv.pool.stats() if puller.kv.pool is not None else None
    assert stats is None or stats.bytes_in_use == 0, "the pull by pipe used no host buffer"


@pytest.mark.parametrize("pull_over_device", [True, False])
def test_a_push_to_a_peer_that_makes_pipes_too_is_left_for_a_pull_by_pipe(sides: list[Side],
                                                                          pull_over_device: bool) -> None:
    """PUT/PUT_ASYNC between workers that both make pipes: the decode side asks in the handshake for pulls, so the
    blocks are not pushed through host memory but left for a pull through the pipe (nccl: GPU to GPU). With
    `pull_over_device` false on the decode side, they are pushed."""
    prefill, decode = Side("LBHNC", True), Side("LBHNC", False, pull_over_device=pull_over_device)
    sides += [prefill, decode]
    state = push(prefill, decode, "pushed", [3, 4])
    out = prefill.engine.wait_outgoing("pushed", 10)
    assert out is not None
    if not pull_over_device:
        assert state is StageState.COMPLETE and out.state is OutState.DONE
        return
    assert state is StageState.FAILED and decode.engine.store.reason("pushed") == WhyPull.DEVICE_PATH.value
    assert out.state is OutState.REFUSED and out.reason == WhyPull.DEVICE_PATH.value and out.nbytes == 0
    prefill.buffers.release("pushed")
    results = pull_until_by_pipe(prefill, decode, {3: 0, 4: 1}, "left")
    assert results[-1].transport == "gloo"


def test_a_pipe_that_cannot_be_made_leaves_the_link_on_bytes(sides: list[Side]) -> None:
    offerer, puller = Side("LBHNC", True, refuse_join=True), Side("LBHNC", False)
    sides += [offerer, puller]
    moves = {2: 5, 3: 6}
    first = pull(offerer, puller, "b-0", moves)
    time.sleep(0.5)  # the listener's join has failed by now; the puller's side waits for it to its deadline
    for i in range(1, 4):
        result = pull(offerer, puller, f"b-{i}", moves)
        assert not result.by_reference and result.transport != "gloo"
    assert not first.by_reference and same(offerer, puller, moves)
    assert offerer.pipes.made == [] and puller.pipes.made == []
    assert offerer.engine.metrics.registry.get_sample_value("p2pkv_pipes_total",
                                                             {"kind": "gloo", "outcome": "failed"}) == 1
    puller.engine.close()  # waits for the set-up in flight to its deadline: no thread is left in gloo's rendezvous
    assert not [t for t in threading.enumerate() if t.name == f"p2pkv-pipe-{offerer.engine.address}"]


def test_the_pipe_goes_with_its_link(sides: list[Side]) -> None:
    offerer, puller = Side("LBHNC", True), Side("LBHNC", False)
    sides += [offerer, puller]
    pull_until_by_pipe(offerer, puller, {1: 2}, "t")
    theirs = offerer.pipes.made[0]
    puller.engine.close()  # the decode worker leaves: the offerer's reader ends and frees its communicator
    deadline = time.monotonic() + 5
    while not theirs.closed:
        assert time.monotonic() < deadline, "the offerer kept the pipe of a link that is gone"
        time.sleep(0.01)
    assert puller.pipes.made[0].closed
    assert not [t for t in threading.enumerate() if t.name == f"p2pkv-pipe-{offerer.engine.address}"]
    fresh = Side("LBHNC", False)  # a new peer gets a new pipe
    sides.append(fresh)
    pull_until_by_pipe(offerer, fresh, {1: 2}, "n")
    assert len(offerer.pipes.made) == 2


class FailingOnce(RecordingPipes):
    """The offerer's pipe fails its first send, as when the peer's GPU faults mid-transfer."""

    failed = False

    def join(self, token: bytes, deadline: float) -> ChannelPipe:
        pipe = super().join(token, deadline)
        real = pipe.send

        def send(placed: Placed, deadline: float) -> None:
            if not self.failed:
                self.failed = True
                raise TransferError("injected failure")
            real(placed, deadline)

        pipe.send = send  # type: ignore[method-assign]  # the instance's send fails once
        return pipe


def test_a_transfer_that_fails_in_the_pipe_fails_alone_and_the_link_recovers(sides: list[Side]) -> None:
    offerer, puller = Side("LBHNC", True), Side("LBHNC", False)
    offerer.pipes = FailingOnce(offerer.kv)
    offerer.engine.close()
    extra = ExtraConfig(kv_host="127.0.0.1", transfer_timeout_s=TIMEOUT_S, connect_timeout_s=SETUP_S,
                        transport=Transport.NCCL)
    offerer.engine = TransferEngine(EngineSettings.from_config(extra, 0, 0), offerer.kv.digest, pipes=offerer.pipes)
    offerer.engine.start()
    sides += [offerer, puller]
    moves = {4: 4}
    deadline = time.monotonic() + 10
    failed = None
    while failed is None:  # pulls carry bytes until the pipe is made; the first by pipe fails
        assert time.monotonic() < deadline
        tid = f"f-{time.monotonic()}"
        src = list(moves)
        offerer.engine.offer(tid, 1, offerer.buffers.source(tid, src), 10, offerer.buffers.offered_places(tid, src))
        puller.engine.pull(tid, offerer.address, 0, 1, puller.buffers.sink(tid, [4]), time.monotonic() + 3, (4,))
        result = puller.engine.wait_pull(tid, 10)
        assert result is not None and result.state is not PullState.PENDING
        if result.state is PullState.FAILED:
            failed = result
        puller.buffers.release(tid)
        offerer.buffers.release(tid)
    assert puller.pipes.made and puller.pipes.made[0].closed, "a failed pipe is not reused"
    for layer in puller.layers:
        layer.zero_()
    results = pull_until_by_pipe(offerer, puller, moves, "r")  # a new link, a new pipe
    assert results[-1].transport == "gloo" and len(puller.pipes.made) == 2


def test_the_pipe_bench_runs_between_two_processes_on_host_caches() -> None:
    """`bench transfer`'s nccl rows on CPU caches: a child process offers, this one pulls by gloo pipe once it is
    made; every byte of a scattered pull is checked, and the rates are measured."""
    summary, rates = ipc_check.run("cpu", [1 << 20, 4 << 20], repeats=2, pipes=True)
    assert "by pipe over gloo" in summary and "byte for byte" in summary
    assert "a push was left for a pull (PullInstead) and pulled over gloo" in summary
    assert [r.size for r in rates] == [1 << 20, 4 << 20]
    assert all(r.pull_gbps > 0 and r.base_gbps > 0 for r in rates)


@pytest.mark.parametrize(("transport", "label"), [(Transport.AUTO, "host_ipc"), (Transport.TCP, "tcp")])
def test_no_pipe_where_the_cache_opens_or_tcp_is_asked_for(sides: list[Side], transport: Transport,
                                                           label: str) -> None:
    """auto: a peer whose cache opens here is copied from directly, with no communicator made; tcp: never a pipe."""
    offerer = Side("LBHNC", True, transport=transport, exports=True)
    puller = Side("LBHNC", False, transport=transport, exports=True)
    sides += [offerer, puller]
    for i in range(4):
        result = pull(offerer, puller, f"n-{i}", {1: 2, 2: 3})
        assert result.transport == label and same(offerer, puller, {1: 2, 2: 3})
        time.sleep(0.1)
    assert puller.pipes.made == [] and offerer.pipes.made == []


class StallingPipes(GlooPipes):
    """The listener's pipes say when a send starts, then never finish it: a peer that hangs mid-transfer."""

    def __init__(self, kv: DeviceKv, conn: Connection) -> None:
        super().__init__(kv, "127.0.0.1")
        self._conn = conn

    def join(self, token: bytes, deadline: float) -> ChannelPipe:
        pipe = super().join(token, deadline)

        def send(placed: Placed, deadline: float) -> None:
            self._conn.send("sending")
            time.sleep(600)

        pipe.send = send  # type: ignore[method-assign]  # the instance's sends hang
        return pipe


def _offering_process(conn: Connection, port: int, stall: bool) -> None:
    torch.manual_seed(0)
    layers = views("LBHNC", torch.bfloat16, SIZES, True)
    kv = DeviceKv(layers, 16, "test", 5)
    buffers = TransferBuffers(kv)
    pipes = StallingPipes(kv, conn) if stall else GlooPipes(kv, "127.0.0.1")
    extra = ExtraConfig(kv_host="127.0.0.1", transfer_timeout_s=TIMEOUT_S, connect_timeout_s=SETUP_S,
                        transport=Transport.NCCL)
    engine = TransferEngine(EngineSettings.from_config(extra, port, 0), kv.digest, pipes=pipes)
    engine.start()
    for i in range(40):
        engine.offer(f"k-{i}", 2, buffers.source(f"k-{i}", [1, 2]), 60, buffers.offered_places(f"k-{i}", [1, 2]))
    conn.send(engine.address)
    conn.poll(120)


def _spawn(port: int, stall: bool) -> tuple[mp.process.BaseProcess, Connection, Address]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_offering_process, args=(child, port, stall), daemon=True)
    proc.start()
    assert parent.poll(60), "the offering process did not start"
    return proc, parent, Address.parse(parent.recv())


def test_a_peer_that_dies_mid_transfer_fails_that_pull_and_its_successor_gets_a_new_pipe(sides: list[Side]) -> None:
    """A real process, killed while it sends by pipe: the pull fails (within its deadline, not hanging), and the
    peer restarted on the same port is pulled from by a new pipe."""
    puller = Side("LBHNC", False)
    sides.append(puller)
    proc, conn, peer = _spawn(0, stall=True)
    failed, i = None, 0
    try:
        while failed is None:  # pulls carry bytes until the pipe is made; the first by pipe hangs in the peer
            assert i < 40
            tid = f"k-{i}"
            puller.engine.pull(tid, peer, 0, 2, puller.buffers.sink(tid, [5, 6]), time.monotonic() + TIMEOUT_S,
                               (5, 6))
            if conn.poll(1.0) and conn.recv() == "sending":
                proc.kill()
                killed = time.monotonic()
                result = puller.engine.wait_pull(tid, 3 * TIMEOUT_S)
                assert result is not None and result.state is PullState.FAILED, result
                failed = time.monotonic() - killed
            else:
                result = puller.engine.wait_pull(tid, TIMEOUT_S)
                assert result is not None and result.state is PullState.DONE and result.transport != "gloo"
            puller.buffers.release(tid)
            i += 1
    finally:
        proc.kill()
        proc.join(10)
    assert failed < 2 * TIMEOUT_S, f"the pull failed {failed:.1f} s after its peer died"
    assert puller.pipes.made and puller.pipes.made[-1].closed, "the dead peer's pipe was freed"
    proc, conn, peer2 = _spawn(peer.port, stall=False)  # the peer restarts on the same port
    try:
        torch.manual_seed(0)
        expected = views("LBHNC", torch.bfloat16, SIZES, True)
        for layer in puller.layers:
            layer.zero_()
        by_pipe = False
        for j in range(40):
            tid = f"k-{j}"
            puller.engine.pull(tid, peer2, 0, 2, puller.buffers.sink(tid, [5, 6]), time.monotonic() + TIMEOUT_S,
                               (5, 6))
            result = puller.engine.wait_pull(tid, TIMEOUT_S)
            assert result is not None and result.state is PullState.DONE, result
            if not result.by_reference:
                assert puller.buffers.land(tid)()
            puller.buffers.release(tid)
            assert all(torch.equal(puller.layers[layer][5 + k], expected[layer][1 + k])
                       for layer in range(SIZES["L"]) for k in range(2))
            by_pipe = result.transport == "gloo"
            if by_pipe:
                break
            time.sleep(0.1)
        assert by_pipe, "no pull went by the new pipe"
        assert len(puller.pipes.made) == 2
    finally:
        conn.send("stop")
        proc.join(30)


class FakePipe:
    """Stands for a communicator in PipeSlot's own bookkeeping (no transfer goes through it)."""

    transport = "fake"

    def __init__(self) -> None:
        self.closed_with: bool | None = None

    def send(self, placed: Placed, deadline: float) -> None:
        raise AssertionError("not used")

    def recv(self, placed: Placed, deadline: float, after: Fence | None = None) -> None:
        raise AssertionError("not used")

    def close(self, abort: bool = False) -> None:
        self.closed_with = abort


def test_a_pipe_made_after_its_deadline_or_its_link_is_freed_not_used() -> None:
    metrics = EngineMetrics()
    late, released = FakePipe(), threading.Event()

    def slow_setup(deadline: float) -> FakePipe:  # NCCL's init cannot be bounded: it returns when it returns
        released.wait(5)
        return late

    slot = PipeSlot("peer", "fake", slow_setup, 0.05, metrics)
    assert slot.wait(0.2) is None and slot.ready() is None  # not made by its deadline: the link carries bytes
    released.set()
    slot.join()
    assert slot.settled and slot.ready() is None and late.closed_with is False, "made late: freed"
    assert metrics.registry.get_sample_value("p2pkv_pipes_total", {"kind": "fake", "outcome": "late"}) == 1
    made = FakePipe()
    slot = PipeSlot("peer", "fake", lambda deadline: made, 5, metrics)
    assert slot.wait(5) is made
    slot.close(abort=True)  # the link's peer is gone
    assert made.closed_with is True and slot.ready() is None
