"""Discovery attacks on a real proxy process: forged heartbeats over ZMQ must not add, rewrite or flood instances."""

from __future__ import annotations

import ipaddress
import subprocess
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from p2pkv.bench.cluster import free_ports
from p2pkv.errors import ConfigError
from p2pkv.hostaddr import local_ip_towards
from p2pkv.protocol import Heartbeat, encode_datagram
from p2pkv.proxy import ProxyConfig
from tests.helpers.proxy_process import ProxyProcess, beating, dealer, proxy_argv, proxy_env, proxy_process
from tests.helpers.servers import serve
from tests.helpers.stubs import stub_decode
from tests.helpers.unit import wait_for

SECRET = "s3cret-of-the-cluster"
ATTACKER_KV = "127.0.0.1:6666"


def own_address() -> str | None:
    """This machine's address beyond loopback, if it has one."""
    address = local_ip_towards("8.8.8.8")
    return None if address is None or ipaddress.ip_address(address).is_loopback else address


def beat(role: str, http: str, kv: str, engine: str, interval_s: float = 1.0, secret: str = "") -> bytes:
    return encode_datagram(Heartbeat(role, http, kv, interval_s, engine), secret.encode())


def legacy(kind: str, http: str, kv: str) -> bytes:
    return msgspec.msgpack.encode({"type": kind, "http_address": http, "zmq_address": kv})


def heartbeats(proxy: ProxyProcess) -> float:
    """Discovery messages the proxy has read, whatever it made of them."""
    lines = proxy.get("/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("p2pkv_proxy_heartbeats_total{"))


def _ask(url: str, n: int) -> None:
    for _ in range(n):
        resp = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert resp.status_code == 200, resp.text


def test_discovery_beyond_loopback_needs_the_secret(tmp_path: Path, backends: Any) -> None:
    """Listening for heartbeats beyond loopback, a proxy without P2PKV_AUTH_SECRET exits at once with an error naming
    the variable and the flag; with the flag it starts and says so loudly. With the secret, it takes the real
    instances' signed heartbeats and none of the unsigned, wrongly signed or old-format ones an attacker sends from
    another address: they are counted, nothing they name is listed, and clients' requests go to the real
    instances."""
    port, discovery = free_ports(2)
    argv = proxy_argv(port, discovery, "--discovery-host", "0.0.0.0")
    run = subprocess.run(argv, env=proxy_env(), capture_output=True, text=True, timeout=15)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "P2PKV_AUTH_SECRET" in run.stderr and "--allow-unauthenticated-discovery" in run.stderr, run.stderr
    with pytest.raises(ConfigError, match="P2PKV_AUTH_SECRET"):  # also for an address this machine may lack
        ProxyConfig((), (), host="10.1.2.3", discovery_port=1)
    ProxyConfig((), (), host="10.1.2.3", discovery_port=1, secret="s")
    ProxyConfig((), (), host="0.0.0.0", discovery_host="127.0.0.2", discovery_port=1)
    with proxy_process(tmp_path, "--discovery-host", "0.0.0.0", "--allow-unauthenticated-discovery") as proxy:
        assert "UNAUTHENTICATED DISCOVERY" in proxy.log()

    p, d, _, d_seen = backends
    source = own_address() or "127.0.0.1"
    with proxy_process(tmp_path, "--discovery-host", "0.0.0.0", env={"P2PKV_AUTH_SECRET": SECRET}) as proxy:
        real = lambda: [beat("prefill", p, "127.0.0.1:7100", "p", secret=SECRET),  # noqa: E731
                        beat("decode", d, "127.0.0.1:7200", "d", secret=SECRET)]
        with beating(f"tcp://127.0.0.1:{proxy.discovery_port}", real, 0.3):
            wait_for(lambda: len(proxy.listed()) == 2)
            with serve(stub_decode([])) as fake, dealer(f"tcp://{source}:{proxy.discovery_port}") as attacker:
                for i in range(30):
                    attacker.send(beat("decode", fake, ATTACKER_KV, f"evil{i}"))
                    attacker.send(beat("decode", fake, ATTACKER_KV, f"evil{i}", secret="guessed"))
                    attacker.send(legacy("D", fake, ATTACKER_KV))
                wait_for(lambda: proxy.metric('p2pkv_proxy_heartbeats_total{outcome="refused"}') == 90)
                assert sorted(i["address"] for i in proxy.listed()) == sorted([p, d])
                _ask(proxy.url, 10)
        assert len(d_seen) == 10


def test_forged_heartbeats_cannot_rewrite_a_live_instance(tmp_path: Path, backends: Any) -> None:
    """With discovery unauthenticated (loopback, no secret), forged heartbeats naming live instances try to move the
    decode instance's KV address to the attacker's port, to change roles and engine ids, in both formats: each is
    refused and counted, logged once, and every prefill still sends the KV to the real decode instance. After the
    real decode instance stops beating and expires, its restart (another engine id and KV port) is taken."""
    p, d, p_seen, _ = backends
    real_kv = "127.0.0.1:7200"
    with proxy_process(tmp_path) as proxy:
        endpoint = f"tcp://127.0.0.1:{proxy.discovery_port}"
        with beating(endpoint, lambda: [beat("prefill", p, "127.0.0.1:7100", "p", 0.5)], 0.2):
            with beating(endpoint, lambda: [beat("decode", d, real_kv, "d", 0.5)], 0.2):
                wait_for(lambda: len(proxy.listed()) == 2)
                forged = [beat("decode", d, ATTACKER_KV, "d", 0.5), beat("decode", d, real_kv, "evil", 0.5),
                          beat("prefill", d, real_kv, "d", 0.5), beat("both", d, real_kv, "d", 0.5),
                          beat("decode", p, "127.0.0.1:7100", "p", 0.5), legacy("D", d, ATTACKER_KV),
                          legacy("P", d, real_kv), beat("prefill", p, ATTACKER_KV, "p", 0.5)]
                before = heartbeats(proxy)
                with dealer(endpoint) as attacker:
                    for _ in range(5):
                        for raw in forged:
                            attacker.send(raw)
                    wait_for(lambda: heartbeats(proxy) >= before + 40)
                by_role = {i["role"]: i for i in proxy.listed()}
                assert sorted(by_role) == ["decode", "prefill"] and len(proxy.listed()) == 2
                assert by_role["decode"]["kv_address"] == real_kv and by_role["decode"]["address"] == d
                _ask(proxy.url, 10)
                assert {s["body"]["kv_transfer_params"]["decode_kv_address"] for s in p_seen} == {real_kv}
                wait_for(lambda: proxy.metric('p2pkv_proxy_heartbeats_total{outcome="rewrite"}') == 40)
                assert proxy.log().count("refused a heartbeat naming live") == 1
            wait_for(lambda: [i["role"] for i in proxy.listed()] == ["prefill"])  # expired
            with beating(endpoint, lambda: [beat("decode", d, "127.0.0.1:7300", "d2", 0.5)], 0.2):
                wait_for(lambda: [i["kv_address"] for i in proxy.listed() if i["role"] == "decode"]
                         == ["127.0.0.1:7300"])
                assert f"decode instance {d} restarted" in proxy.log()
                _ask(proxy.url, 2)


def test_forged_instances_beyond_the_cap_and_long_intervals_are_refused(tmp_path: Path, backends: Any) -> None:
    """An attacker announces 200 fake decode instances, and some with an hour-long interval (to linger): beyond
    --max-instances new instances are refused and counted, the real ones keep beating, and every client request is
    answered by the real instances."""
    p, d, _, d_seen = backends
    with proxy_process(tmp_path, "--max-instances", "3") as proxy:
        endpoint = f"tcp://127.0.0.1:{proxy.discovery_port}"
        real = lambda: [beat("prefill", p, "127.0.0.1:7100", "p", 0.5),  # noqa: E731
                        beat("decode", d, "127.0.0.1:7200", "d", 0.5)]
        with beating(endpoint, real, 0.2), dealer(endpoint) as attacker:
            wait_for(lambda: len(proxy.listed()) == 2)
            before = heartbeats(proxy)
            attacker.send(beat("decode", "127.0.0.1:9", ATTACKER_KV, "long", 3600.0))
            wait_for(lambda: heartbeats(proxy) > before)
            assert "127.0.0.1:9" not in [i["address"] for i in proxy.listed()]
            before = heartbeats(proxy)
            for i in range(200):
                attacker.send(beat("decode", f"127.0.0.{2 + i // 100}:{1000 + i}", ATTACKER_KV, f"fake{i}", 60.0))
            wait_for(lambda: heartbeats(proxy) >= before + 200)
            listed = proxy.listed()
            assert len(listed) == 3
            assert proxy.metric('p2pkv_proxy_heartbeats_total{outcome="over_cap"}') == 199
            assert proxy.metric('p2pkv_proxy_heartbeats_total{outcome="refused"}') == 1
            beaten = {i["address"]: i["last_heartbeat"] for i in listed}
            wait_for(lambda: all(i["last_heartbeat"] > beaten[i["address"]] for i in proxy.listed()
                                 if i["address"] in (p, d)))
            for _ in range(10):  # the one fake that fit is shunned once refused; the real decode instance answers
                resp = httpx.post(f"{proxy.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
                assert resp.status_code == 200, resp.text
        assert len(d_seen) == 10
