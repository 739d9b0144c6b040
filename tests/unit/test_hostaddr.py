"""The address this host is named by for a KV port bound to a wildcard: one rule for heartbeats, `DecodeParams` and
each engine's hello, so that a decode worker matches a refused hello with the prefill instance a load names."""

from __future__ import annotations

import socket
import time

import pytest

from p2pkv import hostaddr
from p2pkv.bench.cluster import free_ports
from p2pkv.config import ExtraConfig, parse_connector_config
from p2pkv.discovery.heartbeat import sender_for
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.params import Address
from tests.helpers.peer import layout


@pytest.fixture(autouse=True)
def no_host_ip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hostaddr.HOST_IP_ENV, raising=False)


def test_a_bound_address_is_its_own_name_and_a_wildcard_takes_the_first_rule_that_answers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert hostaddr.advertised_host("10.1.2.3", "127.0.0.1") == "10.1.2.3"
    assert hostaddr.advertised_host("0.0.0.0", "127.0.0.1") == "127.0.0.1"  # the route to a proxy on this host
    monkeypatch.setenv(hostaddr.HOST_IP_ENV, "10.9.9.9")
    assert hostaddr.advertised_host("0.0.0.0", "127.0.0.1") == "10.9.9.9"  # vLLM's setting comes first
    monkeypatch.delenv(hostaddr.HOST_IP_ENV)
    monkeypatch.setattr(hostaddr, "local_ip_towards", lambda host: None)  # no route
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.7.7.7")
    assert hostaddr.advertised_host("::", "") == "10.7.7.7"

    def unresolved(name: str) -> str:
        raise socket.gaierror("no such name")

    monkeypatch.setattr(socket, "gethostbyname", unresolved)
    assert hostaddr.advertised_host("", "") == "127.0.0.1"


def test_heartbeats_decode_params_and_hellos_name_a_wildcard_kv_port_alike() -> None:
    """Both engines bind 0.0.0.0 with a proxy on this host: the refused engine's hello names it as its instance's
    heartbeat and `DecodeParams` (`ExtraConfig.kv_address`) do."""
    p_port, d_port = free_ports(2, run=1)
    keys = {"kv_host": "0.0.0.0", "proxy_ip": "127.0.0.1", "proxy_port": 30001, "http_port": 8100}
    config = parse_connector_config("kv_producer", p_port, "recompute", keys)
    named = config.extra.kv_address(p_port)
    sender = sender_for(config)
    assert sender is not None and sender.message.kv_address == str(named)
    engines = []
    for port, block_bytes in ((p_port, 4096), (d_port, 8192)):
        engine = TransferEngine(EngineSettings.from_config(ExtraConfig(**keys), port, 0), layout(2, block_bytes))
        engine.start()
        engines.append(engine)
    prefill, decode = engines
    try:
        views = tuple(memoryview(bytes(4096)) for _ in range(1))
        prefill.push_layer("t", Address("127.0.0.1", d_port), 0, 1, views, time.monotonic() + 5)
        out = prefill.wait_outgoing("t", 5)
        assert out is not None and "KV layout mismatch" in out.reason
        assert decode.refusal(named) is not None
    finally:
        for engine in engines:
            engine.close()
