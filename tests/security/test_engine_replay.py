"""Replay: an attacker without the secret who recorded a victim's signed frames (a man in the middle on loopback)
plays them again, on a new connection, into the victim's own connection or into its next one, or swaps a payload
under a signed header. Real engines; frames as the victim's engine sent them."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from p2pkv.engine import TransferEngine
from p2pkv.engine.sender import OutState
from p2pkv.engine.store import StageState
from p2pkv.params import Address
from p2pkv.protocol import Hello, encode_frame
from tests.helpers.attack import Recorder, closed_by_peer, frames, landed_exact, listening, raw, wait_for
from tests.helpers.peer import TRANSPORT_ENV, layout, payload
from tests.helpers.procs import BLOCK_BYTES, BLOCKS, LAYERS
from tests.helpers.relay import FlipRelay

SECRET = "replay-secret"


@pytest.fixture(autouse=True)
def over_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Payload bytes on the wire, where the man in the middle sees them (shm reads them from the sender)."""
    monkeypatch.setenv(TRANSPORT_ENV, "tcp")


def push(engine: TransferEngine, peer: str, tid: str, seed: int) -> tuple[OutState, np.ndarray]:
    data = payload(seed, LAYERS, BLOCKS, BLOCK_BYTES)
    deadline = time.monotonic() + 5
    for layer in range(LAYERS):
        engine.push_layer(tid, Address.parse(peer), layer, BLOCKS, (data[layer].data,), deadline)
    out = engine.wait_outgoing(tid, 6)
    assert out is not None
    return out.state, data


def bad_frames(engine: TransferEngine) -> float:
    return engine.metrics.totals().get("bad_frames", 0.0)


def test_a_recorded_hello_played_again_is_refused_without_a_word(engines: list[TransferEngine]) -> None:
    receiver, victim = listening(SECRET), listening(SECRET)
    engines += [receiver, victim]
    mitm = Recorder(receiver.address)
    try:
        state, data = push(victim, mitm.address, "recorded", 31)
        assert state is OutState.DONE and landed_exact(receiver, "recorded", data)
        recorded = frames(bytes(mitm.sent[0]))
    finally:
        mitm.close()
    replay = raw(receiver.address)
    replay.sendall(b"".join(recorded))  # the hello, then the transfer's frames
    replay.settimeout(3)
    assert replay.recv(1 << 16) == b"", "a hello played again was answered"
    replay.close()
    assert wait_for(lambda: bad_frames(receiver) == 1, 3)
    assert receiver.staged_state("recorded") is None


def test_recorded_frames_played_into_the_same_or_the_next_connection_fail_authentication(
        engines: list[TransferEngine]) -> None:
    receiver, victim = listening(SECRET), listening(SECRET)
    engines += [receiver, victim]
    mitm = Recorder(receiver.address)
    try:
        state, data = push(victim, mitm.address, "once", 41)
        assert state is OutState.DONE and landed_exact(receiver, "once", data)
        recorded = b"".join(frames(bytes(mitm.sent[0]))[1:])  # the transfer's frames, after the hello
        mitm.inject(recorded)  # again, in sequence after the frames already sent on that connection
        assert wait_for(lambda: bad_frames(receiver) == 1, 3), "frames played again were taken"
        assert receiver.staged_state("once") is None
        state, data = push(victim, mitm.address, "next", 42)  # on a new connection: the old one was dropped
        assert state is OutState.DONE and landed_exact(receiver, "next", data)
        assert len(mitm.sent) == 2
        mitm.inject(recorded)  # into the new connection, at the sequence numbers they were signed with
        assert wait_for(lambda: bad_frames(receiver) == 2, 3), "frames moved to another connection were taken"
        assert receiver.staged_state("once") is None
    finally:
        mitm.close()
    assert receiver.store.bytes_in_use == 0


def test_a_payload_swapped_under_a_signed_header_is_not_staged(engines: list[TransferEngine]) -> None:
    receiver, victim = listening(SECRET), listening(SECRET)  # integrity_check off: the secret alone covers payloads
    engines += [receiver, victim]
    relay = FlipRelay(receiver.address, at=30_000, upstream=True)  # a byte in the payload of the first transfer
    try:
        state, _ = push(victim, relay.address, "swapped", 51)
        assert relay.flipped.wait(5)
        assert receiver.wait_staged("swapped", 5) is StageState.FAILED
        assert "do not match" in receiver.staged_reason("swapped")
        state, data = push(victim, relay.address, "clean", 52)
        assert state is OutState.DONE and landed_exact(receiver, "clean", data)
    finally:
        relay.close()
    assert receiver.store.bytes_in_use == 0


def test_a_peer_with_the_wrong_secret_learns_nothing_and_both_sides_say_authentication_failed(
        engines: list[TransferEngine], caplog: pytest.LogCaptureFixture) -> None:
    receiver, stranger = listening(SECRET), listening("not-the-secret")
    engines += [receiver, stranger]
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        forged = raw(receiver.address)
        forged.sendall(encode_frame(Hello("stranger", 0, layout(LAYERS, BLOCK_BYTES)), 0, b"guess"))
        forged.settimeout(3)
        assert forged.recv(1 << 16) == b"", "a hello with the wrong secret was answered"
        forged.close()
    state, _ = push(stranger, receiver.address, "stranger", 61)
    out = stranger.outgoing("stranger")
    assert state is OutState.FAILED and out is not None and "authentication failed" in out.reason, out
    assert wait_for(lambda: bad_frames(receiver) == 4, 3)
    lines = [r.getMessage() for r in caplog.records if "bad frame" in r.getMessage()]
    assert len(lines) == 1 and "authentication failed" in lines[0] and "such since the last line" in lines[0], lines
    still = raw(receiver.address)
    assert not closed_by_peer(still, 0.1)  # the listener still serves
    still.close()
