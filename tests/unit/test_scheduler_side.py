"""Scheduler-side decisions (what to save, what to load, into which blocks) with plain stand-in requests."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the scheduler side imports vLLM's connector base class")

from p2pkv.config import launch_of, parse_connector_config
from p2pkv.engine.refused import Refusal
from p2pkv.params import (
    Address,
    DecodeParams,
    DiscardParams,
    PrefillParams,
    parse_transfer_params,
    prompt_digest,
)
from p2pkv.proxy.poll import read_probe
from p2pkv.vllm.metadata import Discard
from p2pkv.vllm.scheduler import SchedulerSide
from tests.helpers.unit import BS, Blocks, Cached, Req, step


def side(role: str) -> SchedulerSide:
    return SchedulerSide(parse_connector_config(role, 21001, "recompute", {"kv_host": "127.0.0.1"}), BS)


def decode_req(n: int, tid: str = "t1", claimed: int | None = None) -> Req:
    return Req(f"cmpl-x-0-{tid}", list(range(n)), DecodeParams(tid, claimed or n, None).to_dict())


@pytest.mark.parametrize(("n", "local", "first", "blocks"), [
    (300, 0, 0, (5, 6, 7)),      # tokens [0, 299) span blocks 0..2
    (257, 0, 0, (5, 6)),         # tokens [0, 256): the third block holds only the last token, computed locally
    (7, 0, 0, (5,)),             # shorter than one block
    (300, 128, 1, (6, 7)),       # a local prefix hit of one block: load from block 1
])
def test_consumer_loads_all_but_the_last_token(n: int, local: int, first: int, blocks: tuple[int, ...]) -> None:
    s = side("kv_consumer")
    req = decode_req(n)
    assert s.get_num_new_matched_tokens(req, local) == (n - 1 - local, True)
    assert s.get_num_new_matched_tokens(req, local) == (n - 1 - local, True)  # no side effects
    s.update_state_after_alloc(req, Blocks([5, 6, 7]), n - 1 - local)
    meta = s.build_connector_meta(step())
    assert [(ld.transfer_id, ld.first_block, ld.block_ids) for ld in meta.loads] == [("t1", first, blocks)]
    assert s.build_connector_meta(step()).loads == []
    # Once claimed, later scheduling of the same request (after the load) loads nothing more.
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, Blocks([5, 6, 7]), 0)
    assert s.build_connector_meta(step()).loads == []
    assert s.request_finished(req, [5, 6, 7]) == (False, None)


def test_consumer_refuses_a_prompt_that_differs_from_the_prefill() -> None:
    s = side("kv_consumer")
    assert s.get_num_new_matched_tokens(decode_req(300, claimed=299), 0) == (0, False)


def test_another_prompt_of_the_same_length_is_computed_here_and_leaves_the_transfer_to_its_own() -> None:
    """One transfer for a batch of prompts (one completion request): only the prompt whose digest it carries loads
    it, whichever is scheduled first; the others are computed here and neither claim nor free the transfer."""
    s = side("kv_consumer")
    params = DecodeParams("t1", 300, None, prompt=prompt_digest(range(300)), lease_s=30.0).to_dict()
    other, own = Req("1_other", [1] * 300, params), Req("0_own", list(range(300)), params)
    assert s.get_num_new_matched_tokens(other, 0) == (0, False)
    s.update_state_after_alloc(other, Blocks([1, 2, 3]), 0)
    meta = s.build_connector_meta(step())
    assert meta.loads == [] and meta.discards == []
    assert s.get_num_new_matched_tokens(own, 0) == (299, True)
    s.update_state_after_alloc(own, Blocks([5, 6, 7]), 299)
    (load,) = s.build_connector_meta(step()).loads
    assert (load.req_id, load.block_ids) == ("0_own", (5, 6, 7))


def test_full_local_hit_discards_the_staged_transfer_without_a_load() -> None:
    """A load is reported to vLLM when it finishes, and vLLM asserts that the request waits for it: a request that
    loads nothing must not have one (its decode instance crashed when the prompt was a whole number of blocks plus
    one token, sent twice)."""
    s = side("kv_consumer")
    req = decode_req(129)
    assert s.get_num_new_matched_tokens(req, 128) == (0, False)
    s.update_state_after_alloc(req, Blocks([1, 2]), 0)
    meta = s.build_connector_meta(step())
    assert meta.loads == [] and meta.discards == [Discard("t1")]
    assert s.build_connector_meta(step()).discards == []


@pytest.mark.parametrize(("pull", "prefill_tp", "discard"), [
    (True, 1, Discard("t1", Address("127.0.0.1", 24001))),
    (True, 0, Discard("t1", Address("127.0.0.1", 24001))),
    (True, 2, Discard("t1", Address("127.0.0.1", 24001), prefill_tp=2)),
    (False, 2, Discard("t1", Address("127.0.0.1", 24001), prefill_tp=2)),  # another size: pulled whatever the mode
    # pushed: the staging to free, or, should this side refuse the push, the blocks then held for a pull
    (False, 1, Discard("t1", fallback_from=Address("127.0.0.1", 24001))),
])
def test_full_local_hit_releases_the_blocks_held_for_a_pull(pull: bool, prefill_tp: int, discard: Discard) -> None:
    s = side("kv_consumer")
    held_at = Address("127.0.0.1", 24001)
    req = Req("r", list(range(129)), DecodeParams("t1", 129, held_at, pull=pull, prefill_tp=prefill_tp).to_dict())
    assert s.get_num_new_matched_tokens(req, 128) == (0, False)
    s.update_state_after_alloc(req, Blocks([1, 2]), 0)
    assert s.build_connector_meta(step()).discards == [discard]


def sample(i: int, n: int = 300, tid: str = "t1") -> Req:
    """Sample i of a request with `n` > 1: vLLM makes one request per sample, each with the same params."""
    return Req(f"{i}_cmpl-x-0-{tid}", list(range(n)), DecodeParams(tid, n, None).to_dict())


def test_parallel_samples_wait_for_the_first_to_load_then_use_the_prefix_cache() -> None:
    s = side("kv_consumer")
    first, second, third = sample(0), sample(1), sample(2)
    assert s.get_num_new_matched_tokens(first, 0) == (299, True)
    s.update_state_after_alloc(first, Blocks([5, 6, 7]), 299)
    first.set_status("WAITING_FOR_REMOTE_KVS")
    # Not known yet while the first sample's KV is on its way: vLLM asks again at its next step.
    assert s.get_num_new_matched_tokens(second, 0) == (None, False)
    assert s.get_num_new_matched_tokens(third, 0) == (None, False)
    (load,) = s.build_connector_meta(step()).loads
    assert load.req_id == first.request_id
    first.set_status("RUNNING")  # landed: vLLM cached its blocks when it promoted it
    assert s.get_num_new_matched_tokens(second, 256) == (0, False)
    s.update_state_after_alloc(second, Blocks([5, 6, 8]), 0)
    meta = s.build_connector_meta(step())
    assert meta.loads == [] and meta.discards == []  # nothing to free: the first took the staged KV
    assert s.request_finished(first, [5, 6, 7]) == (False, None)
    # A sample scheduled after the first one finished does not wait for KV that was taken already.
    assert s.get_num_new_matched_tokens(third, 256) == (0, False)


def test_a_sample_stops_waiting_when_the_first_is_aborted() -> None:
    s = side("kv_consumer")
    first, second = sample(0), sample(1)
    s.get_num_new_matched_tokens(first, 0)
    s.update_state_after_alloc(first, Blocks([5, 6, 7]), 299)
    first.set_status("WAITING_FOR_REMOTE_KVS")
    assert s.get_num_new_matched_tokens(second, 0) == (None, False)
    first.set_status("FINISHED_ABORTED")
    assert s.get_num_new_matched_tokens(second, 0) == (0, False)


def test_a_sample_waits_no_longer_than_the_transfer_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    import p2pkv.vllm.scheduler as scheduler

    s = side("kv_consumer")
    first, second = sample(0), sample(1)
    s.update_state_after_alloc(first, Blocks([5, 6, 7]), 299)
    first.set_status("WAITING_FOR_REMOTE_KVS")
    assert s.get_num_new_matched_tokens(second, 0) == (None, False)
    later = scheduler.time.monotonic() + s.consumers.claim_wait_s + 1
    monkeypatch.setattr(scheduler.time, "monotonic", lambda: later)
    assert s.get_num_new_matched_tokens(second, 0) == (0, False)


def test_claims_are_forgotten_after_their_keep(monkeypatch: pytest.MonkeyPatch) -> None:
    import p2pkv.vllm.scheduler as scheduler

    s = side("kv_consumer")
    first = sample(0)
    s.update_state_after_alloc(first, Blocks([5, 6, 7]), 299)
    s.request_finished(first, [5, 6, 7])
    s.build_connector_meta(step())
    assert s.consumers.claimed("t1")
    later = scheduler.time.monotonic() + s.consumers.claim_keep_s + 1
    monkeypatch.setattr(scheduler.time, "monotonic", lambda: later)
    s.build_connector_meta(step())
    assert s.consumers.claims == 0


def test_parallel_samples_on_the_prefill_side_send_the_transfer_once() -> None:
    s = side("kv_producer")
    params = PrefillParams("t9", Address("127.0.0.1", 22001)).to_dict()
    samples = [Req(f"{i}_cmpl-p-0-abcd", list(range(300)), params) for i in range(3)]
    for i, req in enumerate(samples):
        s.update_state_after_alloc(req, Blocks([1 + 3 * i, 2 + 3 * i, 3 + 3 * i]), 0)
    new = [SimpleNamespace(req_id=r.request_id, block_ids=([1 + 3 * i, 2 + 3 * i, 3 + 3 * i],),
                           num_computed_tokens=0) for i, r in enumerate(samples)]
    saves = s.build_connector_meta(step(new, scheduled={r.request_id: 300 for r in samples})).saves
    assert [(sv.req_id, sv.block_ids) for sv in saves] == [(samples[0].request_id, (1, 2, 3))]
    answer = DecodeParams("t9", 300, Address("127.0.0.1", 21001), prefill_tp=1, prefill_pp=1,
                          prompt=prompt_digest(range(300)), lease_s=30.0).to_dict()
    # Whichever sample vLLM's answer takes its params from, they name the one transfer; only the first holds blocks.
    assert s.request_finished(samples[1], []) == (False, answer)
    assert s.request_finished(samples[0], [1, 2, 3]) == (True, answer)
    assert s.request_finished(samples[2], []) == (False, answer)


def test_the_answer_names_the_prefill_instances_start_and_the_load_passes_it_on() -> None:
    """The prefill side's answer says which start of its instance holds the KV (`launch_of` vLLM's engine id); the
    decode side's load carries it to its workers, which then do not fail it on a refusal of an earlier start."""
    config = parse_connector_config("kv_producer", 21001, "recompute", {"kv_host": "127.0.0.1"}, "vllm-engine-1")
    assert config.launch == launch_of("vllm-engine-1") and len(config.launch) == 16
    assert launch_of("vllm-engine-2") != config.launch and launch_of("") == ""
    prefill = SchedulerSide(config, BS)
    req = Req("cmpl-p-0-abcd", list(range(300)), PrefillParams("t9", Address("127.0.0.1", 22001)).to_dict())
    prefill.update_state_after_alloc(req, Blocks([1, 2, 3]), 0)
    new = SimpleNamespace(req_id=req.request_id, block_ids=([1, 2, 3],), num_computed_tokens=0)
    prefill.build_connector_meta(step([new], scheduled={req.request_id: 300}))
    held, answer = prefill.request_finished(req, [1, 2, 3])
    assert held and answer is not None and answer["prefill_launch"] == config.launch
    # GET: the decode instance's start, as the proxy names it, goes with the save to the workers.
    pulled = Req("cmpl-p-1-abcd", list(range(300)), PrefillParams(
        "t10", Address("127.0.0.1", 22001), pull=True, decode_launch=launch_of("decode-engine")).to_dict())
    prefill.update_state_after_alloc(pulled, Blocks([4, 5, 6]), 0)
    new = SimpleNamespace(req_id=pulled.request_id, block_ids=([4, 5, 6],), num_computed_tokens=0)
    (save,) = prefill.build_connector_meta(step([new], scheduled={pulled.request_id: 300})).saves
    assert save.pulled_by == Address("127.0.0.1", 22001) and save.puller_launch == launch_of("decode-engine")
    decode = side("kv_consumer")
    load = Req("cmpl-x-0-t9", list(range(300)), answer)
    assert decode.get_num_new_matched_tokens(load, 0) == (299, True)
    decode.update_state_after_alloc(load, Blocks([5, 6, 7]), 299)
    (spec,) = decode.build_connector_meta(step()).loads
    assert spec.prefill_launch == config.launch


def test_producer_saves_once_when_a_chunked_prompt_completes() -> None:
    s = side("kv_producer")
    req = Req("cmpl-p-0-abcd", list(range(300)), PrefillParams("t9", Address("127.0.0.1", 22001)).to_dict())
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, Blocks([1, 2]), 0)
    first = SimpleNamespace(req_id=req.request_id, block_ids=([1, 2],), num_computed_tokens=0)
    assert s.build_connector_meta(step([first], scheduled={req.request_id: 200})).saves == []
    cached = Cached([req.request_id], [([3],)], set(), [200])
    saves = s.build_connector_meta(step(cached=cached, scheduled={req.request_id: 100})).saves
    assert [(sv.transfer_id, sv.block_ids, sv.peer) for sv in saves] == [("t9", (1, 2, 3),
                                                                         Address("127.0.0.1", 22001))]
    cached = Cached([req.request_id], [None], set(), [300])
    assert s.build_connector_meta(step(cached=cached, scheduled={req.request_id: 1})).saves == []
    delay, params = s.request_finished(req, [1, 2, 3])
    assert delay is True
    assert params == DecodeParams("t9", 300, Address("127.0.0.1", 21001), prefill_tp=1, prefill_pp=1,
                                  prompt=prompt_digest(range(300)), lease_s=30.0).to_dict()


def test_a_preempted_request_whose_blocks_are_being_sent_is_named_to_the_workers() -> None:
    s = side("kv_producer")
    saved, unsaved = (Req(r, list(range(300)), PrefillParams(t, Address("h", 1)).to_dict())
                      for r, t in (("a", "ta"), ("b", "tb")))
    for req in (saved, unsaved):
        s.update_state_after_alloc(req, Blocks([1, 2, 3]), 0)
    new = [SimpleNamespace(req_id="a", block_ids=([1, 2, 3],), num_computed_tokens=0),
           SimpleNamespace(req_id="b", block_ids=([4, 5, 6],), num_computed_tokens=0)]
    meta = s.build_connector_meta(step(new, scheduled={"a": 300, "b": 100}))
    assert [sv.transfer_id for sv in meta.saves] == ["ta"] and meta.preempted == []
    preempting = step(scheduled={})
    preempting.preempted_req_ids = {"a", "b"}  # b's prompt was not complete: nothing of it is being sent
    assert s.build_connector_meta(preempting).preempted == ["ta"]


@pytest.mark.parametrize("resumed_as", ["cached", "new"])
def test_a_preempted_producer_saves_again_once_its_prompt_is_computed_again(resumed_as: str) -> None:
    """A prefill request that goes on decoding is preempted after its save; resumed, vLLM computes its prompt
    again into other blocks (in chunks here), and the transfer is saved again from them (`again`: held for a pull
    where it was). Until then, and after, vLLM keeps the request until the workers let go of the transfer."""
    s = side("kv_producer")
    req = Req("p", list(range(300)), PrefillParams("t5", Address("h", 1)).to_dict())
    s.update_state_after_alloc(req, Blocks([1, 2, 3]), 0)
    new = [SimpleNamespace(req_id="p", block_ids=([1, 2, 3],), num_computed_tokens=0)]
    assert [sv.again for sv in s.build_connector_meta(step(new, scheduled={"p": 300})).saves] == [False]
    preempting = step(scheduled={})
    preempting.preempted_req_ids = {"p"}
    assert s.build_connector_meta(preempting).preempted == ["t5"]
    if resumed_as == "cached":
        first = step(cached=Cached(["p"], [([7, 8],)], {"p"}, [0]), scheduled={"p": 256})
    else:
        first = step([SimpleNamespace(req_id="p", block_ids=([7, 8],), num_computed_tokens=0)], scheduled={"p": 256})
    assert s.build_connector_meta(first).saves == []  # the prompt is not complete yet
    rest = step(cached=Cached(["p"], [([9],)], set(), [256]), scheduled={"p": 44})
    (again,) = s.build_connector_meta(rest).saves
    assert (again.transfer_id, again.block_ids, again.peer, again.again) == ("t5", (7, 8, 9), None, True)
    assert s.request_finished(req, [7, 8, 9])[0] is True


def test_a_producer_finished_while_preempted_is_kept_for_its_workers() -> None:
    """With async scheduling a request can finish (its last token sampled) in the step vLLM preempted it: the
    workers still hold its transfer (withdrawn), so vLLM keeps the request until they report it."""
    s = side("kv_producer")
    req = Req("p", list(range(300)), PrefillParams("t6", None, pull=True).to_dict())
    s.update_state_after_alloc(req, Blocks([1, 2, 3]), 0)
    s.build_connector_meta(step([SimpleNamespace(req_id="p", block_ids=([1, 2, 3],), num_computed_tokens=0)],
                                scheduled={"p": 300}))
    preempting = step(scheduled={})
    preempting.preempted_req_ids = {"p"}
    s.build_connector_meta(preempting)
    delay, answer = s.request_finished(req, [])
    assert delay is True and parse_transfer_params(answer).transfer_id == "t6"  # type: ignore[union-attr]


def test_producer_aborted_before_its_prompt_completed_holds_nothing() -> None:
    s = side("kv_producer")
    req = Req("r", list(range(300)), PrefillParams("t9", Address("h", 1)).to_dict())
    s.update_state_after_alloc(req, Blocks([1]), 0)
    first = SimpleNamespace(req_id="r", block_ids=([1],), num_computed_tokens=0)
    s.build_connector_meta(step([first], scheduled={"r": 128}))
    assert s.request_finished(req, [1]) == (False, None)


def test_probe_is_answered_with_the_kv_port() -> None:
    s = side("kv_consumer")
    req = Req("probe", [0], {"p2pkv": 1, "probe": True})
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.request_finished(req, []) == (False, {"p2pkv": 1, "kv_port": 21001, "kv_host": "127.0.0.1",
                                                  "tp_size": 1, "pp_size": 1, "kv_named": "127.0.0.1:21001"})


def test_a_probe_answer_says_what_a_heartbeat_says_the_engine_and_the_refusals() -> None:
    """For a proxy that lists the instance statically (`p2pkv.proxy.poll`): the workers' refusals now, the latest
    first, with their age."""
    now = time.monotonic()
    notes = {"10.0.0.2:21001": Refusal("KV layout mismatch: model.weights: ours a, peer b", now - 5.0),
             "10.0.0.3:21001": Refusal("block_size: ours 16, peer 32", now - 1.0, "ab" * 8)}
    s = SchedulerSide(parse_connector_config("kv_consumer", 21001, "recompute", {"kv_host": "10.0.0.1"}, "vllm-e"),
                      BS, engine_id="e1", refused=lambda: notes, kv_events="tcp://10.0.0.1:5557")
    req = Req("probe", [0], {"p2pkv": 1, "probe": True})
    s.get_num_new_matched_tokens(req, 0)
    answer = s.request_finished(req, [])[1]
    assert answer is not None and answer["engine_id"] == "e1" and answer["kv_named"] == "10.0.0.1:21001"
    assert answer["launch"] == launch_of("vllm-e")
    assert [entry[:2] for entry in answer["refused"]] == [
        ["10.0.0.3:21001", "block_size: ours 16, peer 32"],
        ["10.0.0.2:21001", "KV layout mismatch: model.weights: ours a, peer b"]]
    assert 0.9 <= answer["refused"][0][2] <= 2.0 and 4.9 <= answer["refused"][1][2] <= 6.0
    assert answer["refused_launches"] == ["ab" * 8, ""], "the refused starts, under a key of their own"
    assert [r[3] for r in read_probe(answer).refused] == ["ab" * 8, ""]
    assert read_probe(answer).kv_events == "tcp://10.0.0.1:5557", "where its KV cache events are, for the prefix policy"


@pytest.mark.parametrize(("role", "pulls"), [("kv_consumer", True), ("kv_both", True), ("kv_producer", False)])
def test_a_decode_instance_with_send_type_get_says_it_pulls_in_its_probe_answer(role: str, pulls: bool) -> None:
    s = SchedulerSide(parse_connector_config(role, 21001, "recompute", {"kv_host": "h", "send_type": "GET"}), BS)
    req = Req("probe", [0], {"p2pkv": 1, "probe": True})
    s.get_num_new_matched_tokens(req, 0)
    answer = s.request_finished(req, [])[1]
    assert answer is not None and answer.get("pulls", False) is pulls


def test_invalid_params_are_ignored_not_fatal() -> None:
    s = side("kv_consumer")
    req = Req("bad", list(range(10)), {"p2pkv": 1, "transfer_id": "bad id!", "load_remote_kv": True})
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, Blocks([1]), 0)
    assert s.build_connector_meta(step()).loads == []


def test_other_tensor_parallel_sizes_mean_pulls_by_heads() -> None:
    # A prefill instance told the decode side runs TP 2 holds its blocks for pulls, whatever the mode, and says
    # its own TP size; the decode side then pulls, even when the prefill side believed it could push.
    s = SchedulerSide(parse_connector_config("kv_producer", 21001, "recompute", {"kv_host": "127.0.0.1"}), BS, 1)
    req = Req("p", list(range(40)), PrefillParams("t8", Address("127.0.0.1", 22001), decode_tp=2).to_dict())
    s.update_state_after_alloc(req, Blocks([4]), 0)
    first = SimpleNamespace(req_id="p", block_ids=([4],), num_computed_tokens=0)
    assert [sv.peer for sv in s.build_connector_meta(step([first], scheduled={"p": 40})).saves] == [None]
    returned = parse_transfer_params(s.request_finished(req, [4])[1])
    assert isinstance(returned, DecodeParams) and returned.pull and returned.prefill_tp == 1
    d = SchedulerSide(parse_connector_config("kv_consumer", 23001, "recompute", {"kv_host": "127.0.0.1"}), BS, 2)
    pushed = DecodeParams("t8", 40, Address("127.0.0.1", 21001), prefill_tp=1)
    req = Req("d", list(range(40)), pushed.to_dict())
    assert d.get_num_new_matched_tokens(req, 0) == (39, True)
    d.update_state_after_alloc(req, Blocks([7]), 39)
    (load,) = d.build_connector_meta(step()).loads
    assert load.pull_from == Address("127.0.0.1", 21001) and load.prefill_tp == 1


def test_other_pipeline_parallel_sizes_mean_pulls_by_layers() -> None:
    # Stage s of one instance holds other layers than stage s of the other: the prefill side holds its blocks for
    # pulls whatever the mode, and says its size; the decode side then pulls, each stage the layers it holds.
    config = parse_connector_config("kv_producer", 21001, "recompute", {"kv_host": "127.0.0.1"})
    s = SchedulerSide(config, BS, 1, 2)
    req = Req("p", list(range(300)), PrefillParams("t7", Address("127.0.0.1", 22001), decode_pp=1).to_dict())
    s.update_state_after_alloc(req, Blocks([4, 5, 6]), 0)
    first = SimpleNamespace(req_id="p", block_ids=([4, 5, 6],), num_computed_tokens=0)
    assert [sv.peer for sv in s.build_connector_meta(step([first], scheduled={"p": 300})).saves] == [None]
    delay, raw = s.request_finished(req, [4, 5, 6])
    returned = parse_transfer_params(raw)
    assert delay is True
    assert isinstance(returned, DecodeParams) and returned.pull and (returned.prefill_pp, returned.prefill_tp) == (2, 1)
    d = SchedulerSide(parse_connector_config("kv_consumer", 23001, "recompute", {"kv_host": "127.0.0.1"}), BS, 1, 1)
    pushed = DecodeParams("t7", 300, Address("127.0.0.1", 21001), prefill_tp=1, prefill_pp=2)
    req = Req("d", list(range(300)), pushed.to_dict())
    assert d.get_num_new_matched_tokens(req, 0) == (299, True)
    d.update_state_after_alloc(req, Blocks([7, 8, 9]), 299)
    (load,) = d.build_connector_meta(step()).loads
    assert load.pull_from == Address("127.0.0.1", 21001) and (load.prefill_pp, load.prefill_tp) == (2, 0)
    # Equal sizes: pushed rank to rank as usual.
    same = SchedulerSide(config, BS, 1, 2)
    req = Req("q", list(range(300)), PrefillParams("t6", Address("127.0.0.1", 22001), decode_pp=2).to_dict())
    same.update_state_after_alloc(req, Blocks([4, 5, 6]), 0)
    first = SimpleNamespace(req_id="q", block_ids=([4, 5, 6],), num_computed_tokens=0)
    (save,) = same.build_connector_meta(step([first], scheduled={"q": 300})).saves
    assert save.peer == Address("127.0.0.1", 22001)
    returned = parse_transfer_params(same.request_finished(req, [4, 5, 6])[1])
    assert isinstance(returned, DecodeParams) and not returned.pull and returned.prefill_pp == 2
    d2 = SchedulerSide(parse_connector_config("kv_consumer", 23001, "recompute", {"kv_host": "127.0.0.1"}), BS, 1, 2)
    req = Req("e", list(range(300)), returned.to_dict())
    assert d2.get_num_new_matched_tokens(req, 0) == (299, True)
    d2.update_state_after_alloc(req, Blocks([7, 8, 9]), 299)
    (load,) = d2.build_connector_meta(step()).loads
    assert load.pull_from is None and load.prefill_pp == 0


def test_steps_that_compute_nothing_are_marked_idle() -> None:
    s = side("kv_consumer")
    assert s.build_connector_meta(step()).idle
    assert not s.build_connector_meta(step(scheduled={"r": 3})).idle


@pytest.mark.parametrize(("discard", "expected"), [
    (DiscardParams("t1"), Discard("t1")),  # the client went away during the prefill: only the id is known
    (DiscardParams("t1", Address("127.0.0.1", 24001)), Discard("t1", fallback_from=Address("127.0.0.1", 24001))),
    (DiscardParams("t1", Address("127.0.0.1", 24001), pull=True), Discard("t1", Address("127.0.0.1", 24001))),
    (DiscardParams("t1", Address("127.0.0.1", 24001), prefill_tp=2),
     Discard("t1", Address("127.0.0.1", 24001), prefill_tp=2)),
])
def test_a_discard_request_frees_a_transfer_whose_request_will_not_come(discard: DiscardParams,
                                                                        expected: Discard) -> None:
    """The proxy's request of one token for a transfer whose client went away: the transfer is discarded (once),
    the request itself computed as any other; a request naming that transfer that comes after all the same computes
    its prompt here rather than waiting for KV that was freed."""
    s = side("kv_consumer")
    proxy = Req("discard", [0], discard.to_dict())
    assert s.get_num_new_matched_tokens(proxy, 0) == (0, False)
    assert s.get_num_new_matched_tokens(proxy, 0) == (0, False)
    s.update_state_after_alloc(proxy, Blocks([1]), 0)
    meta = s.build_connector_meta(step())
    assert meta.loads == [] and meta.discards == [expected]
    assert s.request_finished(proxy, [1]) == (False, None)
    late = decode_req(300)
    assert s.get_num_new_matched_tokens(late, 0) == (0, False)
    s.update_state_after_alloc(late, Blocks([5, 6, 7]), 0)
    meta = s.build_connector_meta(step())
    assert meta.loads == [] and meta.discards == []


def test_a_discard_after_the_transfer_was_claimed_changes_nothing() -> None:
    """The decode request got there first (its client went away as it was sent): its load frees the push; the
    discard that follows is ignored."""
    s = side("kv_consumer")
    req = decode_req(300)
    assert s.get_num_new_matched_tokens(req, 0) == (299, True)
    s.update_state_after_alloc(req, Blocks([5, 6, 7]), 299)
    assert len(s.build_connector_meta(step()).loads) == 1
    assert s.get_num_new_matched_tokens(Req("discard", [0], DiscardParams("t1").to_dict()), 0) == (0, False)
    assert s.build_connector_meta(step()).discards == []


def test_a_producer_ignores_discards() -> None:
    s = side("kv_producer")
    assert s.get_num_new_matched_tokens(Req("discard", [0], DiscardParams("t1").to_dict()), 0) == (0, False)
    assert s.build_connector_meta(step()).discards == []


@pytest.mark.parametrize(("status", "abandoned"), [
    ("FINISHED_ABORTED", True), ("FINISHED_ERROR", True), ("FINISHED_LENGTH_CAPPED", False),
    ("FINISHED_STOPPED", False),
])
def test_a_saved_prefill_request_that_was_aborted_is_abandoned(status: str, abandoned: bool) -> None:
    """A prefill request aborted after its prompt was saved (the client went away): its answer, which names the
    transfer, reaches nobody, so the workers stop holding its blocks for a pull. One that finished as usual keeps
    them for the decode side."""
    s = side("kv_producer")
    req = Req("p", list(range(300)), PrefillParams("t1", None).to_dict())
    s.update_state_after_alloc(req, Blocks([1, 2, 3]), 0)
    meta = s.build_connector_meta(step([SimpleNamespace(req_id="p", block_ids=([1, 2, 3],), num_computed_tokens=0)],
                                       scheduled={"p": 300}))
    assert len(meta.saves) == 1 and meta.abandoned == []
    req.set_status(status)
    delay, params = s.request_finished(req, [1, 2, 3])
    assert delay and params is not None  # the blocks go once the workers say so, either way
    assert s.build_connector_meta(step()).abandoned == (["t1"] if abandoned else [])
    assert s.build_connector_meta(step()).abandoned == []


def test_an_unsaved_prefill_request_that_was_aborted_is_not_abandoned() -> None:
    s = side("kv_producer")
    req = Req("p", list(range(300)), PrefillParams("t1", None).to_dict())
    s.update_state_after_alloc(req, Blocks([1, 2, 3]), 0)
    req.set_status("FINISHED_ABORTED")
    assert s.request_finished(req, [1, 2, 3]) == (False, None)  # nothing was offered: the blocks go at once
    assert s.build_connector_meta(step()).abandoned == []


def _saved_producer(s: SchedulerSide) -> Req:
    req = Req("p", list(range(300)), PrefillParams("t1", None).to_dict())
    s.update_state_after_alloc(req, Blocks([1, 2, 3]), 0)
    meta = s.build_connector_meta(step([SimpleNamespace(req_id="p", block_ids=([1, 2, 3],), num_computed_tokens=0)],
                                       scheduled={"p": 300}))
    assert len(meta.saves) == 1
    return req


@pytest.mark.parametrize("finished_first", [True, False])
def test_a_discard_sent_to_the_prefill_instance_abandons_the_saved_transfer(finished_first: bool) -> None:
    """The proxy's client went away during the prefill: had the prefill finished, its answer went to nobody. The
    discard the proxy sends the prefill instance makes the workers stop holding the blocks for a pull; once."""
    s = side("kv_producer")
    req = _saved_producer(s)
    if finished_first:
        req.set_status("FINISHED_LENGTH_CAPPED")
        assert s.request_finished(req, [1, 2, 3])[0]
    discard = Req("discard", [0], DiscardParams("t1").to_dict())
    assert s.get_num_new_matched_tokens(discard, 0) == (0, False)
    assert s.get_num_new_matched_tokens(discard, 0) == (0, False)
    meta = s.build_connector_meta(step())
    assert meta.abandoned == ["t1"] and meta.discards == []
    req.set_status("FINISHED_ABORTED")
    s.request_finished(req, [1, 2, 3])
    assert s.build_connector_meta(step()).abandoned == []


def test_a_transfer_abandoned_before_its_prompt_is_saved_is_not_saved() -> None:
    s = side("kv_producer")
    req = Req("p", list(range(300)), PrefillParams("t1", None).to_dict())
    s.update_state_after_alloc(req, Blocks([1, 2, 3]), 0)
    assert s.get_num_new_matched_tokens(Req("discard", [0], DiscardParams("t1").to_dict()), 0) == (0, False)
    meta = s.build_connector_meta(step([SimpleNamespace(req_id="p", block_ids=([1, 2, 3],), num_computed_tokens=0)],
                                       scheduled={"p": 300}))
    assert meta.saves == [] and meta.abandoned == []
    assert s.request_finished(req, [1, 2, 3]) == (False, None)  # nothing held: the blocks go at once


def test_a_consumer_leaves_its_own_transfers_alone_on_a_discard() -> None:
    """A decode instance is not where the transfer was produced: a discard there frees staging, nothing else."""
    s = side("kv_consumer")
    assert s.get_num_new_matched_tokens(Req("discard", [0], DiscardParams("t1").to_dict()), 0) == (0, False)
    meta = s.build_connector_meta(step())
    assert meta.abandoned == [] and meta.discards == [Discard("t1")]


def test_decode_requests_waiting_for_blocks_keep_their_transfers_wanted() -> None:
    """Decode requests queued in vLLM are tracked from `on_new_request`: every third of the lease (here 0.3 s),
    the step's metadata names the transfers of those that waited that long, by prefill instance (with its rank
    count), so the workers keep their staging and ask the prefill instance to keep their blocks. A request stops
    being named once it has its blocks or is finished; a prefill instance tracks nothing."""
    config = parse_connector_config("kv_consumer", 21001, "recompute", {"kv_host": "127.0.0.1", "lease_s": 0.3})
    s = SchedulerSide(config, BS)
    here, there = Address("10.0.0.1", 5000), Address("10.0.0.2", 5000)
    reqs = [Req(f"r{i}", list(range(300)), DecodeParams(f"t{i}", 300, at, pull=True, prefill_tp=tp).to_dict())
            for i, (at, tp) in enumerate([(here, 0), (here, 0), (there, 2)])]
    sample = Req("r0-sample", list(range(300)), reqs[0].kv_transfer_params)  # n > 1: the same transfer
    pushed = Req("r3", list(range(300)), DecodeParams("t3", 300, None).to_dict())  # no prefill address to ask
    for req in [*reqs, sample, pushed]:
        s.on_new_request(req)
    assert s.build_connector_meta(step()).wanted == []  # not waited long yet
    time.sleep(0.11)
    assert {(w.prefill, w.transfer_ids, w.prefill_ranks) for w in s.build_connector_meta(step()).wanted} == {
        (here, ("t0", "t1"), 1), (there, ("t2",), 2)}
    assert s.build_connector_meta(step()).wanted == []  # once per interval
    s.update_state_after_alloc(reqs[0], Blocks([1, 2, 3]), 299)  # it has its blocks: its load starts
    reqs[1].set_status("FINISHED_ABORTED")
    s.request_finished(reqs[1], [])
    time.sleep(0.11)
    assert {(w.prefill, w.transfer_ids) for w in s.build_connector_meta(step()).wanted} == {
        (here, ("t0",)), (there, ("t2",))}  # the sample still waits (for the first sample's load)
    producer = side("kv_producer")
    producer.on_new_request(reqs[2])
    time.sleep(0.11)
    assert producer.build_connector_meta(step()).wanted == []


def test_renewals_go_before_the_prefill_instances_own_lease_runs_out() -> None:
    """A prefill instance says its lease in its answer; where it is shorter than the decode side's, the decode side
    renews that request's transfer every third of it, and others at their own pace. Requests whose times come
    near together are named together."""
    config = parse_connector_config("kv_consumer", 21001, "recompute", {"kv_host": "127.0.0.1", "lease_s": 30})
    s = SchedulerSide(config, BS)
    short, long_ = Address("10.0.0.1", 5000), Address("10.0.0.2", 5000)
    reqs = [Req("a", list(range(300)), DecodeParams("ta", 300, short, pull=True, lease_s=0.6).to_dict()),
            Req("b", list(range(300)), DecodeParams("tb", 300, long_, pull=True, lease_s=60).to_dict()),
            Req("c", list(range(300)), DecodeParams("tc", 300, long_, pull=True).to_dict())]  # lease not said
    for req in reqs:
        s.on_new_request(req)
    assert s.build_connector_meta(step()).wanted == []
    time.sleep(0.21)
    assert [(w.prefill, w.transfer_ids) for w in s.build_connector_meta(step()).wanted] == [(short, ("ta",))]
    time.sleep(0.1)
    assert s.build_connector_meta(step()).wanted == []  # named again a third of its lease after: not yet
    time.sleep(0.11)
    assert [(w.prefill, w.transfer_ids) for w in s.build_connector_meta(step()).wanted] == [(short, ("ta",))]
    d = SchedulerSide(parse_connector_config("kv_consumer", 21001, "recompute",
                                             {"kv_host": "127.0.0.1", "lease_s": 0.6}), BS)
    d.on_new_request(reqs[1])  # the decode side's own lease is the shorter
    time.sleep(0.08)
    d.on_new_request(reqs[2])
    time.sleep(0.13)
    # b's time has come and c's is at most 0.07 s away (within half an interval): both go in one renewal.
    assert [(w.prefill, w.transfer_ids) for w in d.build_connector_meta(step()).wanted] == [(long_, ("tb", "tc"))]


def test_a_producer_says_its_lease_in_its_answer() -> None:
    config = parse_connector_config("kv_producer", 21001, "recompute", {"kv_host": "127.0.0.1", "lease_s": 7.5})
    s = SchedulerSide(config, BS)
    req = Req("p", list(range(40)), PrefillParams("t8", None, pull=True).to_dict())
    s.update_state_after_alloc(req, Blocks([4]), 0)
    s.build_connector_meta(step([SimpleNamespace(req_id="p", block_ids=([4],), num_computed_tokens=0)],
                                scheduled={"p": 40}))
    returned = parse_transfer_params(s.request_finished(req, [4])[1])
    assert isinstance(returned, DecodeParams) and returned.lease_s == 7.5 and returned.pull


LEGACY = "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_" + "0123456789abcdef" * 2


@pytest.mark.parametrize("send_type", ["PUT_ASYNC", "GET"])
def test_requests_named_by_an_old_proxy_move_their_kv(send_type: str) -> None:
    """The old connector's proxy sends no kv_transfer_params; its request id (in vLLM's, with vLLM's suffix) names
    both KV addresses. The prefill instance saves the prompt for the decode address (or holds it for a pull, with
    send_type GET), and the decode instance loads it, keyed alike on both sides whatever vLLM's suffixes."""
    extra = {"kv_host": "10.0.0.1", "send_type": send_type}
    producer = SchedulerSide(parse_connector_config("kv_producer", 21001, "recompute", extra), BS)
    req = Req(f"cmpl-{LEGACY}-0-1a2b3c4d", list(range(300)), None)
    assert producer.get_num_new_matched_tokens(req, 0) == (0, False)
    producer.update_state_after_alloc(req, Blocks([1, 2, 3]), 0)
    new = [SimpleNamespace(req_id=req.request_id, block_ids=([1, 2, 3],), num_computed_tokens=0)]
    saves = producer.build_connector_meta(step(new, scheduled={req.request_id: 300})).saves
    tid = "legacy-" + "0123456789abcdef" * 2 + "-0"
    pull = send_type == "GET"
    assert [(sv.transfer_id, sv.peer, sv.block_ids) for sv in saves] == [
        (tid, None if pull else Address("10.0.0.2", 22001), (1, 2, 3))]
    # Held for a pull, the transfer names the decode instance that will pull it (its one rank, as ours).
    assert [(sv.pulled_by, sv.pullers) for sv in saves] == [(Address("10.0.0.2", 22001) if pull else None, 1)]
    assert [sv.puller_launch for sv in saves] == [""]  # the old proxy says no start
    delay, answer = producer.request_finished(req, [1, 2, 3])
    assert delay is True and parse_transfer_params(answer).transfer_id == tid  # type: ignore[union-attr]

    consumer = SchedulerSide(parse_connector_config("kv_consumer", 22001, "recompute",
                                                    {**extra, "kv_host": "10.0.0.2"}), BS)
    decode = Req(f"cmpl-{LEGACY}-0-99887766", list(range(300)), None)
    consumer.on_new_request(decode)
    assert consumer.get_num_new_matched_tokens(decode, 0) == (299, True)
    consumer.update_state_after_alloc(decode, Blocks([7, 8, 9]), 299)
    (load,) = consumer.build_connector_meta(step()).loads
    assert (load.transfer_id, load.block_ids, load.fallback_from) == (tid, (7, 8, 9), Address("10.0.0.1", 21001))
    assert load.pull_from == (Address("10.0.0.1", 21001) if pull else None)


def test_old_proxy_ids_are_not_read_where_params_say_otherwise_or_on_kv_both() -> None:
    consumer = side("kv_consumer")
    own = decode_req(300, "t-own")
    own.request_id = f"cmpl-{LEGACY}-0-1a2b3c4d"  # kv_transfer_params of its own win
    assert consumer.get_num_new_matched_tokens(own, 0) == (299, True)
    consumer.update_state_after_alloc(own, Blocks([1, 2, 3]), 299)
    assert [ld.transfer_id for ld in consumer.build_connector_meta(step()).loads] == ["t-own"]
    both = side("kv_both")  # it cannot tell which of the two it is asked to be
    assert both.get_num_new_matched_tokens(Req(f"cmpl-{LEGACY}-0-1", list(range(300)), None), 0) == (0, False)
    plain = Req("cmpl-0123456789abcdef-0-1a2b3c4d", list(range(300)), None)
    assert consumer.get_num_new_matched_tokens(plain, 0) == (0, False)


def test_a_request_with_invalid_params_is_not_tracked_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    s = side("kv_consumer")
    req = Req("bad", list(range(10)), {"p2pkv": 1, "transfer_id": 5})
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert len([r for r in caplog.records if "invalid kv_transfer_params" in r.getMessage()]) == 1


def test_a_cache_reset_is_told_to_the_workers_once_and_keeps_vllm_stepping_until_then() -> None:
    """vLLM resets its caches (after a weight update): the next step's metadata tells the workers to drop what
    is staged, before that step's loads; until that step, the connector asks vLLM to keep stepping (an idle or
    paused engine would not step otherwise)."""
    s = side("kv_consumer")
    assert not s.reset_pending and s.build_connector_meta(step()).reset is False
    req = decode_req(300)
    s.reset()
    assert s.reset_pending
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, Blocks([5, 6, 7]), 299)
    meta = s.build_connector_meta(step())
    assert meta.reset and [load.transfer_id for load in meta.loads] == ["t1"]  # dropped first, then loaded
    assert not s.reset_pending and s.build_connector_meta(step()).reset is False


@pytest.mark.parametrize("finished", [True, False])
def test_a_cache_reset_stops_offering_blocks_held_for_a_pull(finished: bool) -> None:
    """On a prefill instance, blocks held for a pull hold KV computed before the reset: no longer offered (the
    decode side computes the prompt), and freed, which vLLM's own reset waits for. A transfer that was already
    abandoned is not named twice; a prompt saved after the reset is offered as usual."""
    s = side("kv_producer")
    req = _saved_producer(s)
    if finished:
        req.set_status("FINISHED_LENGTH_CAPPED")
        assert s.request_finished(req, [1, 2, 3])[0]
    s.reset()
    assert s.build_connector_meta(step()).abandoned == ["t1"]
    s.reset()
    assert s.build_connector_meta(step()).abandoned == []
    later = Req("q", list(range(300)), PrefillParams("t2", None).to_dict())
    s.update_state_after_alloc(later, Blocks([4, 5, 6]), 0)
    meta = s.build_connector_meta(step([SimpleNamespace(req_id="q", block_ids=([4, 5, 6],), num_computed_tokens=0)],
                                       scheduled={"q": 300}))
    assert [save.transfer_id for save in meta.saves] == ["t2"] and meta.abandoned == []
