"""The table of blocks held for pulls (GET): what a pull of a transfer that is no longer held is told."""

from __future__ import annotations

import time

import pytest

from p2pkv.engine import offers
from p2pkv.engine.offers import UNKNOWN_TRANSFER, Offer, OfferState, OfferTable


def _source(layer: int, first: int, count: int) -> tuple[memoryview, ...]:
    return (memoryview(bytes(count)),)


def test_a_transfer_served_or_withdrawn_is_refused_at_once_and_one_never_held_is_unknown() -> None:
    table = OfferTable()
    table.offer("served", 2, _source, 30.0)
    claimed = table.claim("served", 0, 2)
    assert isinstance(claimed, Offer)
    table.finish(claimed)
    table.forget("served")
    table.offer("withdrawn", 2, _source, 30.0)
    assert table.withdraw("withdrawn", 0.0)
    table.forget("withdrawn")
    table.forget("pushed")  # never offered (its blocks were pushed): nothing to say about it
    table.forget("aborted", "withdrawn")  # never offered, and never will be
    assert table.claim("served", 0, 2) == "transfer is served"
    assert table.claim("withdrawn", 0, 2) == "transfer is expired"
    assert table.claim("aborted", 0, 2) == "transfer is withdrawn"
    # Not known at all: perhaps not offered yet (a refused push is offered moments later), so the puller waits.
    assert table.claim("pushed", 0, 2) == UNKNOWN_TRANSFER
    assert table.claim("never", 0, 2) == UNKNOWN_TRANSFER


def test_a_transfer_offered_again_is_pulled_and_the_memory_of_gone_ones_is_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(offers, "_GONE_KEPT", 3)
    table = OfferTable()
    table.forget("t0", "withdrawn")
    table.offer("t0", 1, _source, 30.0)
    assert table.poll("t0") is OfferState.OFFERED
    assert isinstance(table.claim("t0", 0, 1), Offer)
    for i in range(1, 5):
        table.forget(f"t{i}", "withdrawn")
    assert [table.claim(f"t{i}", 0, 1) for i in range(1, 5)] == [UNKNOWN_TRANSFER] + ["transfer is withdrawn"] * 3


def test_a_renewed_offer_is_held_past_its_lease_and_only_held_offers_are_renewed() -> None:
    table = OfferTable()
    table.offer("wanted", 1, _source, 0.3)
    table.offer("forgotten", 1, _source, 0.3)
    table.offer("served", 1, _source, 0.3)
    claimed = table.claim("served", 0, 1)
    assert isinstance(claimed, Offer)
    table.finish(claimed)
    for _ in range(3):  # renewed every 0.15 s, for 0.45 s in all
        time.sleep(0.15)
        assert table.renew(["wanted", "served", "never"]) == 1
        table.expire()
    assert table.poll("wanted") is OfferState.OFFERED
    assert table.poll("forgotten") is OfferState.EXPIRED  # the control: its lease ran out
    assert table.poll("served") is OfferState.SERVED
    time.sleep(0.35)
    table.expire()
    assert table.poll("wanted") is OfferState.EXPIRED  # no word since: its lease runs out in turn


def test_a_refused_puller_frees_the_offers_it_was_to_pull_except_one_being_pulled() -> None:
    """The engine refused the decode rank at `d:1` at its hello: what it was to pull expires at once, whatever the
    other ranks did; one with a pull in flight ends as it does; those for other ranks or for no named rank stay."""
    table = OfferTable()
    table.offer("for-d", 2, _source, 30.0, pulled_by=frozenset({"d:1", "d:2"}))
    table.offer("half-pulled", 2, _source, 30.0, pulled_by=frozenset({"d:1", "d:2"}))
    table.offer("in-flight", 2, _source, 30.0, pulled_by=frozenset({"d:1"}))
    table.offer("for-e", 2, _source, 30.0, pulled_by=frozenset({"e:1"}))
    table.offer("unnamed", 2, _source, 30.0)
    half = table.claim("half-pulled", 0, 2, pullers=2, puller=1)
    assert isinstance(half, Offer)
    table.finish(half)
    assert isinstance(table.claim("in-flight", 0, 2), Offer)
    assert sorted(table.refused("d:1", "KV layout mismatch")) == ["for-d", "half-pulled"]
    assert table.poll("for-d") is OfferState.EXPIRED and table.poll("half-pulled") is OfferState.EXPIRED
    assert table.poll("in-flight") is OfferState.SERVING
    assert table.poll("for-e") is OfferState.OFFERED and table.poll("unnamed") is OfferState.OFFERED
    assert table.refused("d:1", "again") == []
