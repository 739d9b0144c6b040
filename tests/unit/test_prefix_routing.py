"""The prefix policy: the proxy's index of the instances' cached blocks, fed by vLLM's own KV event publisher, and
the prefill choice it makes from it, through a real proxy with discovery and stub instances."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

from p2pkv.discovery import HeartbeatSender, parse_announcement
from p2pkv.discovery.events import announced_endpoint
from p2pkv.errors import ProtocolError
from p2pkv.params import Address
from p2pkv.protocol import Heartbeat, encode_datagram
from p2pkv.proxy import ProxyConfig, create_app
from p2pkv.proxy.instances import Instance
from p2pkv.proxy.kvevents import EventFeeds, subscribable
from p2pkv.proxy.metrics import ProxyMetrics
from p2pkv.proxy.prefixes import PrefixIndex
from p2pkv.proxy.registry import InstanceState, Policy, Pool
from tests.helpers.servers import serve
from tests.helpers.stubs import stub_decode, stub_prefill
from tests.helpers.unit import discovering_proxy, metric, wait_for
from tests.unit.test_proxy_poll import instance

BS = 4  # block size of the events here
SYSTEM_A = list(range(100, 112))  # three blocks
SYSTEM_B = list(range(200, 212))


def batch(*events: Any, ts: float = 0.0) -> bytes:
    """Events as vLLM's publisher puts them on the wire."""
    return msgspec.msgpack.encode(KVEventBatch(ts=ts, events=list(events)))


def stored(tokens: list[int], hashes: list[Any], parent: Any = None, **more: Any) -> BlockStored:
    fields = {"lora_id": None, "medium": "GPU", "lora_name": None, **more}
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, **fields)


def test_the_index_follows_stored_removed_and_cleared_blocks_by_their_tokens() -> None:
    index = PrefixIndex()
    index.apply("a", 0, batch(stored(SYSTEM_A[:8], [b"h1", b"h2"])))
    index.apply("a", 1, batch(stored(SYSTEM_A[8:], [b"h3"], parent=b"h2")))
    prompt = [*SYSTEM_A, 7, 8, 9, 10, 11]
    assert index.hits(["a", "b"], prompt) == {"a": 12, "b": 0}
    # Another prompt sharing the first block only; a prompt differing in the first token shares nothing.
    assert index.hits(["a"], [*SYSTEM_A[:4], 0, 0, 0, 0]) == {"a": 4}
    assert index.hits(["a"], [0, *SYSTEM_A[1:]]) == {"a": 0}
    # An evicted middle block ends the prefix there, though its child is still cached.
    index.apply("a", 2, batch(BlockRemoved(block_hashes=[b"h2"], medium="GPU")))
    assert index.hits(["a"], prompt) == {"a": 4}
    index.apply("a", 3, batch(AllBlocksCleared()))
    assert index.hits(["a"], prompt) == {"a": 0}


def test_blocks_that_depend_on_more_than_tokens_or_have_no_known_parent_never_match() -> None:
    index = PrefixIndex()
    # The parent of these was never said (an event lost): they cannot be placed.
    index.apply("a", 5, batch(stored(SYSTEM_A[4:8], [b"x2"], parent=b"unknown")))
    assert index.hits(["a"], SYSTEM_A) == {"a": 0}
    index.apply("a", 6, batch(stored(SYSTEM_B[:4], [b"l1"], lora_name="adapter")))
    index.apply("a", 7, batch(stored(SYSTEM_A[:8], [b"m1", b"m2"], extra_keys=[None, ("image-1", 0)])))
    assert index.hits(["a"], SYSTEM_B) == {"a": 0}
    assert index.hits(["a"], SYSTEM_A) == {"a": 4}  # the first block, not the one with an image in it
    # Another KV cache group's blocks (a hybrid model's sliding window) are not a prefix.
    index.apply("b", 0, batch(stored(SYSTEM_A, [b"g1", b"g2", b"g3"], group_idx=1)))
    assert index.hits(["b"], SYSTEM_A) == {"b": 0}
    index.apply("a", 10, batch())
    assert index.instances["a"].gaps == 2  # batches 8 and 9 never arrived (those before the first are not known)


def _deep(n: int) -> bytes:
    return b"\x91" * n + b"\x00"  # n nested one-item msgpack arrays


@pytest.mark.parametrize("payload, error", [
    (b"\xc1", "not msgpack"),
    (_deep(100_000), "not msgpack|event batch"),
    (msgspec.msgpack.encode({"ts": 1}), "event batch"),
])
def test_a_batch_that_is_not_one_is_refused(payload: bytes, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        PrefixIndex().apply("a", 0, payload)


@pytest.mark.parametrize("event, error", [
    ({"type": "BlockStored", "block_hashes": [b"h"], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 4},
     "block_size integers per block"),
    ({"type": "BlockStored", "block_hashes": [b"h"], "token_ids": [[1], 2, 3, 4], "block_size": 4}, "integers"),
    ({"type": "BlockStored", "block_hashes": [b"h"], "parent_block_hash": [1], "token_ids": [1, 2, 3, 4],
      "block_size": 4}, "parent_block_hash"),
    ({"type": "BlockStored", "block_hashes": [b"h"], "token_ids": [1], "block_size": 0}, "block_size"),
    ({"type": "BlockStored", "block_hashes": [b"h"], "token_ids": [1, 2, 3, 4], "block_size": 4, "medium": [1]},
     "medium"),
    ({"type": "Unheard"}, "unknown event type"),
    ({"type": "BlockRemoved", "block_hashes": [1.5]}, "block_hashes"),
    ("not a map", "not a map"),
])
def test_a_malformed_event_is_skipped_and_the_rest_of_its_batch_applied(event: Any, error: str) -> None:
    index = PrefixIndex()
    payload = msgspec.msgpack.encode([0.0, [event, stored(SYSTEM_A[:4], [b"a1"])]])
    assert index.apply("a", 0, payload) == (1, 1)
    assert error in index.last_error
    assert index.hits(["a"], SYSTEM_A) == {"a": 4}


def test_copies_said_again_count_once_and_a_copy_in_another_medium_keeps_the_block_held() -> None:
    index = PrefixIndex()
    index.apply("a", 0, batch(stored(SYSTEM_A[4:8], [b"a2"], parent=b"a1")))  # its parent not said yet
    # vLLM's full report mode says cached blocks again from the first: the second is placed now, once.
    for seq in (1, 2):
        index.apply("a", seq, batch(stored(SYSTEM_A[:8], [b"a1", b"a2"])))
    assert index.instances["a"].held and set(index.instances["a"].held.values()) == {1}
    assert index.hits(["a"], SYSTEM_A) == {"a": 8}
    index.apply("a", 3, batch(stored(SYSTEM_A[:8], [b"a1", b"a2"], medium="CPU")))  # offloaded copies
    index.apply("a", 4, batch(BlockRemoved(block_hashes=[b"a1", b"a2"], medium="GPU")))
    assert index.hits(["a"], SYSTEM_A) == {"a": 8}, "the CPU copies still hold them"
    index.apply("a", 5, batch(BlockRemoved(block_hashes=[b"a1", b"a2"], medium="CPU")))
    assert index.hits(["a"], SYSTEM_A) == {"a": 0} and not index.instances["a"].held


def test_a_publisher_that_starts_again_starts_the_index_again_and_other_block_sizes_are_not_taken() -> None:
    index = PrefixIndex()
    index.apply("a", 7, batch(stored(SYSTEM_A, [b"a1", b"a2", b"a3"])))
    index.apply("a", 8, batch(BlockStored(block_hashes=[b"x"], parent_block_hash=None, token_ids=SYSTEM_B[:2],
                                          block_size=2, lora_id=None, medium="GPU", lora_name=None)))
    assert index.hits(["a"], SYSTEM_A) == {"a": 12} and index.instances["a"].block_size == BS
    index.apply("a", 0, batch())  # sequence numbers from 0 again: the instance's engine started again
    assert index.hits(["a"], SYSTEM_A) == {"a": 0}


def test_the_cheapest_instance_wins_and_queued_prompt_tokens_count_against_it() -> None:
    a, b = InstanceState(Instance.parse("h:1"), "prefill"), InstanceState(Instance.parse("h:2"), "prefill")
    pool = Pool("prefill", Policy.PREFIX, [a, b])
    held = {a.instance.name: 900, b.instance.name: 0}

    def cost(state: InstanceState) -> int:
        return state.pending_tokens + 1000 - held[state.instance.name]

    assert pool.pick(cost=cost) is a
    a.pending_tokens = 950  # a queue longer than what its cache saves: the other computes the prompt sooner
    assert pool.pick(cost=cost) is b
    assert {pool.pick().instance.name for _ in range(4)} == {"h:1", "h:2"}  # no cost: by load, ties in turn
    # A prompt nobody holds: instances within the slack of the cheapest are as good; the emptier cache takes it.
    a.pending_tokens, held = 100, {a.instance.name: 0, b.instance.name: 0}
    fullness = {a.instance.name: 1, b.instance.name: 3}
    assert pool.pick(cost=cost, slack=250, spare=lambda s: fullness[s.instance.name]) is a
    assert pool.pick(cost=cost, slack=50, spare=lambda s: fullness[s.instance.name]) is b


def test_the_index_counts_the_prefixes_each_instance_holds_or_was_just_sent() -> None:
    index = PrefixIndex()
    index.apply("a", 0, batch(stored(SYSTEM_A, [b"a1", b"a2", b"a3"])))
    index.apply("a", 1, batch(stored(SYSTEM_B[:4], [b"b1"])))
    assert index.prefixes("a") == 2 and index.prefixes("b") == 0
    index.expect("a", [*range(400, 412)])  # a third, routed there, its events not in yet
    index.expect("a", SYSTEM_A)  # held already: not another
    assert index.prefixes("a") == 3
    index.apply("a", 2, batch(BlockRemoved(block_hashes=[b"b1"], medium="GPU")))
    assert index.prefixes("a") == 2


def test_instances_say_where_their_events_are_and_the_proxy_only_goes_there() -> None:
    assert announced_endpoint("tcp://*:5557", True, "zmq", 0, "10.0.0.5") == "tcp://10.0.0.5:5557"
    assert announced_endpoint("tcp://*:5557", True, "zmq", 2, "fe80::1") == "tcp://[fe80::1]:5559"
    assert announced_endpoint("ipc:///tmp/ev", True, "zmq", 0, "h") == "ipc:///tmp/ev"
    for endpoint, enabled, publisher, dp in (("tcp://*:5557", False, "zmq", 0), ("tcp://*:5557", True, "null", 0),
                                             ("tcp://collector:5557", True, "zmq", 0), ("tcp://*:0", True, "zmq", 0),
                                             ("ipc:///tmp/ev", True, "zmq", 1), ("inproc://ev", True, "zmq", 0)):
        assert announced_endpoint(endpoint, enabled, publisher, dp, "h") == ""
    beat = Heartbeat("prefill", "h:1", "h:2", 1.0, "e", kv_events="tcp://h:5557")
    assert parse_announcement(encode_datagram(beat, b""), b"").kv_events == "tcp://h:5557"
    for bad in ("http://h:1", "tcp://" + "h" * 300):
        with pytest.raises(ProtocolError, match="kv_events"):
            parse_announcement(encode_datagram(Heartbeat("prefill", "h:1", "", 1.0, kv_events=bad), b""), b"")
    # A heartbeat cannot point the proxy at another host, nor at a local socket from afar.
    assert subscribable("tcp://10.0.0.5:5557", "10.0.0.5") and not subscribable("tcp://10.0.0.9:5557", "10.0.0.5")
    assert subscribable("ipc:///tmp/ev", "127.0.0.1") and not subscribable("ipc:///tmp/ev", "10.0.0.5")


@contextmanager
def prefix_cluster(tmp_path: Path, publish: bool = True, failing: str = "", **options: Any
                   ) -> Iterator[tuple[str, dict[str, tuple[str, list[dict[str, Any]]]], dict[str, Any]]]:
    """A proxy with the prefix policy (and `options`) and two stub prefill instances (`failing` answers 500) and a
    stub decode instance that announce themselves by heartbeats, each with a vLLM event publisher of its own (unless
    not `publish`): the
    proxy's address, the instances (name: address, requests seen; "d" the decode instance), the publishers by
    name."""
    with ExitStack() as stack:
        # Ten missed heartbeats of 0.2 s before an instance is dropped: a loaded machine may stall a second.
        proxy, _, port = stack.enter_context(discovering_proxy(misses=10.0, prefill_policy="prefix", **options))
        d_seen: list[dict[str, Any]] = []
        d = stack.enter_context(serve(stub_decode(d_seen)))
        prefills: dict[str, tuple[str, list[dict[str, Any]]]] = {}
        publishers: dict[str, Any] = {}
        d_endpoint = f"ipc://{tmp_path}/d" if publish else ""
        if publish:
            publishers["d"] = ZmqEventPublisher(0, endpoint=d_endpoint)
            stack.callback(publishers["d"].shutdown)
        senders = [HeartbeatSender(Address("127.0.0.1", port), "decode", Address.parse(d), Address("127.0.0.1", 9),
                                   0.2, b"", kv_events=d_endpoint)]
        for name in ("p0", "p1"):
            seen: list[dict[str, Any]] = []
            address = stack.enter_context(serve(stub_prefill(seen, fail=name == failing)))
            prefills[name] = address, seen
            endpoint = f"ipc://{tmp_path}/{name}" if publish else ""
            if publish:
                publishers[name] = ZmqEventPublisher(0, endpoint=endpoint)
                stack.callback(publishers[name].shutdown)
            senders.append(HeartbeatSender(Address("127.0.0.1", port), "prefill", Address.parse(address),
                                           Address("127.0.0.1", 9), 0.2, b"", kv_events=endpoint))
        for sender in senders:
            sender.start()
            stack.callback(sender.close)
        wait_for(lambda: metric(proxy, 'p2pkv_proxy_instances{role="prefill"}') == 2)
        wait_for(lambda: metric(proxy, 'p2pkv_proxy_instances{role="decode"}') == 1)
        yield proxy, {**prefills, "d": (d, d_seen)}, publishers


def publish_until_indexed(proxy: str, publisher: Any, name: str, address: str, *events: Any) -> None:
    """Publish `events` until the proxy's index holds them (a subscriber hears nothing sent before it joined)."""
    gauge = f'p2pkv_proxy_kv_index_blocks{{instance="{address}"}}'
    before = metric(proxy, gauge)

    def indexed() -> bool:
        publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))
        time.sleep(0.05)
        return metric(proxy, gauge) != before

    wait_for(indexed, 15)


def prefilled_on(proxy: str, prefills: dict[str, tuple[str, list[dict[str, Any]]]], prompt: list[int]) -> str:
    """Which prefill instance prefilled `prompt` sent through the proxy."""
    counts = {name: len(seen) for name, (_, seen) in prefills.items() if name != "d"}
    body = {"model": "m", "prompt": prompt, "max_tokens": 3, "user": uuid.uuid4().hex}
    answer = httpx.post(f"http://{proxy}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200
    # The one whose prefill succeeded (a failed one was tried first, then another).
    (name,) = [n for n, (a, seen) in prefills.items() if n != "d" and len(seen) > counts[n]
               and a == answer.headers["x-p2pkv-prefill"]] or ["none"]
    assert answer.headers["x-p2pkv-prefill"] == (prefills[name][0] if name != "none" else "none")
    return name


def test_a_prompt_goes_to_the_prefill_instance_holding_its_prefix_until_that_one_drops_it(tmp_path: Path) -> None:
    with prefix_cluster(tmp_path) as (proxy, prefills, publishers):
        p0, p1 = prefills["p0"][0], prefills["p1"][0]
        publish_until_indexed(proxy, publishers["p0"], "p0", p0, stored(SYSTEM_A, [b"a1", b"a2", b"a3"]))
        publish_until_indexed(proxy, publishers["p1"], "p1", p1, stored(SYSTEM_B, [b"b1", b"b2", b"b3"]))
        for question in range(6):
            assert prefilled_on(proxy, prefills, [*SYSTEM_A, question]) == "p0"
            assert prefilled_on(proxy, prefills, [*SYSTEM_B, question]) == "p1"
        assert metric(proxy, 'p2pkv_proxy_prefix_choices_total{outcome="indexed"}') == 12
        assert metric(proxy, f'p2pkv_proxy_prefill_expected_cached_tokens_total{{instance="{p0}"}}') == 6 * 12
        assert metric(proxy, f'p2pkv_proxy_prefill_prompt_tokens_total{{instance="{p0}"}}') == 6 * 13
        assert metric(proxy, f'p2pkv_proxy_kv_events_total{{instance="{p0}",outcome="applied"}}') >= 1
        # A prompt nobody holds goes by load (ties in turn); one p0 was just sent counts as held there for a while,
        # so a second one right after follows it.
        fresh = list(range(300, 313))
        first = prefilled_on(proxy, prefills, fresh)
        assert prefilled_on(proxy, prefills, [*fresh[:12], 99]) == first
        # p0's cache emptied (its prefix cache reset), and p1 computed the prefix since: it goes there now.
        publish_until_indexed(proxy, publishers["p0"], "p0", p0, AllBlocksCleared())
        publish_until_indexed(proxy, publishers["p1"], "p1", p1, stored(SYSTEM_A, [b"c1", b"c2", b"c3"]))
        assert {prefilled_on(proxy, prefills, [*SYSTEM_A, q]) for q in range(4)} == {"p1"}


def test_a_garbled_batch_is_counted_and_a_restarted_instance_starts_from_nothing(tmp_path: Path) -> None:
    index, metrics = PrefixIndex(), ProxyMetrics()
    state = InstanceState(Instance.parse("127.0.0.1:1"), "prefill", engine_id="e1", kv_events=f"ipc://{tmp_path}/x")
    feeds = EventFeeds(index, metrics, lambda: [state])
    feeds.sync()
    name = state.instance.name
    for frames in ([b"", (0).to_bytes(8, "big"), b"\xc1garbage"], [b"only one frame"]):
        feeds.take(name, frames)
    feeds.take(name, [b"", (1).to_bytes(8, "big"), batch(stored(SYSTEM_A, [b"a1", b"a2", b"a3"]))])
    assert metrics.kv_events.labels(name, "bad")._value.get() == 2
    assert metrics.kv_events.labels(name, "applied")._value.get() == 1
    assert index.hits([name], SYSTEM_A) == {name: 12}
    state.engine_id = "e2"  # its heartbeats say it restarted: its cache is empty
    feeds.sync()
    assert index.hits([name], SYSTEM_A) == {name: 0}
    asyncio.run(_closed(feeds))


async def _closed(feeds: EventFeeds) -> None:
    task = asyncio.create_task(feeds.run())
    await asyncio.sleep(0.1)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_without_events_every_request_is_answered_by_load(tmp_path: Path) -> None:
    with prefix_cluster(tmp_path, publish=False) as (proxy, prefills, _):
        chosen = [prefilled_on(proxy, prefills, [*SYSTEM_A, q]) for q in range(6)]
        assert set(chosen) == {"p0", "p1"}
        assert metric(proxy, 'p2pkv_proxy_prefix_choices_total{outcome="no_events"}') == 6


def test_a_prompt_with_little_left_to_compute_on_its_decode_instance_goes_there_alone(tmp_path: Path) -> None:
    """`--decode-only-below`: a short prompt, or one whose prefix the decode instance's cache holds (its events say),
    skips the prefill hop; the answer says why, and a metric counts it."""
    with prefix_cluster(tmp_path, decode_only_below=6) as (proxy, instances, publishers):
        d, d_seen = instances["d"]
        assert prefilled_on(proxy, instances, [1, 2, 3, 4, 5]) == "none"
        assert "kv_transfer_params" not in d_seen[-1] and d_seen[-1]["prompt"] == [1, 2, 3, 4, 5]
        assert metric(proxy, 'p2pkv_proxy_decode_only_cheaper_total{reason="short"}') == 1
        assert prefilled_on(proxy, instances, [*SYSTEM_A, 1, 2]) in ("p0", "p1")  # 14 tokens, none held
        publish_until_indexed(proxy, publishers["d"], "d", d, stored(SYSTEM_A, [b"a1", b"a2", b"a3"]))
        body = {"model": "m", "prompt": [*SYSTEM_A, 1, 2], "max_tokens": 3}
        answer = httpx.post(f"http://{proxy}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200 and answer.headers["x-p2pkv-prefill"] == "none"
        assert answer.headers["x-p2pkv-route"] == "decode-only: 2 of 14 prompt tokens to compute there, under " \
            "--decode-only-below 6"
        assert metric(proxy, 'p2pkv_proxy_decode_only_cheaper_total{reason="cached"}') == 1
        assert prefilled_on(proxy, instances, [*SYSTEM_B, 1, 2]) in ("p0", "p1")


def test_static_instances_say_where_their_events_are_in_their_probe_answers(tmp_path: Path) -> None:
    """A proxy with static lists asks each instance by probes what its heartbeats would say, where its KV cache
    events are among it: the prefix policy works without discovery."""
    with ExitStack() as stack:
        seen: dict[str, list[dict[str, Any]]] = {"p0": [], "p1": []}
        addresses, publishers = {}, {}
        for name in seen:
            endpoint = f"ipc://{tmp_path}/{name}"
            publishers[name] = ZmqEventPublisher(0, endpoint=endpoint)
            stack.callback(publishers[name].shutdown)
            addresses[name] = stack.enter_context(serve(instance(seen[name], lambda e=endpoint: {
                "kv_port": 21001, "kv_host": "", "engine_id": "e", "kv_events": e})))
        d = stack.enter_context(serve(stub_decode([])))
        config = ProxyConfig(prefill=tuple(Instance.parse(a) for a in addresses.values()),
                             decode=(Instance.parse(f"{d}@127.0.0.1:22001"),), discovery_port=0,
                             probe_interval_s=0.2, prefill_policy="prefix")
        proxy = stack.enter_context(serve(create_app(config)))
        publish_until_indexed(proxy, publishers["p1"], "p1", addresses["p1"], stored(SYSTEM_A, [b"a1", b"a2", b"a3"]))
        for question in range(4):
            body = {"model": "m", "prompt": [*SYSTEM_A, question], "max_tokens": 3}
            answer = httpx.post(f"http://{proxy}/v1/completions", json=body, timeout=30)
            assert answer.status_code == 200 and answer.headers["x-p2pkv-prefill"] == addresses["p1"]
        assert len(seen["p1"]) == 4 and not seen["p0"]


def test_a_prompt_whose_prefill_failed_is_not_expected_where_it_failed(tmp_path: Path) -> None:
    """A prompt routed to an instance counts as held there until its events come, but only if its prefill there
    succeeded: a failing instance must not attract the prompt's later requests as if it held it."""
    with prefix_cluster(tmp_path, failing="p0", prefill_retries=0) as (proxy, prefills, publishers):
        p0, p1 = prefills["p0"][0], prefills["p1"][0]
        publish_until_indexed(proxy, publishers["p0"], "p0", p0, stored(SYSTEM_A, [b"a1", b"a2", b"a3"]))
        publish_until_indexed(proxy, publishers["p1"], "p1", p1, stored(SYSTEM_B, [b"b1", b"b2", b"b3"]),
                              stored(list(range(600, 612)), [b"c1", b"c2", b"c3"]))
        fresh = list(range(500, 513))
        expected = f'p2pkv_proxy_prefill_expected_cached_tokens_total{{instance="{p0}"}}'
        for question in range(3):
            # Nobody holds it: p0, the cache with fewer prefixes, is tried, fails, and the decode instance
            # computes it.
            assert prefilled_on(proxy, prefills, [*fresh[:12], question]) == "none"
            assert metric(proxy, expected) == 0, "p0 was taken to hold a prompt it failed to prefill"
        assert len(prefills["p0"][1]) == 3
