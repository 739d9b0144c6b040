"""Admin-route attacks on a real proxy process: nobody pauses, steers or inspects the cluster without the admin key,
except from loopback where no admin key is set."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from p2pkv.hostaddr import local_ip_towards
from p2pkv.protocol import Heartbeat, encode_datagram
from tests.helpers.proxy_process import dealer, proxy_process
from tests.helpers.servers import serve
from tests.helpers.stubs import stub_decode, stub_prefill, with_controls
from tests.helpers.unit import wait_for

ADMIN = [("POST", "/pause"), ("POST", "/resume"), ("POST", "/reset_prefix_cache"), ("GET", "/is_paused"),
         ("POST", "/collective_rpc"), ("GET", "/instances"), ("GET", "/metrics")]
RELOAD = {"method": "reload_weights", "kwargs": {"weights_path": "/tmp/attacker-checkpoint"}}
CLIENT_KEY, ADMIN_KEY = "client-key-1", "admin-key-2"


@pytest.fixture
def instances() -> Iterator[tuple[str, str, list[dict[str, Any]]]]:
    """A stub prefill and decode instance serving vLLM's controls; the control calls they got."""
    calls: list[dict[str, Any]] = []
    with serve(with_controls(stub_prefill([]), "p", calls)) as p, \
            serve(with_controls(stub_decode([]), "d", calls)) as d:
        yield p, d, calls


def attack(base: str, headers: dict[str, str] | None = None) -> list[int]:
    """Each admin route once (the weight reload with the attacker's checkpoint): their statuses."""
    statuses = []
    for method, path in ADMIN:
        resp = httpx.request(method, f"{base}{path}", headers=headers, timeout=30,
                             json=RELOAD if path == "/collective_rpc" else None)
        statuses.append(resp.status_code)
    return statuses


def complete(base: str, headers: dict[str, str] | None = None) -> int:
    return httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers,
                      timeout=30).status_code


def test_without_an_admin_key_admin_routes_answer_loopback_only(tmp_path: Path, instances: Any) -> None:
    """A proxy listening beyond loopback, no key set: a client from another address gets 403 on every admin route,
    saying how to enable them, and nothing reaches the instances (no pause, no reload from the attacker's path);
    clients are still served. From loopback the routes work as before."""
    p, d, calls = instances
    source = local_ip_towards("8.8.8.8")
    with proxy_process(tmp_path, "--discovery-port", "0", "--prefill", p, "--decode", d, host="0.0.0.0") as proxy:
        if source is not None and not ipaddress.ip_address(source).is_loopback:
            remote = f"http://{source}:{proxy.port}"
            assert attack(remote) == [403] * len(ADMIN)
            refused = httpx.post(f"{remote}/pause", timeout=30)
            assert "P2PKV_PROXY_ADMIN_KEY" in refused.json()["error"]["message"]
            assert calls == []
            assert [complete(remote) for _ in range(5)] == [200] * 5
        assert attack(proxy.url) == [200] * len(ADMIN)
        assert ("p", "/collective_rpc") in [(c["name"], c["path"]) for c in calls]
        assert complete(proxy.url) == 200

    from fastapi import Request  # the decision itself, for a machine without an address beyond loopback

    from p2pkv.proxy.admin import admin_refusal

    def asked(host: str, auth: str = "") -> Request:
        headers = [(b"authorization", auth.encode())] if auth else []
        return Request({"type": "http", "method": "POST", "path": "/pause", "headers": headers,
                        "client": (host, 4000)})

    for host in ("10.0.0.5", "192.0.2.7", "::ffff:10.0.0.5", "2001:db8::1"):
        refusal = admin_refusal(asked(host), "")
        assert refusal is not None and refusal.status_code == 403
    for host in ("127.0.0.1", "127.1.2.3", "::1"):
        assert admin_refusal(asked(host), "") is None
    assert admin_refusal(asked("10.0.0.5", f"Bearer {ADMIN_KEY}"), ADMIN_KEY) is None
    refusal = admin_refusal(asked("127.0.0.1", f"Bearer {CLIENT_KEY}"), ADMIN_KEY)
    assert refusal is not None and refusal.status_code == 401


def test_with_an_admin_key_the_client_key_opens_no_admin_route(tmp_path: Path, instances: Any) -> None:
    """Client and admin keys set: no key and the client key are refused on every admin route, from loopback too;
    the admin key opens them, and what the proxy sends the instances carries the client key, never the admin
    key."""
    p, d, calls = instances
    keys = {"P2PKV_PROXY_API_KEY": CLIENT_KEY, "P2PKV_PROXY_ADMIN_KEY": ADMIN_KEY}
    with proxy_process(tmp_path, "--discovery-port", "0", "--prefill", p, "--decode", d, env=keys) as proxy:
        client = {"Authorization": f"Bearer {CLIENT_KEY}"}
        assert attack(proxy.url) == [401] * len(ADMIN)
        assert attack(proxy.url, client) == [401] * len(ADMIN)
        assert attack(proxy.url, {"Authorization": f"Bearer {ADMIN_KEY}x"}) == [401] * len(ADMIN)
        assert calls == []
        assert complete(proxy.url, client) == 200
        assert attack(proxy.url, {"Authorization": f"Bearer {ADMIN_KEY}"}) == [200] * len(ADMIN)
        assert calls and {c["auth"] for c in calls} == {f"Bearer {CLIENT_KEY}"}
        assert complete(proxy.url, client) == 200


def test_a_pause_with_no_instance_known_does_not_pause_the_proxy(tmp_path: Path) -> None:
    """/pause before any instance is known answers 503 and leaves the proxy serving: requests are not held for a
    resume, and once an instance announces itself they are answered."""
    d_seen: list[dict[str, Any]] = []
    with proxy_process(tmp_path, "--request-timeout", "3") as proxy, serve(stub_decode(d_seen)) as d:
        assert httpx.post(f"{proxy.url}/pause", timeout=30).status_code == 503
        for _ in range(3):
            resp = httpx.post(f"{proxy.url}/v1/completions", json={"prompt": "x"}, timeout=30)
            assert resp.status_code == 503 and "no decode instance" in resp.json()["error"]["message"], resp.text
        with dealer(f"tcp://127.0.0.1:{proxy.discovery_port}") as instance:
            instance.send(encode_datagram(Heartbeat("decode", d, "127.0.0.1:7200", 30.0, "d"), b""))
            wait_for(lambda: len(proxy.listed()) == 1)
        assert [complete(proxy.url) for _ in range(5)] == [200] * 5
        assert len(d_seen) == 5
