"""Two engines over host caches that pull from each other through gloo pipes, and the pulls and pushes between them."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from p2pkv.config import ExtraConfig, Transport
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.offers import OfferState
from p2pkv.engine.puller import PullResult, PullState
from p2pkv.engine.store import StageState
from p2pkv.errors import P2pkvError
from p2pkv.kv.buffers import TransferBuffers
from p2pkv.kv.ipc import CacheAccess
from p2pkv.kv.pipes import ChannelPipe, GlooPipes
from p2pkv.kv.staging import DeviceKv
from p2pkv.memory import HostPool
from p2pkv.params import Address
from tests.helpers.unit import SIZES, views

TIMEOUT_S = 5.0
SETUP_S = 1.5  # a pipe's set-up deadline (connect_timeout_s)


class RecordingPipes(GlooPipes):
    """Gloo pipes that remember what they made; `refuse_join` makes the listener's side fail to join."""

    def __init__(self, kv: DeviceKv, refuse_join: bool = False) -> None:
        super().__init__(kv, "127.0.0.1")
        self.made: list[ChannelPipe] = []
        self.refuse_join = refuse_join

    def create(self) -> tuple[bytes, Callable[[float], ChannelPipe]]:
        token, setup = super().create()

        def recorded(deadline: float) -> ChannelPipe:
            self.made.append(setup(deadline))
            return self.made[-1]

        return token, recorded

    def join(self, token: bytes, deadline: float) -> ChannelPipe:
        if self.refuse_join:
            raise P2pkvError("this side cannot join")
        self.made.append(super().join(token, deadline))
        return self.made[-1]


class Side:
    def __init__(self, order: str, fill: bool, transport: Transport = Transport.NCCL, refuse_join: bool = False,
                 exports: bool = False, pull_over_device: bool = True, integrity: bool = False,
                 pipes: type[RecordingPipes] = RecordingPipes):
        self.layers = views(order, torch.bfloat16, SIZES, fill)
        self.kv = DeviceKv(self.layers, 16, "test", 5)
        self.kv.pool = HostPool(1 << 20, pinned=False)
        self.buffers = TransferBuffers(self.kv)
        self.pipes = pipes(self.kv, refuse_join)
        extra = ExtraConfig(kv_host="127.0.0.1", transfer_timeout_s=TIMEOUT_S, connect_timeout_s=SETUP_S,
                            transport=transport, pull_over_device=pull_over_device, integrity_check=integrity)
        self.engine = TransferEngine(EngineSettings.from_config(extra, 0, 0), self.kv.digest, pipes=self.pipes,
                                     device=CacheAccess(self.kv) if exports else None)
        self.engine.start()

    @property
    def address(self) -> Address:
        return Address.parse(self.engine.address)


def pull(offerer: Side, puller: Side, tid: str, moves: dict[int, int], done: bool = True) -> PullResult:
    """Pull `moves` (offerer's block -> puller's); the result once the offerer has the puller's confirmation (also
    for a pull that failed after its copy). `done`: the pull must succeed."""
    src, dst = list(moves), list(moves.values())
    offerer.engine.offer(tid, len(src), offerer.buffers.source(tid, src), 10, offerer.buffers.offered_places(tid, src))
    puller.engine.pull(tid, offerer.address, 0, len(dst), puller.buffers.sink(tid, dst), time.monotonic() + 10,
                       tuple(dst))
    result = puller.engine.wait_pull(tid, 10)
    assert result is not None and result.state is not PullState.PENDING
    assert result.state is PullState.DONE or not done, result
    if result.state is PullState.DONE and not result.by_reference:
        assert puller.buffers.land(tid)()  # bytes carried into the host buffer land now
    deadline = time.monotonic() + 5
    while offerer.engine.offer_state(tid) is not OfferState.SERVED:
        assert time.monotonic() < deadline, offerer.engine.offer_state(tid)
        time.sleep(0.002)
    puller.buffers.release(tid)
    offerer.buffers.release(tid)
    return result


def same(src: Side, dst: Side, moves: dict[int, int]) -> bool:
    return all(torch.equal(dst.layers[layer][d], src.layers[layer][s]) for layer in range(SIZES["L"])
               for s, d in moves.items())


def push(sender: Side, receiver: Side, tid: str, blocks: list[int]) -> StageState | None:
    """Every layer pushed as the worker pushes it; the receiver's state of the transfer once it settled."""
    deadline = time.monotonic() + 10
    for layer in range(SIZES["L"]):
        views, ready = sender.buffers.push_views(tid, layer, blocks)
        sender.engine.push_layer(tid, receiver.address, layer, len(blocks), views, deadline, ready)
    return receiver.engine.wait_staged(tid, 10)


def pull_until_by_pipe(offerer: Side, puller: Side, moves: dict[int, int], prefix: str) -> list[PullResult]:
    """Pulls until one goes by pipe (the first ones carry bytes while the pipe is being made), each checked."""
    results: list[PullResult] = []
    deadline = time.monotonic() + 10
    while not results or not results[-1].by_reference:
        assert time.monotonic() < deadline, [r.transport for r in results]
        for layer in puller.layers:
            layer.zero_()
        results.append(pull(offerer, puller, f"{prefix}-{len(results)}", moves))
        assert same(offerer, puller, moves), f"pull {len(results)} over {results[-1].transport}"
    return results
