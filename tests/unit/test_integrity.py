"""integrity_check: payload digests, checked where the bytes land, between real processes over real sockets."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash

from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.handshake import client_handshake
from p2pkv.engine.store import StageState
from p2pkv.errors import ProtocolError
from p2pkv.integrity import DigestMismatch, digest, frame_mismatch
from p2pkv.params import Address
from p2pkv.protocol import FrameLimits, Hello, PushBlocks
from p2pkv.transport.base import Connection
from p2pkv.transport.tcp import TcpConnection
from tests.helpers.peer import SCRIBBLE_ENV, TRANSPORT_ENV, engine_config, layout, payload
from tests.helpers.procs import BLOCK_BYTES, BLOCKS, LAYERS, Offerer, Peer
from tests.helpers.relay import FlipRelay

MISMATCH = "do not match the sender's digest"


def test_the_digest_of_views_is_the_digest_of_their_bytes_in_order() -> None:
    data = np.random.default_rng(3).integers(0, 256, 10_000, np.uint8)
    pieces = [memoryview(data[:1]), memoryview(data[1:4097]), memoryview(data[4097:])]
    assert digest(pieces) == xxhash.xxh3_64_intdigest(data.tobytes())
    push = PushBlocks("t", 2, 0, 1, 1, 8, 3, digest(pieces))
    assert frame_mismatch(push, xxhash.xxh3_64_intdigest(data.tobytes())) is None
    data[5000] ^= 1
    bad = frame_mismatch(push, digest([memoryview(data)]))
    assert isinstance(bad, DigestMismatch) and "transfer t layers 2-5" in str(bad)
    with pytest.raises(ProtocolError):
        frame_mismatch(PushBlocks("t", 0, 0, 1, 1, 1), 0)


def receiver_engine(integrity: bool) -> TransferEngine:
    settings = EngineSettings.from_config(
        engine_config(kv_host="127.0.0.1", transfer_timeout_s=5, integrity_check=integrity), 0, 0)
    engine = TransferEngine(settings, layout(LAYERS, BLOCK_BYTES))
    engine.start()
    return engine


def totals(engine: TransferEngine) -> tuple[float, float]:
    """(payloads whose digest matched, payloads dropped for a mismatch)."""
    got = engine.metrics.totals()
    return got.get("digests_ok", 0.0), got.get("digest_mismatches", 0.0)


def landed(engine: TransferEngine, tid: str, seed: int) -> bytes | None:
    """The staged bytes of a completed push, all layers; None if the transfer did not complete."""
    if engine.wait_staged(tid, 10) is not StageState.COMPLETE:
        return None
    item = engine.take_staged(tid)
    assert item is not None
    try:
        return b"".join(bytes(item.layer_view(layer)) for layer in range(LAYERS))
    finally:
        engine.release_staged(item)


def sent(seed: int, blocks: int = BLOCKS) -> bytes:
    return payload(seed, LAYERS, blocks, BLOCK_BYTES).tobytes()


@pytest.fixture(params=["tcp", "shm"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(TRANSPORT_ENV, request.param)
    name: str = request.param
    return name


@pytest.fixture
def checking() -> Iterator[TransferEngine]:
    engine = receiver_engine(integrity=True)
    yield engine
    engine.close()


def test_a_sender_whose_bytes_change_after_the_digest_loses_that_transfer_only(
        checking: TransferEngine, transport: str) -> None:
    """Only the receiver asks for checks; the sender (default config) takes digests because the link agreed them.
    Its bytes of one transfer change between the digest and the receiver's copy (shm reads them in place)."""
    peer = Peer(env={SCRIBBLE_ENV: "bad"})
    try:
        peer.push(checking.address, "bad", seed=2)
        assert checking.wait_staged("bad", 10) is StageState.FAILED
        assert MISMATCH in checking.store.reason("bad")
        assert totals(checking)[1] >= 1
        # The link stays up and the next transfer lands whole, checked.
        assert peer.push(checking.address, "good", seed=3)["state"] == "done"
        assert landed(checking, "good", 3) == sent(3)
        assert totals(checking)[0] >= 1
        assert checking.metrics.registry.get_sample_value(
            "p2pkv_digests_total", {"direction": "receive", "outcome": "mismatch"}) == totals(checking)[1]
    finally:
        peer.close()
    assert checking.store.bytes_in_use == 0


@pytest.fixture
def over_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a relay the bytes must travel on the socket: over shm the receiver would read the sender's memory."""
    monkeypatch.setenv(TRANSPORT_ENV, "tcp")


@pytest.mark.parametrize("integrity", [True, False])
def test_a_byte_flipped_on_the_wire_fails_the_push_only_with_integrity_check(over_tcp: None,
                                                                            integrity: bool) -> None:
    receiver = receiver_engine(integrity)
    relay = FlipRelay(receiver.address, at=40_000, upstream=True)  # inside the payload (60 KiB after ~1 KiB)
    peer = Peer()
    try:
        peer.push(relay.address, "hit", seed=4)
        assert relay.flipped.wait(10)
        if integrity:
            assert receiver.wait_staged("hit", 10) is StageState.FAILED
            assert MISMATCH in receiver.store.reason("hit")
            assert totals(receiver)[1] == 1
        else:  # the negative control: the damage lands unseen
            got = landed(receiver, "hit", 4)
            assert got is not None and got != sent(4)
            assert sum(a != b for a, b in zip(got, sent(4), strict=True)) == 1
            assert totals(receiver) == (0.0, 0.0)
        assert peer.push(relay.address, "after", seed=5)["state"] == "done"
        assert landed(receiver, "after", 5) == sent(5)
    finally:
        peer.close()
        relay.close()
        receiver.close()


@pytest.mark.parametrize("integrity", [True, False])
def test_a_byte_flipped_on_the_wire_fails_the_pull_only_with_integrity_check(over_tcp: None,
                                                                            integrity: bool) -> None:
    offerer = Offerer("g", seed=6, lease_s=30)
    relay = FlipRelay(offerer.address, at=20_000, upstream=False)  # inside the 36 KiB reply
    puller = receiver_engine(integrity)
    local = [bytearray(3 * BLOCK_BYTES) for _ in range(LAYERS)]

    def sink(layer: int, first: int, count: int) -> tuple[memoryview, ...]:
        return (memoryview(local[layer])[first * BLOCK_BYTES : (first + count) * BLOCK_BYTES],)

    try:
        puller.pull("g", Address.parse(relay.address), 2, 3, sink, time.monotonic() + 10)
        result = puller.wait_pull("g", 15)
        assert result is not None and relay.flipped.is_set()
        expected = b"".join(row[2 * BLOCK_BYTES : 5 * BLOCK_BYTES].tobytes() for row in payload(6, LAYERS, BLOCKS,
                                                                                                 BLOCK_BYTES))
        if integrity:
            assert result.state.value == "failed" and MISMATCH in result.reason, result
            assert puller.metrics.registry.get_sample_value(
                "p2pkv_digests_total", {"direction": "pull", "outcome": "mismatch"}) == 1
        else:
            assert result.state.value == "done", result
            assert sum(a != b for a, b in zip(b"".join(local), expected, strict=True)) == 1
    finally:
        puller.close()
        relay.close()
        offerer.close()


def test_pulls_on_a_checking_link_land_whole_and_are_counted(checking: TransferEngine, transport: str) -> None:
    """The offerer has the default config: it digests what it serves because the puller asked at the handshake."""
    offerer = Offerer("p", seed=8, lease_s=30)
    local = [bytearray(BLOCKS * BLOCK_BYTES) for _ in range(LAYERS)]

    def sink(layer: int, first: int, count: int) -> tuple[memoryview, ...]:
        return (memoryview(local[layer])[first * BLOCK_BYTES : (first + count) * BLOCK_BYTES],)

    try:
        checking.pull("p", Address.parse(offerer.address), 0, BLOCKS, sink, time.monotonic() + 10)
        result = checking.wait_pull("p", 15)
        assert result is not None and result.state.value == "done", result
        assert b"".join(local) == sent(8)
        assert checking.metrics.registry.get_sample_value(
            "p2pkv_digests_total", {"direction": "pull", "outcome": "ok"}) == 1
    finally:
        offerer.close()


def test_a_push_without_a_digest_on_a_checking_link_is_a_bad_frame(checking: TransferEngine) -> None:
    conn: Connection = TcpConnection.connect(Address.parse(checking.address), time.monotonic() + 5, b"",
                                             FrameLimits())
    try:
        conn = client_handshake(conn, Hello("raw", 0, layout(LAYERS, BLOCK_BYTES)), time.monotonic() + 5)
        body = memoryview(bytes(BLOCKS * BLOCK_BYTES))
        conn.send_frame(PushBlocks("bare", 0, 0, BLOCKS, BLOCKS, LAYERS), (body,), time.monotonic() + 5)
        deadline = time.monotonic() + 10
        while checking.metrics.totals().get("bad_frames", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert checking.metrics.totals().get("bad_frames") == 1
        assert checking.staged_state("bare") is not StageState.COMPLETE
    finally:
        conn.close()
