"""Frames that name another sender's transfer ids: a peer with the secret (or any peer, without one) must not fail,
fill, refer or delay a transfer that another connection began, and every push gets a verdict at once. Real engines
on loopback; the attacker speaks the wire protocol through a connection of its own."""

from __future__ import annotations

import time

import numpy as np

from p2pkv.engine import TransferEngine
from p2pkv.engine.sender import OutState
from p2pkv.engine.store import StageState
from p2pkv.integrity import digest
from p2pkv.params import Address
from p2pkv.protocol import PullInstead, PushAbort, PushAck, PushBlocks
from p2pkv.transport.base import Connection
from tests.helpers.attack import handshaken, landed_exact, listening, wait_for
from tests.helpers.peer import payload, start_engine
from tests.helpers.procs import BLOCK_BYTES, BLOCKS, LAYERS

SECRET = "transfer-ids-secret"
VERDICT_S = 3.0  # a verdict comes at once; before, one that never came was waited for to the push's deadline


def push(engine: TransferEngine, peer: Address, tid: str, seed: int, layers: range = range(LAYERS)) -> np.ndarray:
    """Queue these layers of a transfer; the caller keeps the bytes alive until it is done."""
    data = payload(seed, LAYERS, BLOCKS, BLOCK_BYTES)
    deadline = time.monotonic() + 10
    for layer in layers:
        engine.push_layer(tid, peer, layer, BLOCKS, (data[layer].data,), deadline)
    return data


def outcome(engine: TransferEngine, tid: str) -> tuple[OutState, str]:
    out = engine.wait_outgoing(tid, VERDICT_S)
    assert out is not None
    return out.state, out.reason


def forged_push(attacker: Connection, tid: str, layer: int) -> None:
    junk = memoryview(bytes(BLOCKS * BLOCK_BYTES))
    attacker.send_frame(PushBlocks(tid, layer, 0, BLOCKS, BLOCKS, LAYERS, 1, digest([junk])), (junk,),
                        time.monotonic() + 5)


def verdicts(attacker: Connection, within_s: float) -> list[PushAck]:
    """The verdicts the attacker's connection was sent within `within_s`."""
    out: list[PushAck] = []
    deadline = time.monotonic() + within_s
    while (got := attacker.recv_frame(max(0.0, deadline - time.monotonic()), deadline)) is not None:
        assert isinstance(got[0], PushAck)
        out.append(got[0])
    return out


def test_frames_naming_a_transfer_another_connection_began_leave_it_alone(engines: list[TransferEngine]) -> None:
    receiver = listening(SECRET)
    victim = start_engine(LAYERS, BLOCK_BYTES, SECRET)
    engines += [receiver, victim]
    peer = Address.parse(receiver.address)
    data = push(victim, peer, "victims", 11, range(1))
    assert wait_for(lambda: receiver.staged_state("victims") is StageState.RECEIVING, 5)
    attacker = handshaken(receiver.address, SECRET)
    attacker.send_frame(PullInstead("victims"), (), time.monotonic() + 5)
    attacker.send_frame(PushAbort("victims", "forged"), (), time.monotonic() + 5)
    forged_push(attacker, "victims", 1)  # a layer the victim has not sent yet
    acks = verdicts(attacker, 1.0)
    assert [(a.transfer_id, a.accepted) for a in acks] == [("victims", False)]
    assert "duplicate transfer id" in acks[0].reason and acks[0].duplicate
    push(victim, peer, "victims", 11, range(1, LAYERS))
    assert outcome(victim, "victims") == (OutState.DONE, "")
    assert landed_exact(receiver, "victims", data)
    assert receiver.metrics.totals().get("foreign_frames") == 3
    attacker.close()
    assert receiver.store.bytes_in_use == 0


def test_a_transfer_id_taken_first_by_another_connection_gets_a_refusal_at_once(
        engines: list[TransferEngine]) -> None:
    receiver = listening(SECRET)
    victim = start_engine(LAYERS, BLOCK_BYTES, SECRET)
    engines += [receiver, victim]
    attacker = handshaken(receiver.address, SECRET)
    attacker.send_frame(PullInstead("taken"), (), time.monotonic() + 5)
    assert wait_for(lambda: receiver.staged_state("taken") is not None, 5)
    data = push(victim, Address.parse(receiver.address), "taken", 12)
    state, reason = outcome(victim, "taken")
    # Failed, not refused: a refused push holds its blocks for a pull that no one would make.
    assert state is OutState.FAILED and "duplicate transfer id" in reason
    # The victim's next transfer is not disturbed.
    other = push(victim, Address.parse(receiver.address), "next", 13)
    assert outcome(victim, "next") == (OutState.DONE, "")
    assert landed_exact(receiver, "next", other)
    del data
    attacker.close()


def test_a_duplicate_transfer_id_gets_a_refusing_verdict_and_the_first_transfer_stands(
        engines: list[TransferEngine]) -> None:
    receiver = listening(SECRET)
    first, second = start_engine(LAYERS, BLOCK_BYTES, SECRET), start_engine(LAYERS, BLOCK_BYTES, SECRET)
    engines += [receiver, first, second]
    peer = Address.parse(receiver.address)
    data = push(first, peer, "twice", 21)
    assert outcome(first, "twice") == (OutState.DONE, "")
    assert receiver.wait_staged("twice", 5) is StageState.COMPLETE
    first.forget_outgoing("twice")
    again = [push(second, peer, "twice", 22), push(first, peer, "twice", 23)]  # another connection, then the same
    for engine in (second, first):
        state, reason = outcome(engine, "twice")
        assert state is OutState.FAILED and "duplicate transfer id" in reason, (state, reason)
    assert landed_exact(receiver, "twice", data)
    del again
    assert receiver.store.bytes_in_use == 0
