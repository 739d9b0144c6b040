"""1P1D on real vLLM (CPU, tiny model) whose instances compute KV of the same shape differently: the decode instance
runs with another RoPE base (`--hf-overrides`, through `p2pkv up --decode-vllm-args`), as a deployment that forgot a
flag on one side. Exchanged, the prefill instance's KV would make the decode instance answer as neither
configuration does, without an error; the decode instance refuses the prefill worker at its hello instead, naming
the factor, and each request is answered as a colocated instance with the decode instance's configuration answers,
its prompt computed on the decode instance at once, not after the transfer deadline (120 s here; the client gives up
after 60). With GET, the prefill instance refuses the decode instance's pulls alike, frees the blocks it held for
it, and then holds none for it. Last, the prefill instance restarts with the decode side's settings: it is paired
again, and its first push loads, though the decode worker still notes the refusal of the old one."""

from __future__ import annotations

import json
import shlex
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from p2pkv.params import Address, DecodeParams, PrefillParams, parse_transfer_params, prompt_digest
from p2pkv.proxy import Instance, ProxyConfig, create_app
from tests.helpers.servers import serve
from tests.integration.conftest import (
    Oracle,
    answered_like,
    answers_like,
    complete,
    described_cluster,
    instance_of,
    listed,
    metric,
    prompt,
    record_starts,
    started_again,
)

pytestmark = pytest.mark.vllm
DEADLINE_S = 120.0
FAILED_LOADS = 'p2pkv_transfers_total{direction="load",outcome="failed"}'
PASSED_OVER = "p2pkv_proxy_pairs_passed_over_total"
PREFILLS = "vllm:e2e_request_latency_seconds_count"  # requests an instance finished (on its OpenAI port)
OVERRIDE = json.dumps({"rope_parameters": {"rope_theta": 100.0, "rope_type": "default"}})


@pytest.fixture(scope="module")
def mismatched(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    up_args = ("--decode-vllm-args", f"--hf-overrides {shlex.quote(OVERRIDE)}")
    with described_cluster(tiny_model, tmp_path_factory.mktemp("mismatch"), {"transfer_timeout_s": DEADLINE_S},
                           [], up_args, ("--hf-overrides", OVERRIDE)) as info:
        record_starts(info)
        yield info


def test_requests_through_a_refused_prefill_instance_are_answered_right_without_waiting_out_the_deadline(
        mismatched: dict[str, Any], oracle: Oracle) -> None:
    """Answers as the colocated instance with the decode side's settings gives them (token log-probabilities within
    1e-4), not as one with the prefill side's (vLLM's defaults: the shared oracle), which differ by more. The first
    request is prefilled on the prefill instance and its load fails at once; the decode instance's heartbeats then
    tell the proxy of the refusal, and the next requests go to the decode instance alone (the prefill instance is
    passed over: no prefill computed for nothing)."""
    decode, prefill = instance_of(mismatched, "kv_consumer"), instance_of(mismatched, "kv_producer")
    proxy = mismatched["proxy"].removeprefix("http://")
    failed, refused = metric(decode["metrics"], FAILED_LOADS), metric(decode["metrics"], "p2pkv_refused_peers_total")
    prefilled = metric(prefill["http"], PREFILLS)
    for i, length in enumerate((150, 290, 333)):
        body = {"model": mismatched["model"], "prompt": prompt(f"mismatch-{i}", length), "max_tokens": 16,
                "temperature": 0, "ignore_eos": True, "logprobs": 1}
        answers_like(mismatched["proxy"], body, mismatched["colocated"], oracle.url(), "the settings change it")
        assert metric(decode["metrics"], FAILED_LOADS) == failed + 1, "the first load failed, reported to vLLM"
        assert metric(prefill["http"], PREFILLS) == prefilled + 1, "only the first request was prefilled"
        if i == 0:
            assert metric(decode["metrics"], "p2pkv_refused_peers_total") >= refused + 1
            _wait_for_the_proxy_to_hear_of_the_refusal(proxy, prefill)
    assert metric(proxy, "p2pkv_proxy_pairs_passed_over_total") == 2
    assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") == 0
    text = (Path(mismatched["log_dir"]) / "decode0.log").read_text()
    reason = "the prefill worker that pushes it was refused: KV layout mismatch: model.rope_parameters: ours "
    assert text.count(reason) == 1
    assert text.count("refusing peer") == 1, "logged once for the prefill worker"
    # The start the decode worker refused, as the prefill worker's hello named it, is the start the prefill
    # instance's scheduler side says in its heartbeats: a later start is told apart from it.
    now = listed(mismatched)
    (start,) = [i["launch"] for i in now if i["role"] == "prefill"]
    assert start and [r["launch"] for i in now if i["role"] == "decode" for r in i["refused"]] == [start]
    assert f"start {start}, listening on {prefill['kv']}" in text


def _wait_for_the_proxy_to_hear_of_the_refusal(proxy: str, prefill: dict[str, Any]) -> None:
    """Until the proxy lists the decode instance as having refused the prefill instance's worker (a heartbeat every
    3 s carries it)."""
    deadline = time.monotonic() + 30
    while True:
        listed = httpx.get(f"http://{proxy}/instances", timeout=10).json()["instances"]
        refused = [r for i in listed if i["role"] == "decode" for r in i["refused"]]
        if refused:
            assert refused[0]["address"] == prefill["kv"], refused
            assert "model.rope_parameters" in refused[0]["reason"], refused
            return
        assert time.monotonic() < deadline, f"the proxy did not hear of the refusal: {listed}"
        time.sleep(0.2)


def test_get_transfers_are_not_held_for_a_decode_instance_the_prefill_instance_refused(
        mismatched: dict[str, Any]) -> None:
    """The proxy's two steps by hand, each transfer held for a pull (GET): the prefill instance refuses the decode
    instance's pull at its hello, so the first load fails at once and the blocks held for it are freed then; the
    second transfer is not held at all. The refusal names the decode instance's start as its heartbeats say it; a
    third transfer for another start of the decode instance (as after a restart: `decode_launch`, which the proxy
    passes on from the heartbeats) is held, and freed at its refused hello."""
    prefill, decode = instance_of(mismatched, "kv_producer"), instance_of(mismatched, "kv_consumer")
    log = Path(mismatched["log_dir"]) / "prefill0.log"
    failed = metric(decode["metrics"], FAILED_LOADS)
    for i in range(3):
        text = prompt(f"mismatch-get-{i}", 200)
        params = PrefillParams(uuid.uuid4().hex, Address.parse(decode["kv"]), pull=True,
                               decode_launch="f0" * 8 if i == 2 else "")
        body = {"model": mismatched["model"], "prompt": text, "max_tokens": 1, "kv_transfer_params": params.to_dict()}
        returned = parse_transfer_params(complete(f"http://{prefill['http']}", body)["kv_transfer_params"])
        assert isinstance(returned, DecodeParams) and returned.pull
        body = {"model": mismatched["model"], "prompt": text, "max_tokens": 8, "ignore_eos": True,
                "kv_transfer_params": returned.to_dict()}
        reply = httpx.post(f"http://{decode['http']}/v1/completions", json=body, timeout=DEADLINE_S / 2)
        assert reply.status_code == 200, reply.text
        assert metric(decode["metrics"], FAILED_LOADS) == failed + i + 1
        logged = log.read_text()
        held = logged.count(f"transfer {params.transfer_id}: not held for a pull")
        assert held == (i == 1), "held: the first (nothing known of the decode instance yet), the third (another " \
            "start of it); not the second"
        freed = logged.count(f"transfer {params.transfer_id}: blocks freed: the decode worker at {decode['kv']}")
        assert freed == (i != 1), "those held are freed at the refusal, not when their lease runs out"
    deadline = time.monotonic() + 30
    while not (refused := [r for i in listed(mismatched) if i["role"] == "prefill" for r in i["refused"]]):
        assert time.monotonic() < deadline, "the prefill instance's heartbeats did not name the refusal"
        time.sleep(0.2)
    (start,) = [i["launch"] for i in listed(mismatched) if i["role"] == "decode"]
    assert start and [(r["address"], r["launch"]) for r in refused] == [(decode["kv"], start)]


def test_a_proxy_with_static_lists_learns_of_the_refusal_by_probes_and_passes_the_prefill_instance_over(
        mismatched: dict[str, Any], oracle: Oracle) -> None:
    """A second proxy that lists the two instances statically (no heartbeats reach it) asks them by probes what a
    heartbeat says (`p2pkv.proxy.poll`): once the decode instance has refused the prefill worker (an earlier test,
    or this test's first request), requests through it go to the decode instance alone (no load fails, since no
    prefill instance pushes), answered as the colocated instance with the decode side's settings answers them."""
    prefill, decode = instance_of(mismatched, "kv_producer"), instance_of(mismatched, "kv_consumer")
    config = ProxyConfig(prefill=(Instance.parse(prefill["http"]),),
                         decode=(Instance.parse(f"{decode['http']}@{decode['kv']}"),), discovery_port=0,
                         probe_interval_s=0.5)
    with serve(create_app(config)) as proxy:
        body = {"model": mismatched["model"], "prompt": prompt("static-0", 120), "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"http://{proxy}/v1/completions", json=body, timeout=DEADLINE_S / 2)
        assert reply.status_code == 200, reply.text
        _wait_for_the_proxy_to_hear_of_the_refusal(proxy, prefill)
        failed, passed_over = metric(decode["metrics"], FAILED_LOADS), metric(proxy, PASSED_OVER)
        for i in range(1, 3):
            body = {"model": mismatched["model"], "prompt": prompt(f"static-{i}", 200), "max_tokens": 16,
                    "temperature": 0, "ignore_eos": True, "logprobs": 1}
            answers_like(f"http://{proxy}", body, mismatched["colocated"], oracle.url(), "the settings change it")
        assert metric(decode["metrics"], FAILED_LOADS) == failed, "no prefill instance pushed for them"
        assert metric(proxy, PASSED_OVER) == passed_over + 2


def test_a_prefill_instance_restarted_with_matching_settings_is_paired_again_and_its_first_push_loads(
        mismatched: dict[str, Any], oracle: Oracle) -> None:
    """The prefill instance is killed and started again with the decode side's settings (its command line and
    environment, plus the flag it lacked). Its heartbeats stopped for longer than the proxy waits, so the proxy
    dropped it; it comes back under another engine id, and is paired again at once though the decode instance
    still names the refusal of the old one. A load bound before the new instance's first hello (forced here: the
    decode request goes first, the prefill request for the same transfer 2 s later) names the prefill instance's
    new start (`prefill_launch`), so it waits for the push rather than failing on the old refusal. No load fails,
    the KV moves, and the answers are the colocated instance's with those settings. Runs last: it changes the
    cluster."""
    prefill, decode = instance_of(mismatched, "kv_producer"), instance_of(mismatched, "kv_consumer")
    proxy, model = mismatched["proxy"].removeprefix("http://"), mismatched["model"]
    if metric(decode["metrics"], "p2pkv_refused_peers_total") == 0:  # run alone: have the old one refused first
        body = {"model": model, "prompt": prompt("restart-0", 120), "max_tokens": 2}
        assert httpx.post(f"{mismatched['proxy']}/v1/completions", json=body, timeout=DEADLINE_S / 2).is_success
    _wait_for_the_proxy_to_hear_of_the_refusal(proxy, prefill)
    assert "--hf-overrides" not in mismatched["started"][0][0]
    failed = metric(decode["metrics"], FAILED_LOADS)
    with started_again(mismatched, 0, "prefill0-restarted", ("--hf-overrides", OVERRIDE)):
        assert [r["address"] for i in listed(mismatched) if i["role"] == "decode" for r in i["refused"]] == [
            prefill["kv"]], "the decode instance still names the old refusal"
        _load_before_the_first_hello(mismatched, prefill, decode, oracle)
        loaded, passed_over = metric(decode["metrics"], "p2pkv_bytes_loaded_total"), metric(proxy, PASSED_OVER)
        for i in range(2):
            body = {"model": model, "prompt": prompt(f"restarted-{i}", 200 + 50 * i), "max_tokens": 16,
                    "temperature": 0, "ignore_eos": True, "logprobs": 1}
            answers_like(mismatched["proxy"], body, mismatched["colocated"], oracle.url(), "the settings change it")
        assert metric(decode["metrics"], FAILED_LOADS) == failed, "no load failed on the old refusal"
        assert metric(proxy, PASSED_OVER) == passed_over, "the pair was used: the refusal predates the restart"
        assert metric(decode["metrics"], "p2pkv_bytes_loaded_total") > loaded, "the KV moved through the proxy"
        # The new one's hello was accepted: the decode instance no longer names the refusal.
        deadline = time.monotonic() + 30
        while any(i["refused"] for i in listed(mismatched)):
            assert time.monotonic() < deadline, "the refusal is still named"
            time.sleep(0.2)


def _load_before_the_first_hello(info: dict[str, Any], prefill: dict[str, Any], decode: dict[str, Any],
                                 oracle: Oracle) -> None:
    """The proxy's two steps by hand, the decode step first: its load is bound and waits (the decode worker notes
    the old prefill instance's refusal and has heard no hello since), then the prefill step pushes the KV. The
    prefill instance's start comes from a pull (GET) by hand before it, which says hello only at the prefill
    instance's listener."""
    model, d_url, p_url = info["model"], f"http://{decode['http']}", f"http://{prefill['http']}"
    text = prompt("restarted-get", 150)
    held = complete(p_url, {"model": model, "prompt": text, "max_tokens": 1, "kv_transfer_params": PrefillParams(
        uuid.uuid4().hex, Address.parse(decode["kv"]), pull=True).to_dict()})
    pulled = parse_transfer_params(held["kv_transfer_params"])
    assert isinstance(pulled, DecodeParams) and pulled.pull and pulled.prefill_launch, pulled
    complete(d_url, {"model": model, "prompt": text, "max_tokens": 1, "kv_transfer_params": pulled.to_dict()})
    tokens = httpx.post(f"{d_url}/tokenize", json={"model": model, "prompt": prompt("restarted-race", 260)},
                        timeout=30).json()["tokens"]
    tid = uuid.uuid4().hex
    loads = DecodeParams(tid, len(tokens), Address.parse(prefill["kv"]), prompt=prompt_digest(tokens),
                         prefill_launch=pulled.prefill_launch)
    body = {"model": model, "prompt": tokens, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    failed = metric(decode["metrics"], FAILED_LOADS)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(complete, d_url, {**body, "kv_transfer_params": loads.to_dict()})
        time.sleep(2.0)
        assert not answer.done() and metric(decode["metrics"], FAILED_LOADS) == failed, "the load waits"
        complete(p_url, {"model": model, "prompt": tokens, "max_tokens": 1,
                         "kv_transfer_params": PrefillParams(tid, Address.parse(decode["kv"])).to_dict()})
        answered_like(answer.result(timeout=DEADLINE_S), body, info["colocated"], oracle.url(),
                      "the settings change it")
    assert metric(decode["metrics"], FAILED_LOADS) == failed
