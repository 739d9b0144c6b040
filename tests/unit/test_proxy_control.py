"""The proxy's weight-update controls (pause, cache reset, resume) against stub instances that are real HTTP
servers: each instance's answer, and the order disaggregation needs."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from p2pkv.bench.cluster import free_port
from p2pkv.params import Address
from p2pkv.proxy import Instance, ProxyConfig, create_app
from p2pkv.proxy.registry import Policy, Pool
from tests.helpers.servers import serve
from tests.helpers.stubs import stub_decode, stub_prefill

PAUSE_S = 0.3  # how long a stub takes to pause (vLLM returns once it is idle)


def stub_instance(name: str, calls: list[dict[str, Any]], pause_status: int = 200, reset_ok: bool = True,
                  app: FastAPI | None = None, rpc_status: int = 200) -> FastAPI:
    """vLLM's dev-mode controls, recording each call: which instance, the path, its query and when it ran; added
    to `app` (a stub that also serves completions) where given."""
    app = app or FastAPI()
    state = {"paused": False}

    def record(request: Request, began: float, body: Any = None) -> None:
        calls.append({"name": name, "path": request.url.path, "query": dict(request.query_params), "began": began,
                      "ended": time.monotonic(), "auth": request.headers.get("authorization"), "body": body})

    @app.post("/pause")
    async def pause(request: Request) -> JSONResponse:
        began = time.monotonic()
        time.sleep(PAUSE_S)
        record(request, began)
        if pause_status != 200:
            return JSONResponse({"error": "Failed to pause generation"}, status_code=pause_status)
        state["paused"] = True
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume(request: Request) -> JSONResponse:
        record(request, time.monotonic())
        state["paused"] = False
        return JSONResponse({"status": "resumed"})

    @app.post("/reset_prefix_cache")
    async def reset(request: Request) -> JSONResponse:
        record(request, time.monotonic())
        return JSONResponse({"success": reset_ok})

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> JSONResponse:
        began = time.monotonic()
        time.sleep(PAUSE_S)  # reloading weights takes a while
        body = await request.json()
        record(request, began, body)
        if rpc_status != 200:
            return JSONResponse({"detail": "no such method"}, status_code=rpc_status)
        return JSONResponse({"results": [f"{name} ran {body['method']}"]})

    @app.get("/is_paused")
    async def is_paused(request: Request) -> JSONResponse:
        record(request, time.monotonic())
        return JSONResponse({"is_paused": state["paused"]})

    return app


@contextmanager
def cluster(prefill: list[FastAPI], decode: list[FastAPI], api_key: str = "", dp: bool = False,
            request_timeout_s: float = 600.0, admin_key: str = "") -> Iterator[str]:
    """A proxy over the stub instances; with `dp`, each is listed as two data-parallel engines of one server."""
    with ExitStack() as stack:
        def listed(apps: list[FastAPI]) -> tuple[Instance, ...]:
            servers = [stack.enter_context(serve(app)) for app in apps]
            return tuple(Instance.parse(f"{s}#{r}" if dp else s) for s in servers for r in ((0, 1) if dp else (0,)))

        config = ProxyConfig(prefill=listed(prefill), decode=listed(decode), api_key=api_key,
                             request_timeout_s=request_timeout_s, admin_key=admin_key)
        yield stack.enter_context(serve(create_app(config)))


def paths(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(c["name"], c["path"]) for c in sorted(calls, key=lambda c: c["began"])]


def test_pause_resets_and_pauses_prefill_instances_before_any_decode_instance() -> None:
    """mode=abort (the default) clears the caches: each prefill instance first resets its cache with the
    connector's (it stops holding blocks for pulls the abort makes moot), then pauses; the decode instances pause
    once every prefill instance has (their pushes in flight have landed). Each instance's answer comes back."""
    calls: list[dict[str, Any]] = []
    with cluster([stub_instance("p0", calls), stub_instance("p1", calls)],
                 [stub_instance("d0", calls)]) as proxy:
        resp = httpx.post(f"http://{proxy}/pause", params={"mode": "abort"}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["status"] == "paused"
    assert sorted((a["role"], a["body"]["status"]) for a in resp.json()["instances"]) == [
        ("decode", "paused"), ("prefill", "paused"), ("prefill", "paused")]
    resets = [c for c in calls if c["path"] == "/reset_prefix_cache"]
    assert sorted(c["name"] for c in resets) == ["p0", "p1"]
    assert all(c["query"] == {"reset_external": "true"} for c in resets)
    pauses = {c["name"]: c for c in calls if c["path"] == "/pause"}
    assert set(pauses) == {"p0", "p1", "d0"}
    assert all(c["query"] == {"mode": "abort"} for c in pauses.values())
    assert max(c["ended"] for c in resets) <= min(pauses["p0"]["began"], pauses["p1"]["began"])
    assert pauses["d0"]["began"] >= max(pauses["p0"]["ended"], pauses["p1"]["ended"])
    # The prefill instances pause together, not one after the other.
    assert abs(pauses["p0"]["began"] - pauses["p1"]["began"]) < PAUSE_S


@pytest.mark.parametrize("query", [{"mode": "wait"}, {"mode": "keep"}, {"mode": "abort", "clear_cache": "false"}])
def test_a_pause_that_keeps_requests_or_caches_resets_nothing(query: dict[str, str]) -> None:
    """Requests that go on (wait, keep) still pull what prefill instances hold for them, and a pause that keeps
    the caches keeps them: no reset first; the order holds."""
    calls: list[dict[str, Any]] = []
    with cluster([stub_instance("p0", calls)], [stub_instance("d0", calls)]) as proxy:
        resp = httpx.post(f"http://{proxy}/pause", params=query, timeout=30)
    assert resp.status_code == 200, resp.text
    assert paths(calls) == [("p0", "/pause"), ("d0", "/pause")]
    assert all(c["query"] == query for c in calls)


def test_a_prefill_instance_that_fails_to_pause_fails_the_pause_and_no_decode_instance_pauses() -> None:
    calls: list[dict[str, Any]] = []
    with cluster([stub_instance("p0", calls, pause_status=500)], [stub_instance("d0", calls)]) as proxy:
        resp = httpx.post(f"http://{proxy}/pause", timeout=30)
    assert resp.status_code == 502
    assert resp.json()["status"] == "failed"
    assert [a["status_code"] for a in resp.json()["instances"]] == [500]
    assert ("d0", "/pause") not in paths(calls)


def test_resume_goes_to_decode_instances_first_and_is_paused_asks_all() -> None:
    calls: list[dict[str, Any]] = []
    with cluster([stub_instance("p0", calls)], [stub_instance("d0", calls)]) as proxy:
        assert httpx.get(f"http://{proxy}/is_paused", timeout=30).json()["is_paused"] is False
        httpx.post(f"http://{proxy}/pause", params={"mode": "keep"}, timeout=30).raise_for_status()
        assert httpx.get(f"http://{proxy}/is_paused", timeout=30).json()["is_paused"] is True
        calls.clear()
        resp = httpx.post(f"http://{proxy}/resume", timeout=30)
        assert resp.status_code == 200 and resp.json()["status"] == "resumed"
        assert paths(calls) == [("d0", "/resume"), ("p0", "/resume")]
        assert httpx.get(f"http://{proxy}/is_paused", timeout=30).json()["is_paused"] is False


@pytest.mark.parametrize("prefill_ok", [True, False])
def test_reset_prefix_cache_succeeds_only_where_every_instance_did(prefill_ok: bool) -> None:
    """vLLM's reset fails while blocks are held (a caller retries): the proxy's succeeds only if all did."""
    calls: list[dict[str, Any]] = []
    with cluster([stub_instance("p0", calls, reset_ok=prefill_ok)], [stub_instance("d0", calls)]) as proxy:
        resp = httpx.post(f"http://{proxy}/reset_prefix_cache", params={"reset_external": "true"}, timeout=30)
    assert resp.status_code == 200
    assert resp.json()["success"] is prefill_ok
    assert paths(calls) == [("p0", "/reset_prefix_cache"), ("d0", "/reset_prefix_cache")]
    assert all(c["query"] == {"reset_external": "true"} for c in calls)


def test_controls_need_the_admin_key_pass_the_client_key_on_and_go_once_per_api_server() -> None:
    """An instance's data-parallel engines pause together: one call per API server. The proxy's admin key guards
    the controls (the clients' key does not open them); the instances get the clients' key (vLLM's `--api-key`),
    never the admin key."""
    calls: list[dict[str, Any]] = []
    with cluster([stub_instance("p0", calls)], [stub_instance("d0", calls)], api_key="k1", dp=True,
                 admin_key="a1") as proxy:
        assert httpx.post(f"http://{proxy}/pause", timeout=30).status_code == 401
        assert httpx.post(f"http://{proxy}/pause", headers={"Authorization": "Bearer k1"}, timeout=30
                          ).status_code == 401
        assert calls == []
        resp = httpx.post(f"http://{proxy}/pause", headers={"Authorization": "Bearer a1"}, timeout=30)
    assert resp.status_code == 200
    assert paths(calls) == [("p0", "/reset_prefix_cache"), ("p0", "/pause"), ("d0", "/pause")]
    assert {c["auth"] for c in calls} == {"Bearer k1"}


def test_collective_rpc_runs_on_every_instance_at_once_with_the_clients_body() -> None:
    """A trainer reloads the weights of the whole cluster in one call: each API server gets the body as sent
    (once, with the clients' API key), all at the same time, and each answer comes back. The caller needs the
    admin key."""
    calls: list[dict[str, Any]] = []
    body = {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/step-2"}}
    with cluster([stub_instance("p0", calls), stub_instance("p1", calls)], [stub_instance("d0", calls)],
                 api_key="k1", dp=True, admin_key="a1") as proxy:
        assert httpx.post(f"http://{proxy}/collective_rpc", json=body, timeout=30).status_code == 401
        assert httpx.post(f"http://{proxy}/collective_rpc", json=body, headers={"Authorization": "Bearer k1"},
                          timeout=30).status_code == 401
        assert calls == []
        resp = httpx.post(f"http://{proxy}/collective_rpc", json=body, headers={"Authorization": "Bearer a1"},
                          timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["status"] == "done"
    assert sorted((a["role"], a["body"]["results"][0]) for a in resp.json()["instances"]) == [
        ("decode", "d0 ran reload_weights"), ("prefill", "p0 ran reload_weights"),
        ("prefill", "p1 ran reload_weights")]
    assert sorted(c["name"] for c in calls) == ["d0", "p0", "p1"]
    assert all(c["body"] == body and c["auth"] == "Bearer k1" for c in calls)
    assert max(c["began"] for c in calls) < min(c["ended"] for c in calls)  # together, not in turn


def test_collective_rpc_that_fails_anywhere_is_a_failure() -> None:
    calls: list[dict[str, Any]] = []
    with cluster([stub_instance("p0", calls)], [stub_instance("d0", calls, rpc_status=400)]) as proxy:
        resp = httpx.post(f"http://{proxy}/collective_rpc", json={"method": "nope"}, timeout=30)
    assert resp.status_code == 502
    assert resp.json()["status"] == "failed"
    assert sorted((a["role"], a["status_code"]) for a in resp.json()["instances"]) == [("decode", 400),
                                                                                      ("prefill", 200)]


@pytest.mark.parametrize("rpc_status", [200, 400])
def test_the_weight_update_example_pauses_reloads_and_always_resumes(rpc_status: int) -> None:
    """`examples/rl_weight_update.py`: pause, reload, resume through the proxy; a reload that fails on one
    instance still resumes the cluster, and the example exits non-zero."""
    calls: list[dict[str, Any]] = []
    example = Path(__file__).resolve().parents[2] / "examples" / "rl_weight_update.py"
    with cluster([stub_instance("p0", calls)], [stub_instance("d0", calls, rpc_status=rpc_status)],
                 api_key="k1", admin_key="a1") as proxy:
        run = subprocess.run([sys.executable, str(example), "--proxy", f"http://{proxy}", "--weights", "/ckpt/2",
                              "--admin-key", "a1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == (0 if rpc_status == 200 else 1), run.stdout + run.stderr
    steps = [(c["name"], c["path"]) for c in sorted(calls, key=lambda c: c["ended"])
             if c["path"] != "/reset_prefix_cache"]
    assert steps[:2] == [("p0", "/pause"), ("d0", "/pause")]
    assert sorted(steps[2:4]) == [("d0", "/collective_rpc"), ("p0", "/collective_rpc")]
    assert steps[4:] == [("d0", "/resume"), ("p0", "/resume")]
    assert all(c["body"]["kwargs"] == {"weights_path": "/ckpt/2"} for c in calls if c["path"] == "/collective_rpc")
    assert f"reload: HTTP {200 if rpc_status == 200 else 502}" in run.stdout


def test_no_instances_is_an_error_not_a_success() -> None:
    """A proxy that has discovered no instance yet paused nothing, and does not hold requests for a resume."""
    with serve(create_app(ProxyConfig(prefill=(), decode=(), discovery_host="127.0.0.1",
                                      discovery_port=free_port(), request_timeout_s=1.0))) as proxy:
        resp = httpx.post(f"http://{proxy}/pause", timeout=30)
        held = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert resp.status_code == 503
    assert held.status_code == 503 and "no decode instance" in held.json()["error"]["message"]


def test_requests_wait_at_the_proxy_while_the_cluster_is_paused_and_go_on_when_it_resumes() -> None:
    """A request that comes while the cluster is paused through the proxy is not sent to a paused instance (its
    prefill would time out there and go to a decode instance alone): it waits at the proxy, and goes on at the
    resume."""
    calls: list[dict[str, Any]] = []
    p_seen: list[dict[str, Any]] = []
    d_seen: list[dict[str, Any]] = []
    with cluster([stub_instance("p0", calls, app=stub_prefill(p_seen))],
                 [stub_instance("d0", calls, app=stub_decode(d_seen))]) as proxy:
        httpx.post(f"http://{proxy}/pause", timeout=30).raise_for_status()
        answers: list[httpx.Response] = []
        client = threading.Thread(target=lambda: answers.append(httpx.post(
            f"http://{proxy}/v1/completions", json={"prompt": "hi", "max_tokens": 5}, timeout=30)))
        client.start()
        time.sleep(1.0)
        assert p_seen == [] and d_seen == [] and answers == []
        resumed = time.monotonic()
        httpx.post(f"http://{proxy}/resume", timeout=30).raise_for_status()
        client.join(30)
        assert answers and answers[0].status_code == 200, answers
        assert len(p_seen) == 1 and len(d_seen) == 1
        assert time.monotonic() - resumed < 5


def test_a_request_waits_for_a_resume_no_longer_than_its_timeout_and_a_failed_pause_holds_nothing() -> None:
    calls: list[dict[str, Any]] = []
    p_seen: list[dict[str, Any]] = []
    with cluster([stub_instance("p0", calls, app=stub_prefill(p_seen))],
                 [stub_instance("d0", calls, app=stub_decode([]))], request_timeout_s=1.0) as proxy:
        httpx.post(f"http://{proxy}/pause", timeout=30).raise_for_status()
        started = time.monotonic()
        resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "hi", "max_tokens": 5}, timeout=30)
        assert resp.status_code == 503 and "paused" in resp.text
        assert 0.8 < time.monotonic() - started < 5
        assert p_seen == []
        assert 'p2pkv_proxy_requests_total{outcome="paused"} 1.0' in httpx.get(f"http://{proxy}/metrics").text
    with cluster([stub_instance("p0", calls, app=stub_prefill(p_seen), pause_status=500)],
                 [stub_instance("d0", calls, app=stub_decode([]))]) as proxy:
        assert httpx.post(f"http://{proxy}/pause", timeout=30).status_code == 502
        resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "hi", "max_tokens": 5}, timeout=30)
        assert resp.status_code == 200 and len(p_seen) == 1


def test_a_decode_instance_that_fails_to_pause_leaves_no_instance_paused() -> None:
    """A pause that fails part way (here a decode instance without vLLM's dev mode, which answers 404) leaves no
    instance paused: the prefill instances it paused are resumed, and the answer says which failed."""
    calls: list[dict[str, Any]] = []
    with cluster([stub_instance("p0", calls)], [stub_instance("d0", calls, pause_status=404)]) as proxy:
        resp = httpx.post(f"http://{proxy}/pause", timeout=30)
    assert resp.status_code == 502 and resp.json()["status"] == "failed"
    assert sorted((a["role"], a["status_code"]) for a in resp.json()["instances"]) == [("decode", 404),
                                                                                       ("prefill", 200)]
    assert paths(calls) == [("p0", "/reset_prefix_cache"), ("p0", "/pause"), ("d0", "/pause"), ("p0", "/resume")]


def test_a_weight_update_that_fails_on_some_instances_unpairs_them_from_the_others_until_one_reaches_all() -> None:
    """`/collective_rpc` that succeeds on the prefill instance and fails on the decode instance (a checkpoint path
    one host cannot read): their weights may now differ, and KV of other weights would make the decode instance
    answer as neither model does. So requests go to the decode instance alone (the prefill instance is passed over)
    and `/instances` names the update each took, until an update succeeds on both; one that fails everywhere
    changes nothing."""
    p_seen: list[dict[str, Any]] = []
    d_seen: list[dict[str, Any]] = []
    status = {"p0": 200, "d0": 200}  # each instance's answer to the next collective_rpc
    apps = []
    for name, app in (("p0", stub_prefill(p_seen)), ("d0", stub_decode(d_seen))):
        apps.append(stub_instance(name, [], app=app))

        @app.middleware("http")
        async def answer_as_set(request: Request, call_next: Any, name: str = name) -> Any:
            if request.url.path == "/collective_rpc" and status[name] != 200:
                return JSONResponse({"detail": "no such file"}, status_code=status[name])
            return await call_next(request)

    with cluster(apps[:1], apps[1:]) as proxy:
        def update(p0: int, d0: int) -> int:
            status.update(p0=p0, d0=d0)
            body = {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/2"}}
            return httpx.post(f"http://{proxy}/collective_rpc", json=body, timeout=30).status_code

        def request() -> None:
            assert httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "hi", "max_tokens": 5},
                              timeout=30).status_code == 200

        def marks() -> dict[str, Any]:
            listed = httpx.get(f"http://{proxy}/instances", timeout=10).json()["instances"]
            return {i["role"]: i["weights"] for i in listed}

        request()
        assert len(p_seen) == 1 and marks() == {"prefill": None, "decode": None}
        assert update(500, 500) == 502  # fails everywhere: the marks still match
        request()
        assert len(p_seen) == 2 and marks() == {"prefill": None, "decode": None}
        assert update(200, 400) == 502  # the prefill instance takes it, the decode instance does not
        taken = marks()
        assert taken["decode"] is None and str(taken["prefill"]).startswith("reload_weights ")
        for _ in range(2):
            request()
        assert len(p_seen) == 2 and len(d_seen) >= 4, "the prefill instance was passed over; the decode one answered"
        metrics = httpx.get(f"http://{proxy}/metrics", timeout=10).text
        assert "p2pkv_proxy_pairs_passed_over_total 2.0" in metrics
        assert update(200, 200) == 200  # one that reaches both
        request()
        assert len(p_seen) == 3, "paired again"
        again = marks()
        assert again["prefill"] == again["decode"] != taken["prefill"] and again["decode"] is not None


def test_a_restart_forgets_the_updates_an_instance_took_and_a_drop_for_missed_heartbeats_does_not() -> None:
    pool = Pool("decode", Policy.ROUND_ROBIN)
    instance = Instance(Address.parse("10.0.0.1:8000"), Address("10.0.0.1", 21000))
    assert pool.heard_from(instance, 0.0, expires_at=100.0)
    state = pool.states[0]
    state.heard("e1", 1, (), 1.0, "a1" * 8)
    state.weights = "reload_weights 1a"
    state.heard("e1", 1, (), 2.0, "a1" * 8)
    assert state.weights == "reload_weights 1a", "the same start"
    assert pool.prune(now=200.0) == [state] and pool.states == []  # starved of heartbeats for a while
    assert pool.heard_from(instance, 0.0, expires_at=400.0)
    back = pool.states[0]
    back.heard("e1", 1, (), 201.0, "a1" * 8)
    assert back.weights == "reload_weights 1a" and back.up_since == 0.0, "the same start: as it was"
    back.heard("e1", 1, (), 202.0, "b2" * 8)  # another start under the same engine id (engine_id set)
    assert back.weights == "" and back.up_since == 202.0
    back.weights = "reload_weights 2b"
    back.heard("e2", 1, (), 203.0, "")  # another engine id, the start not said (an older connector)
    assert back.weights == "" and back.up_since == 203.0
