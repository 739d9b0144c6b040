"""GET mode's links: pulls from one peer share one connection, and a peer that restarted is reconnected."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from p2pkv.config import ExtraConfig, Transport
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.puller import PullState
from p2pkv.params import Address
from p2pkv.transport.base import Connection
from tests.helpers.peer import layout

LAYERS, BLOCKS, BLOCK_BYTES = 3, 4, 4096


@pytest.fixture(params=["tcp", "shm"])
def transport(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def start(transport: str, port: int = 0) -> TransferEngine:
    extra = ExtraConfig(kv_host="127.0.0.1", transport=Transport(transport), transfer_timeout_s=5)
    engine = TransferEngine(EngineSettings.from_config(extra, port, 0), layout(LAYERS, BLOCK_BYTES))
    engine.start()
    return engine


@pytest.fixture
def puller(transport: str) -> Iterator[TransferEngine]:
    engine = start(transport)
    yield engine
    engine.close()


def offer(engine: TransferEngine, tid: str, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, (LAYERS, BLOCKS * BLOCK_BYTES), np.uint8)
    engine.offer(tid, BLOCKS, lambda layer, first, count: (
        data[layer][first * BLOCK_BYTES : (first + count) * BLOCK_BYTES].data,), lease_s=10)
    return data


def pull(engine: TransferEngine, peer: str, tid: str) -> np.ndarray:
    local = np.zeros((LAYERS, BLOCKS * BLOCK_BYTES), np.uint8)
    engine.pull(tid, Address.parse(peer), 0, BLOCKS, lambda layer, first, count: (
        local[layer][first * BLOCK_BYTES : (first + count) * BLOCK_BYTES].data,), time.monotonic() + 5)
    result = engine.wait_pull(tid, 10)
    assert result is not None and result.state is PullState.DONE, result
    return local


def readers() -> int:
    return sum(t.name.startswith("p2pkv-reader-") for t in threading.enumerate())


def test_pulls_from_one_peer_share_one_connection(transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    connects: list[Address] = []
    real = TransferEngine._connect

    def counted(self: TransferEngine, peer: Address, deadline: float) -> Connection:
        connects.append(peer)
        return real(self, peer, deadline)

    monkeypatch.setattr(TransferEngine, "_connect", counted)
    offerer, puller = start(transport), start(transport)
    try:
        for i in range(3):
            data = offer(offerer, f"g{i}", seed=i)
            assert np.array_equal(pull(puller, offerer.address, f"g{i}"), data)
        assert len(connects) == 1 and readers() == 1  # all three pulls over the first connection
    finally:
        puller.close()
        offerer.close()


def test_a_restarted_peer_is_reconnected_for_the_next_pull(puller: TransferEngine, transport: str) -> None:
    first = start(transport)
    port = int(first.address.rsplit(":", 1)[1])
    data = offer(first, "before", seed=1)
    assert np.array_equal(pull(puller, first.address, "before"), data)
    first.close()
    second = start(transport, port)
    try:
        data = offer(second, "after", seed=2)
        assert np.array_equal(pull(puller, second.address, "after"), data)
    finally:
        second.close()


def test_a_pull_waiting_on_one_peer_does_not_hold_up_pulls_from_another(transport: str) -> None:
    """Peers get lanes in turn: a pull whose offer is not there yet (it retries until its deadline) waits in its
    own lane, and a pull from another peer goes through at once. Served one pull at a time, the second would
    wait out the first one's retries."""
    slow, fast, puller = start(transport), start(transport), start(transport)
    try:
        slow_peer, fast_peer = Address.parse(slow.address), Address.parse(fast.address)
        waiting = np.zeros((LAYERS, BLOCKS * BLOCK_BYTES), np.uint8)
        puller.pull("late", slow_peer, 0, BLOCKS, lambda layer, first, count: (
            waiting[layer][first * BLOCK_BYTES : (first + count) * BLOCK_BYTES].data,), time.monotonic() + 8)
        time.sleep(0.1)  # the first pull is in its lane, retrying
        data = offer(fast, "prompt", seed=7)
        started = time.monotonic()
        assert np.array_equal(pull(puller, fast.address, "prompt"), data)
        assert time.monotonic() - started < 2.0
        result = puller.pull_result("late")
        assert result is not None and result.state is PullState.PENDING
        late = offer(slow, "late", seed=8)  # offered now: the waiting pull finds it on its next try
        done = puller.wait_pull("late", 5)
        assert done is not None and done.state is PullState.DONE and np.array_equal(waiting, late)
        assert puller._puller is not None and puller._puller.lane_of(slow_peer) != puller._puller.lane_of(fast_peer)
    finally:
        for engine in (puller, fast, slow):
            engine.close()


def test_pulls_from_many_peers_never_wait_behind_a_silent_one(transport: str) -> None:
    """A peer that accepts the connection and then says nothing holds its pull until the deadline; pulls from five
    other peers, queued after it, go through at once (each peer has its own lane, however many there are)."""
    silent = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(silent.accept()[0]), daemon=True).start()
    peers = [start(transport) for _ in range(5)]
    puller = start(transport)
    try:
        quiet = Address("127.0.0.1", silent.getsockname()[1])
        nothing = np.zeros((LAYERS, BLOCKS * BLOCK_BYTES), np.uint8)
        puller.pull("never", quiet, 0, BLOCKS, lambda layer, first, count: (
            nothing[layer][first * BLOCK_BYTES : (first + count) * BLOCK_BYTES].data,), time.monotonic() + 8)
        time.sleep(0.1)  # the silent peer's pull waits for its handshake's answer
        for i, peer in enumerate(peers):
            data = offer(peer, f"p{i}", seed=20 + i)
            started = time.monotonic()
            assert np.array_equal(pull(puller, peer.address, f"p{i}"), data)
            assert time.monotonic() - started < 2.0, f"peer {i} waited behind the silent one"
        result = puller.pull_result("never")
        assert result is not None and result.state is PullState.PENDING
    finally:
        for engine in (puller, *peers):
            engine.close()
        silent.close()
        for conn in accepted:
            conn.close()


def test_a_pull_not_offered_yet_does_not_hold_up_the_next_pull_from_its_peer(transport: str) -> None:
    """A transfer whose offer is not there yet (its prefill still runs, or its refused push is being offered) is
    tried again later; the peer's next pull, already offered, goes first."""
    offerer, puller = start(transport), start(transport)
    try:
        peer = Address.parse(offerer.address)
        waiting = np.zeros((LAYERS, BLOCKS * BLOCK_BYTES), np.uint8)
        puller.pull("late", peer, 0, BLOCKS, lambda layer, first, count: (
            waiting[layer][first * BLOCK_BYTES : (first + count) * BLOCK_BYTES].data,), time.monotonic() + 8)
        time.sleep(0.1)
        data = offer(offerer, "now", seed=3)
        started = time.monotonic()
        assert np.array_equal(pull(puller, offerer.address, "now"), data)
        assert time.monotonic() - started < 2.0
        late = offer(offerer, "late", seed=4)
        done = puller.wait_pull("late", 5)
        assert done is not None and done.state is PullState.DONE and np.array_equal(waiting, late)
    finally:
        puller.close()
        offerer.close()


def test_a_lane_idle_long_enough_ends_and_its_peer_gets_a_new_one() -> None:
    """Peers that went away (restarted on other ports, scaled down) hold no thread: an idle lane ends, letting its
    links go, and its peer's next pull gets a new lane."""
    offerer = start("tcp")
    extra = ExtraConfig(kv_host="127.0.0.1", transport=Transport.TCP, transfer_timeout_s=5)
    settings = replace(EngineSettings.from_config(extra, 0, 0), pull_lane_idle_s=0.3)  # not minutes
    puller = TransferEngine(settings, layout(LAYERS, BLOCK_BYTES))
    puller.start()
    try:
        data = offer(offerer, "one", seed=1)
        assert np.array_equal(pull(puller, offerer.address, "one"), data)
        assert sum(t.name == "p2pkv-puller" for t in threading.enumerate()) == 1
        deadline = time.monotonic() + 5
        while any(t.name == "p2pkv-puller" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(t.name == "p2pkv-puller" for t in threading.enumerate()), "the idle lane did not end"
        data = offer(offerer, "two", seed=2)
        assert np.array_equal(pull(puller, offerer.address, "two"), data)
    finally:
        puller.close()
        offerer.close()
