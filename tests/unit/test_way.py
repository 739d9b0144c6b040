"""Push or pull: one decision from every input, whichever part asks; the keys pulls in parts are kept under."""

from __future__ import annotations

import itertools

import pytest

from p2pkv.engine.puller import PullKey
from p2pkv.way import Decision, Way, WhyPull, push_or_pull

# One input asking for a pull at a time (the others at their defaults), and what is decided.
ROWS: list[tuple[dict[str, object], Decision]] = [
    ({}, Decision(Way.PUSH, None)),
    ({"sizes_differ": True}, Decision(Way.PULL, WhyPull.SIZES_DIFFER)),
    ({"decode_pulls": True}, Decision(Way.PULL, WhyPull.GET)),
    ({"decode_kv_known": False}, Decision(Way.PULL, WhyPull.NO_ADDRESS)),
    ({"device_path": True}, Decision(Way.PULL, WhyPull.DEVICE_PATH)),
    ({"pinned_space": False}, Decision(Way.PULL, WhyPull.NO_PINNED)),
    ({"refused": WhyPull.NO_SPACE}, Decision(Way.PULL, WhyPull.NO_SPACE)),
    ({"refused": WhyPull.HEADS_DIFFER}, Decision(Way.PULL, WhyPull.HEADS_DIFFER)),
    ({"refused": WhyPull.DEVICE_PATH}, Decision(Way.PULL, WhyPull.DEVICE_PATH)),
]


@pytest.mark.parametrize(("inputs", "decided"), ROWS, ids=[",".join(map(str, r[0].values())) or "none" for r in ROWS])
def test_each_input_alone(inputs: dict[str, object], decided: Decision) -> None:
    assert push_or_pull(**inputs) == decided  # type: ignore[arg-type]


def test_every_combination_pulls_when_any_input_asks_and_names_the_first_reason() -> None:
    order = ["sizes_differ", "decode_pulls", "decode_kv_known", "device_path", "pinned_space", "refused"]
    asks = {"sizes_differ": True, "decode_pulls": True, "decode_kv_known": False, "device_path": True,
            "pinned_space": False}
    reason = {"sizes_differ": WhyPull.SIZES_DIFFER, "decode_pulls": WhyPull.GET,
              "decode_kv_known": WhyPull.NO_ADDRESS, "device_path": WhyPull.DEVICE_PATH,
              "pinned_space": WhyPull.NO_PINNED}
    seen = 0
    for flags in itertools.product([False, True], repeat=5):
        for refused in (None, WhyPull.NO_SPACE, WhyPull.HEADS_DIFFER):
            inputs: dict[str, object] = {name: (asks[name] if on else not asks[name])
                                         for name, on in zip(order[:5], flags, strict=True)}
            inputs["refused"] = refused
            asking = [name for name in order[:5] if inputs[name] == asks[name]]
            decided = push_or_pull(**inputs)  # type: ignore[arg-type]
            if asking:
                assert decided == Decision(Way.PULL, reason[asking[0]]), inputs
            elif refused is not None:
                assert decided == Decision(Way.PULL, refused), inputs
            else:
                assert decided == Decision(Way.PUSH, None), inputs
            assert decided.pulled is (decided.way is Way.PULL)
            seen += 1
    assert seen == 2**5 * 3


def test_a_refusals_reason_reads_back_as_a_pull_and_other_failures_do_not() -> None:
    for why in WhyPull:
        assert WhyPull.of(why.value) is why
    assert WhyPull.of("transfer failed: deadline passed") is None
    assert WhyPull.of("") is None


def test_pull_keys_name_the_transfer_the_peer_rank_and_a_release() -> None:
    assert str(PullKey("t")) == "t"
    assert str(PullKey("t", 3)) == "t@3"
    assert str(PullKey("t", release=True)) == "t#release"
    assert str(PullKey("t", 0, release=True)) == "t@0#release"
    assert len({str(PullKey("t", slot, release)) for slot in (None, 0, 1) for release in (False, True)}) == 6
