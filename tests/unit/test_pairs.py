"""Pairing: a prefill and a decode instance are not paired while either's heartbeats say one of its workers refused
a worker of the other (by the listener that worker names), until `PAIR_RETRY_S` after that refusal; nor while a
weight update through the proxy reached one and not the other."""

from __future__ import annotations

from p2pkv.params import Address
from p2pkv.proxy.pairs import MAX_PAIR_RETRY_S, PAIR_RETRY_S, Side, news, refusals, why_not_paired

NOW = 1000.0
PREFILL_KV = Address("10.0.0.1", 7100)  # its rank 0; ranks 1..3 listen on the next ports
DECODE_KV = Address("10.0.0.2", 7300)


def side(name: str, kv: Address | None, ranks: int, said: tuple[tuple[Address, str, float], ...] = ()) -> Side:
    return Side(name, kv, ranks, refusals(tuple((*s, "") for s in said), NOW))  # no launches said


def test_a_refusal_of_any_worker_of_the_other_instance_unpairs_them_both_ways_until_it_is_old() -> None:
    prefill = side("prefill instance p", PREFILL_KV, 4)
    assert why_not_paired(side("decode instance d", DECODE_KV, 1), prefill, NOW) is None
    decode = side("decode instance d", DECODE_KV, 1, ((PREFILL_KV.offset(3), "KV layout mismatch: dtype", 10.0),))
    why = why_not_paired(decode, prefill, NOW)
    assert why == "decode instance d refused its worker at 10.0.0.1:7103: KV layout mismatch: dtype"
    assert why_not_paired(decode, prefill, NOW + PAIR_RETRY_S - 10.5) is not None
    assert why_not_paired(decode, prefill, NOW + PAIR_RETRY_S - 9.5) is None, "tried again after PAIR_RETRY_S"
    # Not a worker of that instance: the next instance's port on that host, another host, rank 0 of no instance.
    for address in (PREFILL_KV.offset(4), Address("10.0.0.9", 7100), PREFILL_KV.offset(-1)):
        other = side("decode instance d", DECODE_KV, 1, ((address, "dtype", 0.0),))
        assert why_not_paired(other, prefill, NOW) is None, address
    assert why_not_paired(other, side("prefill instance q", None, 1), NOW) is None  # no KV address known
    # GET: the prefill instance refused the decode instance's worker.
    refusing = side("prefill instance p", PREFILL_KV, 4, ((DECODE_KV, "model.rope_parameters", 0.0),))
    assert "prefill instance p refused its worker at 10.0.0.2:7300" in str(
        why_not_paired(side("decode instance d", DECODE_KV, 1), refusing, NOW))


def test_news_are_the_refusals_in_force_not_in_force_before() -> None:
    old = refusals(((PREFILL_KV, "dtype", 0.0, ""), (DECODE_KV, "dtype", PAIR_RETRY_S + 1, "")), NOW)
    new = refusals(((PREFILL_KV, "dtype", 3.0, ""), (DECODE_KV, "dtype", 0.0, ""),
                    (PREFILL_KV.offset(1), "x", 0.0, "")), NOW)
    assert [r.address for r in news(old, new, NOW)] == [DECODE_KV, PREFILL_KV.offset(1)]
    assert news(new, new, NOW) == []


def test_refusals_from_before_the_refused_instance_restarted_no_longer_count() -> None:
    decode = side("decode instance d", DECODE_KV, 1, ((PREFILL_KV, "dtype", 10.0),))  # refused at NOW - 10
    restarted = Side("prefill instance p", PREFILL_KV, 1, (), up_since=NOW - 5)
    assert why_not_paired(decode, restarted, NOW) is None, "paired again: it may have been fixed"
    again = side("decode instance d", DECODE_KV, 1, ((PREFILL_KV, "dtype", 1.0),))  # refused again since
    assert why_not_paired(again, restarted, NOW) is not None


def test_a_refusal_of_an_earlier_start_than_the_refused_instance_says_now_no_longer_counts() -> None:
    """The refusal names the start it refused; the instance says its start now. Another start: paired again, though
    the proxy saw no restart (`up_since`). The same start, or either not said: passed over as before."""
    decode = Side("decode instance d", DECODE_KV, 1, refusals(((PREFILL_KV, "dtype", 10.0, "a1" * 8),), NOW))
    unsaid = Side("decode instance d", DECODE_KV, 1, refusals(((PREFILL_KV, "dtype", 10.0, ""),), NOW))
    for refusing, launch, paired in ((decode, "b2" * 8, True), (decode, "a1" * 8, False), (decode, "", False),
                                     (unsaid, "b2" * 8, False)):
        prefill = Side("prefill instance p", PREFILL_KV, 1, (), launch=launch)
        assert (why_not_paired(refusing, prefill, NOW) is None) is paired, (launch, refusing.refused[0].launch)
        assert (why_not_paired(prefill, refusing, NOW) is None) is paired, "either way round"


def test_a_pair_refused_again_when_tried_waits_twice_as_long_up_to_the_cap() -> None:
    """Each try of a pair still refused costs a prefill computed for nothing: after 60 s, then 120, 240, 480 at
    most (under the 10 minutes heartbeats name a refusal). The same refusal said again is no new strike."""
    first = refusals(((PREFILL_KV, "dtype", 0.0, ""),), NOW)
    assert first[0].until == NOW + PAIR_RETRY_S
    repeated = refusals(((PREFILL_KV, "dtype", 2.9, ""),), NOW + 3.0, first)  # the next heartbeat, ages rounded
    assert repeated[0].strikes == 0 and abs(repeated[0].until - first[0].until) < 0.2
    said, at = first, NOW
    for waited in (2 * PAIR_RETRY_S, 4 * PAIR_RETRY_S, MAX_PAIR_RETRY_S, MAX_PAIR_RETRY_S):
        at = said[0].until + 1.0  # tried once the pass-over ran out: refused afresh
        said = refusals(((PREFILL_KV, "dtype", 0.0, ""),), at, said)
        assert said[0].until == at + waited
        decode = Side("decode instance d", DECODE_KV, 1, said)
        prefill = Side("prefill instance p", PREFILL_KV, 1, ())
        assert why_not_paired(decode, prefill, at + waited - 1) is not None
        assert why_not_paired(decode, prefill, at + waited + 1) is None
    # A refusal the instance no longer says (an accepted hello cleared it) leaves no strike behind.
    assert refusals(((PREFILL_KV, "dtype", 0.0, ""),), at + 1000, refusals((), at + 999, said))[0].strikes == 0


def test_instances_whose_weights_differ_as_the_proxy_knows_them_are_not_paired() -> None:
    """A weight update through the proxy that one instance took and the other did not (`Side.weights`): passed
    over both ways, for as long as the marks differ; the same update, or none on either: paired."""
    for decode_mark, prefill_mark, paired in (("", "", True), ("reload_weights 1a", "reload_weights 1a", True),
                                              ("reload_weights 1a", "", False), ("", "reload_weights 1a", False),
                                              ("reload_weights 2b", "reload_weights 1a", False)):
        decode = Side("decode instance d", DECODE_KV, 1, (), weights=decode_mark)
        prefill = Side("prefill instance p", PREFILL_KV, 1, (), weights=prefill_mark)
        why = why_not_paired(decode, prefill, NOW)
        assert (why is None) is paired, (decode_mark, prefill_mark)
        assert paired or (why is not None and why.startswith("their weights differ: decode instance d took "
                                                             f"{decode_mark or 'no update'} and prefill instance p"))
