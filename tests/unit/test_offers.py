"""The table of blocks held for pulls (GET): what a pull of a transfer that is no longer held is told."""

from __future__ import annotations

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
