"""Engine tests with two real processes on loopback: this one receives, a helper process sends."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from p2pkv.config import parse_extra_config
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.engine import lower_switch_interval
from p2pkv.engine.handshake import client_handshake
from p2pkv.engine.offers import OfferState
from p2pkv.engine.sender import OutState, PushJob, _frames
from p2pkv.engine.store import StageState
from p2pkv.errors import ConfigError, IncompatiblePeerError
from p2pkv.params import Address
from p2pkv.protocol import FrameLimits, Hello, LayoutDigest, PushBlocks, encode_frame
from p2pkv.transport.base import Connection
from p2pkv.transport.split_read import SPLIT_FROM
from p2pkv.transport.tcp import TcpConnection
from tests.helpers.peer import TRANSPORT_ENV, engine_config, layout, payload, start_engine
from tests.helpers.procs import BLOCK_BYTES, BLOCKS, HELPER, LAYERS, ROOT, Offerer, Peer


def run_helper(*args: str, timeout: float = 60) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(HELPER), *args], capture_output=True, text=True, timeout=timeout,
                         env=env, check=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def wait_state(engine: TransferEngine, tid: str, timeout: float = 10) -> StageState | None:
    return engine.wait_staged(tid, timeout)


def p2pkv_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("p2pkv-")]


@pytest.fixture(autouse=True, params=["tcp", "shm"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every engine test runs over both transports, in this process and in its helper processes."""
    monkeypatch.setenv(TRANSPORT_ENV, request.param)
    name: str = request.param
    return name


def received_over(engine: TransferEngine, transport: str) -> float:
    return engine.metrics.registry.get_sample_value("p2pkv_bytes_received_total", {"transport": transport}) or 0.0


@pytest.fixture
def receiver() -> Iterator[TransferEngine]:
    settings = EngineSettings.from_config(engine_config(kv_host="127.0.0.1", transfer_timeout_s=5), 0, 0)
    engine = TransferEngine(settings, layout(LAYERS, BLOCK_BYTES))
    engine.start()
    yield engine
    engine.close()
    assert p2pkv_threads() == [], "engine threads outlived close()"


def take_and_check(receiver: TransferEngine, tid: str, seed: int, layers: int, blocks: int, block_bytes: int) -> None:
    """The staged transfer completed with exactly the bytes the helper pushed for `seed`; released after."""
    assert wait_state(receiver, tid) is StageState.COMPLETE
    item = receiver.take_staged(tid)
    assert item is not None
    expected = payload(seed, layers, blocks, block_bytes)
    for layer in range(layers):
        assert bytes(item.layer_view(layer)) == expected[layer].tobytes()
    receiver.release_staged(item)


def test_push_lands_exact_bytes(receiver: TransferEngine, transport: str) -> None:
    result = run_helper("push", receiver.address, "t-1", "7", str(LAYERS), str(BLOCKS), str(BLOCK_BYTES))
    assert result["state"] == "done"
    assert result["bytes"] == LAYERS * BLOCKS * BLOCK_BYTES
    take_and_check(receiver, "t-1", 7, LAYERS, BLOCKS, BLOCK_BYTES)
    assert receiver.store.bytes_in_use == 0
    assert receiver.metrics.totals()["bytes_received"] == LAYERS * BLOCKS * BLOCK_BYTES
    assert received_over(receiver, transport) == LAYERS * BLOCKS * BLOCK_BYTES


def test_a_large_push_lands_exact_bytes_and_shm_copies_it_on_two_threads(transport: str) -> None:
    layers, blocks, block_bytes = 2, 3, 4 << 20  # 12 MiB a layer: every frame is at least SPLIT_FROM
    assert blocks * block_bytes >= SPLIT_FROM
    settings = EngineSettings.from_config(engine_config(kv_host="127.0.0.1", transfer_timeout_s=10), 0, 0)
    receiver = TransferEngine(settings, layout(layers, block_bytes))
    receiver.start()
    peer = Peer(layers=layers, block_bytes=block_bytes, blocks=blocks)
    try:
        result = peer.push(receiver.address, "big", seed=5)
        assert result["state"] == "done", result
        take_and_check(receiver, "big", 5, layers, blocks, block_bytes)
        # The link is still open: over shm its reader shared the copy with a helper thread; tcp has none.
        helpers = [name for name in p2pkv_threads() if name.startswith("p2pkv-copy-")]
        assert len(helpers) == (1 if transport == "shm" else 0), helpers
    finally:
        peer.close()
        receiver.close()
    assert p2pkv_threads() == [], "engine threads outlived close()"


def test_jobs_of_several_layers_make_frames_of_consecutive_layers() -> None:
    """A job of several layers (`push_layers`) goes in one frame, merged with the jobs of the layers right after it;
    a gap, another transfer or another block count starts a new frame. The views go in layer order."""
    peer, views = Address("127.0.0.1", 1), [(memoryview(bytes([i])),) for i in range(8)]

    def job(tid: str, layer: int, layers: int = 1, blocks: int = 2) -> PushJob:
        return PushJob(tid, peer, layer, 8, blocks, tuple(v for vs in views[layer : layer + layers] for v in vs), 0.0,
                       layers=layers)

    jobs = [job("a", 0, 3), job("a", 3, 2), job("a", 5), job("a", 7), job("b", 7), job("a", 6, blocks=3)]
    frames = _frames(jobs)
    assert [(f.transfer_id, f.layer, f.layers, f.num_blocks) for f, _ in frames] == [
        ("a", 0, 6, 2), ("a", 7, 1, 2), ("b", 7, 1, 2), ("a", 6, 1, 3)]
    assert [bytes(v)[0] for v in frames[0][1]] == [0, 1, 2, 3, 4, 5]
    assert [bytes(v)[0] for v in frames[1][1]] == [7]


def test_layers_pushed_together_and_alone_land_exact_bytes() -> None:
    """Layers 0-1 together, 2 alone, 3-5 together: the transfer completes with every layer's bytes."""
    layers = 6
    settings = EngineSettings.from_config(engine_config(kv_host="127.0.0.1", transfer_timeout_s=10), 0, 0)
    receiver = TransferEngine(settings, layout(layers, BLOCK_BYTES))
    receiver.start()
    engine = start_engine(layers, BLOCK_BYTES)
    try:
        data = payload(11, layers, BLOCKS, BLOCK_BYTES)
        rows = [(data[layer].data,) for layer in range(layers)]
        peer, deadline = Address.parse(receiver.address), time.monotonic() + 20
        engine.push_layers("mixed", peer, 0, BLOCKS, rows[:2], deadline)
        engine.push_layer("mixed", peer, 2, BLOCKS, rows[2], deadline)
        engine.push_layers("mixed", peer, 3, BLOCKS, rows[3:], deadline)
        out = engine.wait_outgoing("mixed", 20)
        assert out is not None and out.state is OutState.DONE, out
        assert out.nbytes == layers * BLOCKS * BLOCK_BYTES
        take_and_check(receiver, "mixed", 11, layers, BLOCKS, BLOCK_BYTES)
    finally:
        engine.close()
        receiver.close()


def test_layout_mismatch_is_refused_with_the_difference(receiver: TransferEngine) -> None:
    result = run_helper("push", receiver.address, "t-2", "1", str(LAYERS), str(BLOCKS), str(BLOCK_BYTES * 2))
    assert result["state"] == "failed"
    assert "KV layout mismatch: block_bytes: ours 4096, peer 8192" in str(result["reason"])
    assert receiver.staged_state("t-2") is None


def test_chunks_of_a_refused_push_stay_dropped_after_a_load_took_its_record(receiver: TransferEngine) -> None:
    """A push refused as a duplicate (its id was received already) whose record a load then took: its later chunks,
    sent before the refusal reached the sender, are dropped, and do not begin a new transfer held until expiry."""
    deadline = time.monotonic() + 5
    conn = client_handshake(TcpConnection.connect(Address.parse(receiver.address), deadline, b"", FrameLimits()),
                            Hello("e", 0, layout(LAYERS, BLOCK_BYTES)), deadline)
    try:
        data = payload(1, LAYERS, BLOCKS, BLOCK_BYTES)
        whole = PushBlocks("dup", 0, 0, BLOCKS, BLOCKS, LAYERS, LAYERS)
        conn.send_frames([(whole, [layer.data for layer in data])], deadline)
        assert wait_state(receiver, "dup") is StageState.COMPLETE
        conn.send_frames([(PushBlocks("dup", 0, 0, BLOCKS, BLOCKS, LAYERS), [data[0].data])], deadline)
        verdicts = [conn.recv_frame(5, deadline) for _ in range(2)]  # the first push's, then the refusal
        assert [(v[0].accepted, v[0].duplicate) for v in verdicts if v is not None] == [(True, False), (False, True)]
        item = receiver.take_staged("dup")  # a load takes the transfer received first
        assert item is not None
        receiver.release_staged(item)
        conn.send_frames([(PushBlocks("dup", 1, 0, BLOCKS, BLOCKS, LAYERS), [data[1].data]),
                          (PushBlocks("probe", 0, 0, BLOCKS, BLOCKS, LAYERS, LAYERS), [layer.data for layer in data])],
                         deadline)
        assert wait_state(receiver, "probe") is StageState.COMPLETE  # frames are read in order: "dup" came first
        assert receiver.staged_state("dup") is None
        assert receiver.store.bytes_in_use == LAYERS * BLOCKS * BLOCK_BYTES  # the probe's, nothing for "dup"
    finally:
        conn.close()


def test_a_refused_peer_is_noted_by_the_listener_it_names_until_a_hello_from_there_is_accepted(
        receiver: TransferEngine) -> None:
    # A load of KV that the refused peer was to push can then fail at once (tests/unit/test_worker_tp.py).
    peer = Address("10.9.8.7", 4100)

    def hello(block_bytes: int) -> Connection:
        deadline = time.monotonic() + 5
        conn = TcpConnection.connect(Address.parse(receiver.address), deadline, b"", FrameLimits())
        return client_handshake(conn, Hello("e", 0, layout(LAYERS, block_bytes), kv_address=str(peer)), deadline)

    receiver.offer("before", 2, lambda layer, first, count: (), 60.0, pulled_by=(peer,))
    with pytest.raises(IncompatiblePeerError):
        hello(BLOCK_BYTES * 2)
    assert "KV layout mismatch: block_bytes: ours 4096, peer 8192" in str(receiver.refusal(peer))
    assert receiver.refusal(peer.offset(1)) is None  # another listener on that host was not refused
    # GET: blocks held for that peer to pull are freed at its refusal, and at once when offered after it.
    receiver.offer("after", 2, lambda layer, first, count: (), 60.0, pulled_by=(peer.offset(1), peer))
    receiver.offer("other", 2, lambda layer, first, count: (), 60.0, pulled_by=(peer.offset(1),))
    assert [receiver.offer_state(t) for t in ("before", "after", "other")] == [
        OfferState.EXPIRED, OfferState.EXPIRED, OfferState.OFFERED]
    hello(BLOCK_BYTES).close()
    assert receiver.refusal(peer) is None


def _raw(address: str, data: bytes) -> None:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(data)
        s.settimeout(5)
        try:
            while s.recv(4096):
                pass
        except OSError:
            pass


def test_garbage_is_counted_and_dropped(receiver: TransferEngine) -> None:
    _raw(receiver.address, os.urandom(4096))
    _raw(receiver.address, b"P2KV" + bytes(60))
    # A frame claiming a payload of 2**60 bytes: refused before anything is allocated from that size.
    huge = bytearray(encode_frame(PushBlocks("t", 0, 0, 1, 1, 1), 0, b""))
    huge[12:20] = (1 << 60).to_bytes(8, "big")
    _raw(receiver.address, bytes(huge))
    # Another protocol version.
    other = bytearray(encode_frame(PushBlocks("t", 0, 0, 1, 1, 1), 0, b""))
    other[4:6] = (99).to_bytes(2, "big")
    _raw(receiver.address, bytes(other))
    deadline = time.monotonic() + 5
    while receiver.metrics.totals().get("bad_frames", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert receiver.metrics.totals()["bad_frames"] == 4
    assert receiver.store.bytes_in_use == 0
    result = run_helper("push", receiver.address, "t-3", "3", str(LAYERS), str(BLOCKS), str(BLOCK_BYTES))
    assert result["state"] == "done"
    assert wait_state(receiver, "t-3") is StageState.COMPLETE


def test_sender_killed_mid_transfer_fails_the_transfer_promptly() -> None:
    settings = EngineSettings.from_config(engine_config(kv_host="127.0.0.1", transfer_timeout_s=30), 0, 0)
    engine = TransferEngine(settings, LayoutDigest(1, 16, BLOCK_BYTES, "uint8", (BLOCK_BYTES,), "test"))
    engine.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(HELPER), "stall", engine.address, "t-4", str(BLOCK_BYTES)],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["state"] == "stalled"
        assert wait_state(engine, "t-4", timeout=5) is StageState.RECEIVING
        killed = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        assert wait_state(engine, "t-4", timeout=10) is StageState.FAILED
        assert time.monotonic() - killed < 5, "a dead sender must fail its transfers well before the deadline"
        assert engine.store.bytes_in_use == 0
    finally:
        proc.kill()
        proc.wait()
        engine.close()


def _receiver(port: int = 0, secret: str = "") -> TransferEngine:
    settings = EngineSettings.from_config(engine_config(kv_host="127.0.0.1", transfer_timeout_s=5, auth_secret=secret),
                                          port, 0)
    engine = TransferEngine(settings, layout(LAYERS, BLOCK_BYTES))
    engine.start()
    return engine


def test_receiver_restarted_on_the_same_address_gets_the_next_transfers() -> None:
    first = _receiver()
    port = int(first.address.rsplit(":", 1)[1])
    peer = Peer()
    try:
        assert peer.push(first.address, "before")["state"] == "done"
        assert wait_state(first, "before") is StageState.COMPLETE
        first.close()
        second = _receiver(port)
        try:
            # The sender's cached connection is stale; it must notice and reconnect, losing nothing.
            assert peer.push(second.address, "after", seed=5)["state"] == "done"
            assert wait_state(second, "after") is StageState.COMPLETE
            item = second.take_staged("after")
            assert item is not None
            assert bytes(item.layer_view(2)) == payload(5, LAYERS, BLOCKS, BLOCK_BYTES)[2].tobytes()
        finally:
            second.close()
    finally:
        peer.close()


def test_receiver_down_fails_the_push_within_its_deadline() -> None:
    dead = _receiver()
    address = dead.address
    dead.close()
    peer = Peer()
    try:
        started = time.monotonic()
        result = peer.push(address, "nobody-home")
        assert result["state"] == "failed"
        assert "cannot connect" in str(result["reason"])
        assert time.monotonic() - started < 20
    finally:
        peer.close()


def test_frames_without_the_shared_secret_are_refused_and_counted() -> None:
    engine = _receiver(secret="right")
    try:
        for secret in ("", "wrong"):
            peer = Peer(secret)
            try:
                result = peer.push(engine.address, f"forged-{secret}")
                assert result["state"] == "failed"
            finally:
                peer.close()
        assert engine.metrics.totals()["bad_frames"] == 2
        assert engine.staged_state("forged-") is None and engine.staged_state("forged-wrong") is None
        good = Peer("right")
        try:
            assert good.push(engine.address, "signed")["state"] == "done"
            assert wait_state(engine, "signed") is StageState.COMPLETE
        finally:
            good.close()
    finally:
        engine.close()


def _wait_pull(engine: TransferEngine, tid: str) -> str:
    result = engine.wait_pull(tid, 15)
    assert result is not None
    return "pending" if result.state.value == "pending" else f"{result.state.value} {result.reason}"


def test_pull_lands_the_requested_blocks_in_place_and_frees_the_offer(receiver: TransferEngine,
                                                                     transport: str) -> None:
    offerer = Offerer("g-1", seed=11, lease_s=30)
    try:
        assert offerer.state("g-1") == "offered"
        local = [bytearray(3 * BLOCK_BYTES) for _ in range(LAYERS)]

        def sink(layer: int, first: int, count: int) -> tuple[memoryview, ...]:
            return (memoryview(local[layer])[first * BLOCK_BYTES : (first + count) * BLOCK_BYTES],)

        from p2pkv.params import Address

        receiver.pull("g-1", Address.parse(offerer.address), 2, 3, sink, time.monotonic() + 10)
        assert _wait_pull(receiver, "g-1") == "done "
        expected = payload(11, LAYERS, BLOCKS, BLOCK_BYTES)
        for layer in range(LAYERS):
            assert bytes(local[layer]) == expected[layer][2 * BLOCK_BYTES : 5 * BLOCK_BYTES].tobytes()
        assert offerer.wait_state("g-1", "served") == "served"
        assert received_over(receiver, transport) == 3 * BLOCK_BYTES * LAYERS
        # A second pull of the same transfer is refused: the blocks were released.
        receiver.pull("g-1", Address.parse(offerer.address), 0, 1, sink, time.monotonic() + 10)
        assert _wait_pull(receiver, "g-1").startswith("failed")
    finally:
        offerer.close()


def test_lease_expires_when_nobody_pulls(receiver: TransferEngine) -> None:
    offerer = Offerer("g-2", seed=1, lease_s=0.5)
    try:
        time.sleep(1.0)
        assert offerer.state("g-2") == "expired"
        from p2pkv.params import Address

        sink_buf = bytearray(BLOCK_BYTES)
        receiver.pull("g-2", Address.parse(offerer.address), 0, 1, lambda *_: (memoryview(sink_buf),),
                      time.monotonic() + 10)
        assert "transfer is expired" in _wait_pull(receiver, "g-2")
    finally:
        offerer.close()


def _small_receiver(buffer_bytes: int, pool_gb: float, expiry_s: float = 120) -> TransferEngine:
    extra = engine_config(kv_host="127.0.0.1", transfer_timeout_s=5, kv_buffer_size=buffer_bytes,
                        mem_pool_size_gb=pool_gb, staging_expiry_s=expiry_s)
    engine = TransferEngine(EngineSettings.from_config(extra, 0, 0), layout(LAYERS, BLOCK_BYTES))
    engine.start()
    return engine


def test_staging_spills_into_the_pool_beyond_kv_buffer_size() -> None:
    engine = _small_receiver(BLOCK_BYTES, pool_gb=0.001)
    try:
        assert engine.pool is not None and not engine.pool.allocated  # nothing taken at start-up
        assert run_helper("push", engine.address, "s-1", "4", str(LAYERS), str(BLOCKS), str(BLOCK_BYTES))[
            "state"] == "done"
        assert wait_state(engine, "s-1") is StageState.COMPLETE
        assert engine.store.pool_bytes_in_use >= LAYERS * BLOCKS * BLOCK_BYTES
        assert engine.store.bytes_in_use == 0
        item = engine.take_staged("s-1")
        assert item is not None
        assert bytes(item.layer_view(1)) == payload(4, LAYERS, BLOCKS, BLOCK_BYTES)[1].tobytes()
        engine.release_staged(item)
        assert engine.store.pool_bytes_in_use == 0
    finally:
        engine.close()


def test_push_without_space_is_refused_so_the_sender_can_fall_back_to_get() -> None:
    engine = _small_receiver(BLOCK_BYTES, pool_gb=0)
    try:
        result = run_helper("push", engine.address, "s-2", "4", str(LAYERS), str(BLOCKS), str(BLOCK_BYTES))
        assert result["state"] == "refused"
        assert "no staging space" in str(result["reason"])
        assert engine.staged_state("s-2") is StageState.FAILED
        assert engine.store.reason("s-2").startswith("no staging space")
        assert engine.store.bytes_in_use == 0
    finally:
        engine.close()


def test_staging_nobody_claims_expires() -> None:
    engine = _small_receiver(1 << 20, pool_gb=0, expiry_s=0.5)
    try:
        assert run_helper("push", engine.address, "s-3", "4", str(LAYERS), str(BLOCKS), str(BLOCK_BYTES))[
            "state"] == "done"
        assert engine.store.bytes_in_use == LAYERS * BLOCKS * BLOCK_BYTES
        time.sleep(0.7)
        engine.housekeeping()
        assert engine.staged_state("s-3") is None
        assert engine.store.bytes_in_use == 0
    finally:
        engine.close()


def test_a_push_whose_layers_come_slowly_lives_until_its_last_layers_deadline(receiver: TransferEngine) -> None:
    # A long forward pass on a CPU: each layer is pushed with its own deadline as it is computed, and the transfer
    # must not fail at the first layer's while later layers are still on their way.
    sender = start_engine(LAYERS, BLOCK_BYTES)
    try:
        peer = Address.parse(receiver.address)
        data = payload(3, LAYERS, BLOCKS, BLOCK_BYTES)
        for layer in range(LAYERS):
            if layer:
                time.sleep(1.2)  # the first layer's deadline passes at the second check, the others' never do
                sender.housekeeping()
            sender.push_layer("slow", peer, layer, BLOCKS, (data[layer].data,), time.monotonic() + 2.0)
        out = sender.wait_outgoing("slow", 10)
        assert out is not None and out.state is OutState.DONE, out
        take_and_check(receiver, "slow", 3, LAYERS, BLOCKS, BLOCK_BYTES)
    finally:
        sender.close()


def test_binding_a_public_address_without_a_secret_warns(caplog: pytest.LogCaptureFixture) -> None:
    settings = EngineSettings.from_config(engine_config(kv_host="0.0.0.0"), 0, 0)
    engine = TransferEngine(settings, layout(LAYERS, BLOCK_BYTES))
    with caplog.at_level("WARNING", logger="p2pkv.engine.engine"):
        engine.start()
    engine.close()
    assert any("without auth_secret" in r.message for r in caplog.records)
    caplog.clear()
    quiet = TransferEngine(EngineSettings.from_config(engine_config(kv_host="0.0.0.0", auth_secret="s"), 0, 0),
                           layout(LAYERS, BLOCK_BYTES))
    with caplog.at_level("WARNING", logger="p2pkv.engine.engine"):
        quiet.start()
    quiet.close()
    assert not any("without auth_secret" in r.message for r in caplog.records)


def test_an_engine_lowers_the_interpreter_switch_interval_at_start_and_never_raises_it() -> None:
    """A thread that runs Python without pause (vLLM's) keeps the interpreter lock for the switch interval each time
    an engine thread wants it back after a system call: 5 ms by default, far longer than a small transfer."""
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        assert EngineSettings.from_config(parse_extra_config({}), 0, 0).switch_interval_s == 0.0005
        assert EngineSettings.from_config(parse_extra_config({"switch_interval_ms": 0}), 0, 0).switch_interval_s == 0
        with pytest.raises(ConfigError, match="switch_interval_ms"):
            parse_extra_config({"switch_interval_ms": -1})
        engine = start_engine(2, 64)
        try:
            assert sys.getswitchinterval() == pytest.approx(0.0005)
        finally:
            engine.close()
        lower_switch_interval(0.002)  # higher than the current one: left as it is
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        sys.setswitchinterval(0.005)
        lower_switch_interval(0.0)  # 0: left alone
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)
