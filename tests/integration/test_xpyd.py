"""`p2pkv up --prefill 2 --decode 2` on real vLLM: concurrent requests all succeed with output equal to a
colocated instance, and keep succeeding after one prefill instance is killed mid-run, then a decode instance; the
decode instance started again is pushed to over new connections, and no load fails."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from p2pkv.kv.staging import STAGE_ENV
from p2pkv.params import Address, DecodeParams, PrefillParams, parse_transfer_params
from tests.helpers.relay import FlipRelay
from tests.helpers.router import router
from tests.integration.conftest import (
    MAX_TOKENS,
    Oracle,
    complete,
    greedy,
    ids_and_logprobs,
    listed,
    metric,
    prompt,
    record_starts,
    started_again,
    up_with_colocated,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def cluster_2p2d(tiny_model: str, tmp_path_factory: pytest.TempPathFactory,
                 oracle: Oracle) -> Iterator[dict[str, Any]]:
    # The clean stop at the end also checks that `p2pkv up` still serves after losing a prefill instance.
    # This cluster moves KV over tcp (the 1P1D one uses shm, the default between instances of one host), and
    # through host buffers as a GPU cache does (P2PKV_STAGE_KV): the GPU path's logic, run on vLLM's CPU build.
    # Every push carries its digest, checked where it lands (integrity_check).
    work = tmp_path_factory.mktemp("xpyd")
    # Prefill instances are chosen by the prompt blocks their KV cache events say they hold; dev mode serves
    # vLLM's /reset_prefix_cache.
    up_args = ("--prefill", "2", "--decode", "2", "--prefill-policy", "prefix")
    with up_with_colocated(tiny_model, work, {"transport": "tcp", "integrity_check": True}, [], up_args,
                           {STAGE_ENV: "1", "VLLM_SERVER_DEV_MODE": "1"}, shared=oracle) as (proc, info, coloc):
        info.update(model=tiny_model, colocated=coloc, up=proc)
        record_starts(info)
        yield info


def _run_batch(info: dict[str, Any], tags: list[str]) -> None:
    texts = [prompt(tag, 40 + (i * 37) % 400) for i, tag in enumerate(tags)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda t: greedy(info["proxy"], info["model"], t), texts))
    for text, answer in zip(texts, answers, strict=True):
        reference = greedy(info["colocated"], info["model"], text)
        assert ids_and_logprobs(answer)[0] == ids_and_logprobs(reference)[0]


def _by_hand(info: dict[str, Any], text: str, kv_address: str) -> tuple[str, dict[str, Any]]:
    """The proxy's two steps by hand, the prefill pushing to `kv_address`: the transfer id and the answer."""
    prefill, decode = (next(i for i in info["instances"] if i["role"] == r) for r in ("kv_producer", "kv_consumer"))
    params = PrefillParams(uuid.uuid4().hex, Address.parse(kv_address))
    body = {"model": info["model"], "prompt": text, "max_tokens": 1, "kv_transfer_params": params.to_dict()}
    returned = parse_transfer_params(complete(f"http://{prefill['http']}", body)["kv_transfer_params"])
    assert isinstance(returned, DecodeParams)
    body = {"model": info["model"], "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "return_token_ids": True, "ignore_eos": True, "kv_transfer_params": returned.to_dict()}
    return params.transfer_id, complete(f"http://{decode['http']}", body)


def test_kv_damaged_on_the_wire_is_dropped_and_recomputed(cluster_2p2d: dict[str, Any]) -> None:
    """integrity_check end to end: a relay between prefill0 and decode0 flips one byte of the first push's payload;
    decode0 finds the digest wrong, drops the transfer and vLLM recomputes the prompt, so the answer is still the
    colocated one. The next push through the relay lands whole."""
    decode = next(i for i in cluster_2p2d["instances"] if i["role"] == "kv_consumer")
    mismatch = 'p2pkv_digests_total{direction="receive",outcome="mismatch"}'
    failed = 'p2pkv_transfers_total{direction="load",outcome="failed"}'
    before = metric(decode["metrics"], mismatch), metric(decode["metrics"], failed)
    relay = FlipRelay(decode["kv"], at=100_000, upstream=True)  # inside the first layer's 384 KiB
    try:
        for tag, damaged in (("wire-hit", True), ("wire-after", False)):
            text = prompt(tag, 300)
            tid, answer = _by_hand(cluster_2p2d, text, relay.address)
            assert relay.flipped.is_set()
            reference = greedy(cluster_2p2d["colocated"], cluster_2p2d["model"], text)
            assert ids_and_logprobs(answer)[0] == ids_and_logprobs(reference)[0]
            # One damaged transfer, one load failed (then recomputed); the next one loaded all but the last token.
            assert metric(decode["metrics"], mismatch) - before[0] == 1
            assert metric(decode["metrics"], failed) - before[1] == 1
            if not damaged:
                assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 299, tid
    finally:
        relay.close()
    log = (Path(cluster_2p2d["log_dir"]) / f"{decode['name']}.log").read_text(errors="replace")
    assert "do not match the sender's digest" in log


def test_a_router_of_vllms_standard_protocol_spreads_2p2d_and_every_prompt_is_pulled(
        cluster_2p2d: dict[str, Any]) -> None:
    """Round robin over both prefill and both decode instances by a router that knows nothing of p2pkv, 8 requests
    at once: each answers as colocated, and each decode instance pulled and loaded the prompts it was given (over
    tcp, through host buffers as a GPU cache is, digests checked)."""
    info = cluster_2p2d
    prefills = [i for i in info["instances"] if i["role"] == "kv_producer"]
    decodes = [i for i in info["instances"] if i["role"] == "kv_consumer"]
    loaded = 'p2pkv_transfers_total{direction="load",outcome="ok"}'
    before = [metric(d["metrics"], loaded) for d in decodes]
    texts = [prompt(f"standard-2p2d{i}", 60 + 45 * i) for i in range(8)]
    with router([f"http://{i['http']}" for i in prefills], [f"http://{i['http']}" for i in decodes]) as base:
        with ThreadPoolExecutor(max_workers=8) as pool:
            answers = list(pool.map(lambda t: greedy(base, info["model"], t), texts))
    for text, answer in zip(texts, answers, strict=True):
        assert ids_and_logprobs(answer)[0] == ids_and_logprobs(greedy(info["colocated"], info["model"], text))[0]
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == answer["usage"]["prompt_tokens"] - 1
    assert [metric(d["metrics"], loaded) - b for d, b in zip(decodes, before, strict=True)] == [4, 4]


def _prefilled_where(info: dict[str, Any], text: str) -> tuple[str, dict[str, Any]]:
    """`text` greedily through the proxy: the prefill instance it names in its trace header, and the answer."""
    body = {"model": info["model"], "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "return_token_ids": True, "ignore_eos": True}
    answer = httpx.post(f"{info['proxy']}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.headers["x-p2pkv-prefill"], answer.json()


def test_the_prefix_policy_sends_a_repeated_prefix_where_it_is_cached_and_forgets_a_cleared_cache(
        cluster_2p2d: dict[str, Any]) -> None:
    """vLLM's KV cache events reach the proxy: every question after a shared system prompt goes to the prefill
    instance that computed it, which then serves those blocks from its prefix cache; answers are the colocated
    instance's. Once that instance's cache is cleared, the proxy no longer counts the prompt as held there."""
    proxy = cluster_2p2d["proxy"].removeprefix("http://")
    systems = {tag: prompt(tag, 400) for tag in ("system-a", "system-b")}  # three full blocks of 128 tokens each
    holders: dict[str, set[str]] = {tag: set() for tag in systems}
    hits_before = {i["http"]: metric(i["http"], "vllm:prefix_cache_hits_total") for i in cluster_2p2d["instances"]}
    # One system prompt's questions in a row, then the other's: by load they would alternate between the two.
    for tag, system in systems.items():
        for question in range(5):
            text = f"{system} question {question}?"
            where, answer = _prefilled_where(cluster_2p2d, text)
            holders[tag].add(where)
            reference = greedy(cluster_2p2d["colocated"], cluster_2p2d["model"], text)
            assert ids_and_logprobs(answer)[0] == ids_and_logprobs(reference)[0]
    assert all(len(where) == 1 for where in holders.values()), holders
    for tag, (where,) in holders.items():
        # Four of the five found the three blocks of the system prompt cached (of the other prompt too, if there).
        assert metric(where, "vllm:prefix_cache_hits_total") - hits_before[where] >= 4 * 384, tag
    assert metric(proxy, 'p2pkv_proxy_prefix_choices_total{outcome="indexed"}') >= 8
    (where,) = holders["system-a"]
    assert httpx.post(f"http://{where}/reset_prefix_cache", timeout=30).status_code == 200
    # vLLM publishes the cleared cache with its next step: a request of less than a block, which stores nothing.
    complete(f"http://{where}", {"model": cluster_2p2d["model"], "prompt": "short", "max_tokens": 1})
    deadline = time.monotonic() + 30
    while metric(proxy, f'p2pkv_proxy_kv_index_blocks{{instance="{where}"}}') > 0:
        assert time.monotonic() < deadline, "the proxy did not hear that the cache was cleared"
        time.sleep(0.2)
    expected = sum(metric(proxy, f'p2pkv_proxy_prefill_expected_cached_tokens_total{{instance="{i["http"]}"}}')
                   for i in cluster_2p2d["instances"] if i["role"] == "kv_producer")
    _, answer = _prefilled_where(cluster_2p2d, f"{systems['system-a']} question 9?")
    assert expected == sum(metric(proxy, f'p2pkv_proxy_prefill_expected_cached_tokens_total{{instance="{i["http"]}"}}')
                           for i in cluster_2p2d["instances"] if i["role"] == "kv_producer")
    reference = greedy(cluster_2p2d["colocated"], cluster_2p2d["model"], f"{systems['system-a']} question 9?")
    assert ids_and_logprobs(answer)[0] == ids_and_logprobs(reference)[0]
    # The proxy shows each instance's own hits and queries (read every 15 s), the last request's included.
    for i in cluster_2p2d["instances"]:
        own = [metric(i["http"], f"vllm:prefix_cache_{n}_total") for n in ("hits", "queries")]
        deadline = time.monotonic() + 40
        while [metric(proxy, f'p2pkv_proxy_instance_prefix_cache_{n}{{instance="{i["http"]}"}}')
               for n in ("hits", "queries")] != own:
            assert time.monotonic() < deadline, f"the proxy does not show the prefix-cache figures of {i['http']}"
            time.sleep(0.5)
    assert own[1] > 0


def test_2p2d_serves_concurrent_requests_and_survives_a_dead_prefill(cluster_2p2d: dict[str, Any]) -> None:
    assert sum(i["role"] == "kv_producer" for i in cluster_2p2d["instances"]) == 2
    assert sum(i["role"] == "kv_consumer" for i in cluster_2p2d["instances"]) == 2
    decoders = [i for i in cluster_2p2d["instances"] if i["role"] == "kv_consumer"]
    mismatch = 'p2pkv_digests_total{direction="receive",outcome="mismatch"}'
    mismatches = sum(metric(d["metrics"], mismatch) for d in decoders)  # the relay test's
    _run_batch(cluster_2p2d, [f"x{i}" for i in range(64)])
    assert sum(metric(d["metrics"], 'p2pkv_bytes_received_total{transport="tcp"}') for d in decoders) > 0
    assert all(metric(d["metrics"], 'p2pkv_bytes_received_total{transport="shm"}') == 0 for d in decoders)
    assert sum(metric(d["metrics"], 'p2pkv_digests_total{direction="receive",outcome="ok"}') for d in decoders) > 0
    assert sum(metric(d["metrics"], mismatch) for d in decoders) == mismatches
    # Every byte went through host buffers: copied out of the prefill caches, into the decode caches.
    producers = [i for i in cluster_2p2d["instances"] if i["role"] == "kv_producer"]
    copied_out = sum(metric(p["metrics"], 'p2pkv_device_copy_bytes_total{direction="to_host"}') for p in producers)
    copied_in = sum(metric(d["metrics"], 'p2pkv_device_copy_bytes_total{direction="to_device"}') for d in decoders)
    loaded = sum(metric(d["metrics"], "p2pkv_bytes_loaded_total") for d in decoders)
    assert copied_in == loaded > 0
    assert copied_out >= loaded
    now = listed(cluster_2p2d)
    assert all(i["in_flight"] == 0 for i in now)
    # `p2pkv up` lists nothing statically: the proxy knows every instance from its heartbeats.
    assert sorted((i["role"], i["address"], i["source"]) for i in now) == sorted(
        ("prefill" if i["role"] == "kv_producer" else "decode", i["http"], "heartbeat")
        for i in cluster_2p2d["instances"])
    decode_kv = {i["address"]: i["kv_address"] for i in now if i["role"] == "decode"}
    assert decode_kv == {i["http"]: i["kv"] for i in cluster_2p2d["instances"] if i["role"] == "kv_consumer"}
    os.killpg(cluster_2p2d["pids"][0], signal.SIGKILL)  # prefill0 with its engine and worker
    killed = cluster_2p2d["instances"][0]["http"]
    _run_batch(cluster_2p2d, [f"y{i}" for i in range(32)])
    assert cluster_2p2d["up"].poll() is None, "p2pkv up must keep serving with one prefill instance left"
    # Its heartbeats stopped: the proxy drops it after three missed intervals (3 s each).
    deadline = time.monotonic() + 30
    while killed in {i["address"] for i in listed(cluster_2p2d)}:
        assert time.monotonic() < deadline, "the killed prefill instance is still listed"
        time.sleep(0.5)
    assert len(listed(cluster_2p2d)) == 3
    # Then a decode instance dies: requests the proxy sends there are refused and go again as new transfers to the
    # other one (the dead one is picked after it from then on), and all succeed.
    proxy = cluster_2p2d["proxy"].replace("/v1", "")
    reroutes = metric(proxy.removeprefix("http://"), "p2pkv_proxy_reroutes_total")
    last = max(i for i, inst in enumerate(cluster_2p2d["instances"]) if inst["role"] == "kv_consumer")
    os.killpg(cluster_2p2d["pids"][last], signal.SIGKILL)
    _run_batch(cluster_2p2d, [f"z{i}" for i in range(16)])
    assert metric(proxy.removeprefix("http://"), "p2pkv_proxy_reroutes_total") > reroutes
    assert cluster_2p2d["up"].poll() is None, "p2pkv up must keep serving with one decode instance left"


def test_a_decode_instance_started_again_is_pushed_to_over_new_connections_and_no_load_fails(
        cluster_2p2d: dict[str, Any]) -> None:
    """The decode instance the test before killed (killed here first when run alone) is started again from its
    command line and environment, as a supervisor would: the same ports, a new start. The prefill instance left had
    tcp connections to the dead one (the old connector cached its sockets forever, and a restarted peer froze it).
    The proxy hears the new start from its heartbeats and sends it requests; the prefill instance pushes to it over
    new connections: every one of its loads succeeds, and the answers are the colocated instance's."""
    instances = cluster_2p2d["instances"]
    last = max(i for i, inst in enumerate(instances) if inst["role"] == "kv_consumer")
    decode = instances[last]
    with started_again(cluster_2p2d, last, "decode-restarted"):
        before = metric(decode["http"], "vllm:e2e_request_latency_seconds_count")
        _run_batch(cluster_2p2d, [f"r{i}" for i in range(16)])
        assert metric(decode["http"], "vllm:e2e_request_latency_seconds_count") > before, "the proxy sent it some"
        assert metric(decode["metrics"], 'p2pkv_bytes_received_total{transport="tcp"}') > 0
        assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") > 0
        assert metric(decode["metrics"], 'p2pkv_transfers_total{direction="load",outcome="failed"}') == 0
        assert cluster_2p2d["up"].poll() is None

