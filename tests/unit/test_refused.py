"""The note of peers refused at their hello: news once per peer and reason, cleared by an accepted hello, bounded."""

from __future__ import annotations

import pytest

from p2pkv.engine import refused as refused_module
from p2pkv.engine.refused import RefusedPeers


def test_a_refusal_is_news_once_a_reason_and_again_after_an_accepted_hello() -> None:
    peers = RefusedPeers()
    assert peers.refused("10.0.0.1:5000", "dtype")
    assert not peers.refused("10.0.0.1:5000", "dtype")  # tried again, refused alike: logged at debug only
    assert peers.refused("10.0.0.1:5000", "num_layers")  # restarted with another layout: news
    assert peers.reason("10.0.0.1:5000") == "num_layers"
    peers.accepted("10.0.0.1:5000")
    assert peers.reason("10.0.0.1:5000") is None
    assert peers.refused("10.0.0.1:5000", "num_layers")
    assert peers.refused("", "dtype") and peers.reason("") is None  # a peer that names no listener is not noted
    assert peers.refused("10.0.0.1:6000", "dtype", "a1" * 8)
    assert not peers.refused("10.0.0.1:6000", "dtype", "a1" * 8)
    assert peers.refused("10.0.0.1:6000", "dtype", "b2" * 8), "restarted, still refused for the same reason: news"


def test_the_oldest_note_goes_first_past_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(refused_module, "_MAX_NOTED", 3)
    peers = RefusedPeers()
    for port in range(4):
        peers.refused(f"h:{port}", "dtype")
    peers.refused("h:1", "dtype")  # noted again: now the newest
    peers.refused("h:9", "dtype")
    assert [peers.reason(f"h:{port}") for port in (0, 1, 2, 3, 9)] == [None, "dtype", None, "dtype", "dtype"]


def test_the_snapshot_changes_version_at_each_refusal_and_clearing_and_keeps_the_latest_time() -> None:
    peers = RefusedPeers()
    empty, notes = peers.snapshot()
    assert notes == {}
    peers.refused("h:1", "dtype")
    first, notes = peers.snapshot()
    assert first != empty and notes["h:1"].reason == "dtype"
    at = notes["h:1"].at
    peers.refused("h:1", "dtype")  # refused again: not news for the log, but a newer time for the proxy
    again, notes = peers.snapshot()
    assert again != first and notes["h:1"].at >= at
    peers.accepted("h:2")  # nothing noted there: nothing changes
    assert peers.snapshot()[0] == again
    peers.accepted("h:1")
    cleared, notes = peers.snapshot()
    assert cleared != again and notes == {}


def test_a_note_does_not_answer_for_a_later_start_of_the_refused_instance() -> None:
    """A refusal is of one start of the peer's instance (`Hello.launch`): asked for another start (the peer
    restarted since; its next hello decides), there is none; asked for the same, or without one, or when the
    refused hello said none, there is."""
    peers = RefusedPeers()
    peers.refused("h:1", "dtype", "aaaaaaaaaaaaaaaa")
    assert peers.reason("h:1", "aaaaaaaaaaaaaaaa") == peers.reason("h:1") == "dtype"
    assert peers.reason("h:1", "bbbbbbbbbbbbbbbb") is None
    assert peers.snapshot()[1]["h:1"].launch == "aaaaaaaaaaaaaaaa"
    peers.refused("h:2", "dtype")  # an older peer, which says no start
    assert peers.reason("h:2", "bbbbbbbbbbbbbbbb") == "dtype"
