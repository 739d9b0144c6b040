"""Static instances without heartbeats, asked by probes what a heartbeat would say (`p2pkv.proxy.poll`): a proxy
with static lists, in front of stub instances (real HTTP servers) whose probe answers name refusals."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from p2pkv.params import Address
from p2pkv.proxy import Instance, ProxyConfig, create_app
from p2pkv.proxy.poll import Probed, StaticPoller, read_probe
from p2pkv.proxy.registry import InstanceState
from tests.helpers.servers import serve

PREFILL_KV = "127.0.0.1:21001"  # as the prefill instance's workers name themselves
REASON = "KV layout mismatch: model.weights: ours 0123456789abcdef, peer fedcba9876543210"


def instance(seen: list[dict[str, Any]], answer: Callable[[], dict[str, Any]]) -> FastAPI:
    """A stub instance: its probe answer is `answer()` (asked anew each time); other completions are recorded and
    answered as a prefill instance answers them."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": "tiny"}]}

    @app.post("/v1/completions")
    async def complete(request: Request) -> dict[str, Any]:
        body = await request.json()
        params = body.get("kv_transfer_params") or {}
        if params.get("probe"):
            return {"choices": [{"text": ""}], "kv_transfer_params": {"p2pkv": 1, **answer()}}
        seen.append(body)
        if params.get("do_remote_decode"):
            return {"choices": [{"text": "x"}], "kv_transfer_params": {
                "p2pkv": 1, "transfer_id": params["transfer_id"], "load_remote_kv": True, "num_prompt_tokens": 5}}
        return {"choices": [{"text": "abc"}], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}

    return app


def listed(proxy: str, role: str) -> dict[str, Any]:
    found: dict[str, Any] = next(i for i in httpx.get(f"http://{proxy}/instances", timeout=10).json()["instances"]
                                 if i["role"] == role)
    return found


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_static_pair_whose_decode_instance_refused_the_prefill_worker_is_not_paired() -> None:
    """The decode instance's probe answer names the prefill instance's worker, by the address that worker's own
    probe answer names it by: the proxy lists the refusal and sends requests to the decode instance alone; once the
    refusal is no longer said (its instance fixed and restarted, another engine id), the pair is used again."""
    p_seen: list[dict[str, Any]] = []
    d_seen: list[dict[str, Any]] = []
    refused_at = time.monotonic() - 1.5  # the decode instance's latest refusal; its answers give its age

    def decode_says() -> dict[str, Any]:
        return {"kv_port": 22001, "kv_host": "", "engine_id": "d1", "kv_named": "127.0.0.1:22001",
                "refused": [[PREFILL_KV, REASON, time.monotonic() - refused_at]]}

    prefill_says: dict[str, Any] = {"kv_port": 21001, "kv_host": "", "engine_id": "p1", "kv_named": PREFILL_KV}
    with serve(instance(p_seen, lambda: prefill_says)) as p, serve(instance(d_seen, decode_says)) as d:
        config = ProxyConfig(prefill=(Instance.parse(p),), decode=(Instance.parse(f"{d}@127.0.0.1:22001"),),
                             discovery_port=0, probe_interval_s=0.2)
        with serve(create_app(config)) as proxy:
            wait_for(lambda: bool(listed(proxy, "decode")["refused"]), "the proxy did not hear of the refusal")
            refused = listed(proxy, "decode")["refused"][0]
            assert refused["address"] == PREFILL_KV and refused["reason"] == REASON
            assert 50 < refused["paired_again_in_s"] <= 58.5
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
            reply = httpx.post(f"http://{proxy}/v1/completions", json=body, timeout=10)
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "abc"
            assert p_seen == [], "the refused prefill instance was passed over"
            assert "kv_transfer_params" not in d_seen[-1], "the decode instance prefilled the prompt itself"
            metrics = httpx.get(f"http://{proxy}/metrics", timeout=10).text
            assert "p2pkv_proxy_pairs_passed_over_total 1.0" in metrics
            # The prefill instance restarts with the settings fixed: a new engine id; the refusal predates it, and
            # the pair is used again from then on (well before the 60 s of the refusal are over).
            prefill_says["engine_id"] = "p2"
            wait_for(lambda: _prefilled(proxy, body, p_seen), "the pair was not used again")
            time.sleep(0.5)  # more probe rounds: the decode instance still names the refusal from before
            assert _prefilled(proxy, body, p_seen)
            assert d_seen[-1]["kv_transfer_params"]["transfer_id"] == p_seen[-1]["kv_transfer_params"]["transfer_id"]


def _prefilled(proxy: str, body: dict[str, Any], p_seen: list[dict[str, Any]]) -> bool:
    """One request through the proxy; whether the prefill instance was sent it."""
    before = len(p_seen)
    assert httpx.post(f"http://{proxy}/v1/completions", json=body, timeout=10).status_code == 200
    return len(p_seen) > before


def test_an_instance_that_does_not_answer_probes_is_still_used_and_asked_again() -> None:
    """A static prefill instance without the connector's probe answer (or down for a while) is no reason not to
    route to it; what a later probe says counts."""
    p_seen: list[dict[str, Any]] = []
    d_seen: list[dict[str, Any]] = []
    decode_says: dict[str, Any] = {"kv_port": 22001, "kv_host": "", "engine_id": "d1"}
    with serve(instance(p_seen, lambda: {})) as p, serve(instance(d_seen, lambda: decode_says)) as d:
        config = ProxyConfig(prefill=(Instance.parse(p),), decode=(Instance.parse(f"{d}@127.0.0.1:22001"),),
                             discovery_port=0, probe_interval_s=0.2)
        with serve(create_app(config)) as proxy:
            time.sleep(0.5)
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
            assert httpx.post(f"http://{proxy}/v1/completions", json=body, timeout=10).status_code == 200
            assert len(p_seen) == 1
            decode_says["refused"] = [["127.0.0.1:9", "something else", 0.0]]
            wait_for(lambda: bool(listed(proxy, "decode")["refused"]), "a later answer did not count")
            assert httpx.post(f"http://{proxy}/v1/completions", json=body, timeout=10).status_code == 200
            assert len(p_seen) == 2, "a refusal of another worker does not keep this pair apart"


def test_probe_answers_are_checked() -> None:
    good = {"kv_port": 1, "engine_id": "e", "kv_named": "10.0.0.1:21001", "tp_size": 2, "pp_size": 2,
            "refused": [["10.0.0.2:21001", "why", 3]]}
    probed = read_probe(good)
    assert probed.engine_id == "e" and probed.ranks == 4 and probed.named == Address("10.0.0.1", 21001)
    assert probed.refused == ((Address("10.0.0.2", 21001), "why", 3.0, ""),)
    assert read_probe({**good, "refused_launches": ["0123456789abcdef"]}).refused[0][3] == "0123456789abcdef"
    assert read_probe({"kv_port": 1}).refused == () and read_probe({"kv_port": 1}).named is None
    assert read_probe({**good, "launch": "0123456789abcdef"}).launch == "0123456789abcdef"
    assert read_probe(good).launch == "" and read_probe(good).kv_events == ""
    assert read_probe({**good, "kv_events": "tcp://10.0.0.1:5557"}).kv_events == "tcp://10.0.0.1:5557"
    for bad in ({"kv_events": 5}, {"kv_events": "http://10.0.0.1:5557"}, {"kv_events": "ipc://" + "x" * 300},
                {"refused": "x"}, {"refused": [["10.0.0.2:1", "why"]]}, {"refused": [["nohost", "why", 1]]},
                {"refused": [["10.0.0.2:1", "why", -1]]}, {"refused": [["10.0.0.2:1", "why", float("nan")]]},
                {"refused": [["10.0.0.2:1", "why", True]]}, {"refused": [["10.0.0.2:1", "w", 1]] * 17},
                {"engine_id": 5}, {"kv_named": "no port"}, {"launch": 5}, {"launch": "XYZ"},
                {**good, "refused_launches": []}, {**good, "refused_launches": ["XYZ"]},
                {**good, "refused_launches": "0123456789abcdef"}, {**good, "refused_launches": [""] * 2}):
        with pytest.raises(ValueError):
            read_probe(bad)


def test_a_pair_refused_afresh_after_its_pass_over_ran_out_is_passed_over_twice_as_long() -> None:
    """The decode instance's refusal of the prefill worker is 61 s old (the pair is tried again), then it refuses
    the worker afresh: the proxy passes the pair over for 120 s from then, not 60."""
    p_seen: list[dict[str, Any]] = []
    d_seen: list[dict[str, Any]] = []
    refused_at = [time.monotonic() - 61.0]

    def decode_says() -> dict[str, Any]:
        return {"kv_port": 22001, "kv_host": "", "engine_id": "d1",
                "refused": [[PREFILL_KV, REASON, time.monotonic() - refused_at[0]]]}

    prefill_says = {"kv_port": 21001, "kv_host": "", "engine_id": "p1", "kv_named": PREFILL_KV}
    with serve(instance(p_seen, lambda: prefill_says)) as p, serve(instance(d_seen, decode_says)) as d:
        config = ProxyConfig(prefill=(Instance.parse(p),), decode=(Instance.parse(f"{d}@127.0.0.1:22001"),),
                             discovery_port=0, probe_interval_s=0.2)
        with serve(create_app(config)) as proxy:
            wait_for(lambda: bool(listed(proxy, "decode")["refused"]), "the proxy did not hear of the refusal")
            assert listed(proxy, "decode")["refused"][0]["paired_again_in_s"] == 0, "its 60 s are over"
            refused_at[0] = time.monotonic()
            wait_for(lambda: listed(proxy, "decode")["refused"][0]["paired_again_in_s"] > 60,
                     "the second refusal did not double the wait")
            assert listed(proxy, "decode")["refused"][0]["paired_again_in_s"] <= 120


def test_a_probe_that_never_answers_ends_at_its_deadline_and_the_round_goes_on() -> None:
    """One silent static instance (its probe never returns) does not hold the round past the probe's
    deadline, nor keep the other instance's answer from counting."""
    silent, answering = Instance.parse("10.0.0.1:8100"), Instance.parse("10.0.0.2:8100")
    states = [InstanceState(silent, "prefill"), InstanceState(answering, "decode")]
    heard: list[tuple[str, Probed]] = []

    async def probe(instance: Instance) -> dict[str, Any]:
        if instance == silent:
            await asyncio.Event().wait()  # never set
        return {"kv_port": 1, "engine_id": "d1"}

    poller = StaticPoller(lambda: states, probe, lambda s, p: heard.append((s[0].instance.name, p)), 60.0, 0.3)
    started = time.monotonic()
    asyncio.run(asyncio.wait_for(poller.round(), 5.0))
    assert time.monotonic() - started < 2.0
    assert [(name, p.engine_id) for name, p in heard] == [("10.0.0.2:8100", "d1")]
