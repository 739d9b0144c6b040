"""The KV listener under abuse: out of threads, out of descriptors, flooded with connections, held by idle ones.
Real engines on loopback; the attackers are raw sockets and connections through the hello."""

from __future__ import annotations

import time

import numpy as np

from p2pkv.engine import TransferEngine
from p2pkv.errors import TransferError
from p2pkv.params import Address
from tests.helpers.attack import closed_by_peer, handshaken, landed_exact, listening, raw, wait_for
from tests.helpers.peer import payload, push_with, start_engine
from tests.helpers.procs import BLOCK_BYTES, BLOCKS, LAYERS
from tests.helpers.starvable import Starvable

SECRET = "listener-secret"


def seeded(seed: int) -> np.ndarray:
    """What `push_with` sends for `seed`."""
    return payload(seed, LAYERS, BLOCKS, BLOCK_BYTES)


def test_a_listener_out_of_threads_or_descriptors_closes_what_it_cannot_serve_and_keeps_accepting(
        engines: list[TransferEngine]) -> None:
    victim = Starvable(SECRET, max_connections=16)
    sender = start_engine(LAYERS, BLOCK_BYTES, SECRET)
    engines.append(sender)
    try:
        victim.ask("threads off")
        try:
            attackers = [raw(victim.address) for _ in range(4)]
            closed = [closed_by_peer(sock, 2) for sock in attackers]
        finally:
            victim.ask("threads on")
        assert closed == [True] * 4, "a connection no thread could serve was left open"
        victim.ask("fds off")
        try:
            waiting = raw(victim.address)  # queued while accept fails for want of a descriptor
            time.sleep(0.4)
        finally:
            victim.ask("fds on")
        handshaken(victim.address, SECRET, waiting).close()  # served once descriptors are back
        assert push_with(sender, Address.parse(victim.address), "after-starving", 7, BLOCKS)["state"] == "done"
        assert victim.ask("check after-starving 7 5") == {"state": "complete", "exact": True, "staging": 0}
        totals = victim.ask("totals")
        assert totals.get("refused_connections_no_thread", 0) == 4
        assert float(totals.get("refused_connections_accept", 0)) >= 1  # type: ignore[arg-type]
        for sock in attackers:
            sock.close()
    finally:
        victim.close()


def test_connections_beyond_the_cap_are_closed_at_once_while_the_first_ones_and_a_good_transfer_work(
        engines: list[TransferEngine]) -> None:
    receiver = listening(SECRET, max_connections=3)
    sender = start_engine(LAYERS, BLOCK_BYTES, SECRET)
    engines += [receiver, sender]
    first = [handshaken(receiver.address, SECRET) for _ in range(2)]
    assert push_with(sender, Address.parse(receiver.address), "within-cap", 3, BLOCKS)["state"] == "done"
    beyond = raw(receiver.address)  # the fourth connection
    assert closed_by_peer(beyond, 2), "a connection beyond the cap was served"
    assert receiver.metrics.totals().get("refused_connections_cap") == 1
    assert all(conn.is_alive() for conn in first)
    assert push_with(sender, Address.parse(receiver.address), "still-within-cap", 4, BLOCKS)["state"] == "done"
    assert landed_exact(receiver, "within-cap", seeded(3))
    assert landed_exact(receiver, "still-within-cap", seeded(4))
    first.pop().close()  # a place is free again once its reader has ended

    def handshakes() -> bool:
        try:
            return handshaken(receiver.address, SECRET).is_alive()
        except TransferError:  # refused at the cap: the closed connection's reader has not ended yet
            return False

    assert wait_for(handshakes, 5)
    for conn in first:
        conn.close()
    beyond.close()
    assert receiver.store.bytes_in_use == 0


def test_idle_connections_are_closed_and_their_senders_reconnect_without_failing_a_transfer(
        engines: list[TransferEngine]) -> None:
    receiver = listening(SECRET, connection_idle_s=1.0, transfer_timeout_s=2.0)
    sender = start_engine(LAYERS, BLOCK_BYTES, SECRET)
    engines += [receiver, sender]
    silent = raw(receiver.address)  # never says hello: the handshake's deadline (transfer_timeout_s) closes it
    idle = handshaken(receiver.address, SECRET)
    peer = Address.parse(receiver.address)
    assert push_with(sender, peer, "before-idle", 5, BLOCKS)["state"] == "done"
    started = time.monotonic()
    assert wait_for(lambda: not idle.is_alive(), 4), "an idle connection was kept past connection_idle_s"
    assert time.monotonic() - started >= 0.5
    assert closed_by_peer(silent, 4), "a connection that never said hello was kept"
    # The sender's cached link idled as long: pushes after it, and one at the listener's idle limit, still land.
    assert push_with(sender, peer, "after-idle", 6, BLOCKS)["state"] == "done"
    time.sleep(0.95)
    assert push_with(sender, peer, "at-the-limit", 8, BLOCKS)["state"] == "done"
    for tid, seed in (("before-idle", 5), ("after-idle", 6), ("at-the-limit", 8)):
        assert landed_exact(receiver, tid, seeded(seed))
    idle.close()
    silent.close()
    assert receiver.store.bytes_in_use == 0


def test_one_host_cannot_fill_the_listener_with_connections_that_never_say_hello(
        engines: list[TransferEngine]) -> None:
    """Without the secret, a host holds at most 64 connections still to say hello, each for at most 10 s (here the
    2 s transfer timeout): the rest of `max_connections` stays for peers, and once its silent ones are closed this
    host's own good pushes go through again."""
    receiver = listening(SECRET, max_connections=128, transfer_timeout_s=2.0)
    sender = start_engine(LAYERS, BLOCK_BYTES, SECRET)
    engines += [receiver, sender]
    silent = [raw(receiver.address) for _ in range(64)]
    time.sleep(0.3)
    beyond = [raw(receiver.address) for _ in range(8)]
    assert all(closed_by_peer(sock, 1) for sock in beyond), "a 65th silent connection from one host was served"
    assert receiver.metrics.totals().get("refused_connections_waiting") == 8
    started = time.monotonic()
    assert all(closed_by_peer(sock, 4) for sock in silent), "a connection that never said hello was kept"
    assert time.monotonic() - started < 3.5
    assert push_with(sender, Address.parse(receiver.address), "after-silence", 9, BLOCKS)["state"] == "done"
    assert landed_exact(receiver, "after-silence", seeded(9))
    for sock in silent + beyond:
        sock.close()
    assert receiver.store.bytes_in_use == 0
