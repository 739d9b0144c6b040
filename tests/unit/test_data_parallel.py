"""Data-parallel instances: one API server in front of several engines. Each engine's workers bind ports of their
own, each engine announces itself with the rank its API server reaches it by, and the proxy routes to engines,
pinning each request with vLLM's `X-data-parallel-rank` header (stub backends that are real HTTP servers, a real
proxy, heartbeats over ZMQ)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from p2pkv.bench.cluster import InstanceSpec, vllm_argv
from p2pkv.config import launch_of, parse_connector_config
from p2pkv.discovery import HeartbeatSender, parse_announcement
from p2pkv.discovery.heartbeat import sender_for
from p2pkv.errors import ConfigError, ProtocolError
from p2pkv.params import Address
from p2pkv.protocol import Heartbeat, encode_datagram
from p2pkv.proxy.instances import DP_RANK_HEADER, Instance
from p2pkv.proxy.registry import Policy, Pool
from p2pkv.vllm.connector import _data_parallel, _start_of
from tests.helpers.servers import serve
from tests.helpers.stubs import stub_decode, stub_prefill
from tests.helpers.unit import discovering_proxy, listed, wait_for


def test_each_engine_of_an_instance_binds_ports_of_its_own() -> None:
    config = parse_connector_config("kv_consumer", 21000, "recompute", {"metrics_port": 9100})
    assert config.for_data_parallel_rank(0, 2) is config
    second = config.for_data_parallel_rank(1, 2)  # engines of two workers each (TP 2): 21000-21001, 21002-21003
    assert (second.kv_port, second.worker_port(1), second.extra.metrics_port) == (21002, 21003, 9102)
    assert config.for_data_parallel_rank(3, 1).kv_port == 21003
    unmetered = parse_connector_config("kv_consumer", 21000, "recompute", {}).for_data_parallel_rank(2, 4)
    assert (unmetered.kv_port, unmetered.extra.metrics_port) == (21008, 0)
    with pytest.raises(ConfigError, match="past 65535"):
        parse_connector_config("kv_consumer", 65534, "recompute", {}).for_data_parallel_rank(1, 2)
    with pytest.raises(ConfigError, match="metrics_port"):
        parse_connector_config("kv_consumer", 100, "recompute", {"metrics_port": 65535}).for_data_parallel_rank(1, 1)


def _vllm(size: int = 1, rank: int = 0, local: int | None = 0, index: int | None = None, external: bool = False,
          hybrid: bool = False, engine_id: str = "9f3c2a61-1b2d-4e5f-8a9b-0c1d2e3f4a5b") -> Any:
    pc = SimpleNamespace(data_parallel_size=size, data_parallel_rank=rank, data_parallel_rank_local=local,
                         data_parallel_index=rank if index is None else index, data_parallel_external_lb=external,
                         data_parallel_hybrid_lb=hybrid)
    return SimpleNamespace(parallel_config=pc, kv_transfer_config=SimpleNamespace(engine_id=engine_id))


@pytest.mark.parametrize("vllm_config, expected", [
    # No data parallelism: vLLM's local rank is 0 then too (VLLM_DP_RANK_LOCAL's default), or None.
    (_vllm(), (0, None)),
    (_vllm(local=None), (0, None)),
    # A dense model: vLLM treats each engine as size 1, rank 0, keeping the rank in data_parallel_index; each
    # engine's id gets a `_dp<rank>` suffix.
    (_vllm(local=0, index=0, engine_id="e1_dp0"), (0, 0)),
    (_vllm(local=1, index=1, engine_id="e1_dp1"), (1, 1)),
    (_vllm(size=4, rank=1, local=1), (1, 1)),  # a mixture-of-experts model keeps its sizes
    (_vllm(local=1, index=3), (1, 3)),  # internal load balancing over hosts: the API server fronts ranks 0-3
    (_vllm(local=1, index=3, hybrid=True), (1, 1)),  # hybrid: it fronts this host's engines only
    (_vllm(size=4, rank=3, local=0, index=3, external=True), (0, None)),  # an API server per rank
])
def test_an_engine_knows_its_port_offset_and_the_rank_that_reaches_it(vllm_config: Any,
                                                                      expected: tuple[int, int | None]) -> None:
    assert _data_parallel(vllm_config) == expected


def test_a_heartbeat_names_the_engines_rank() -> None:
    config = parse_connector_config("kv_consumer", 21002, "recompute", {
        "proxy_ip": "127.0.0.1", "proxy_port": 30001, "http_port": 8100, "kv_host": "127.0.0.1"})
    sender = sender_for(config, 1, 1, 1)
    assert sender is not None and sender.message.dp_rank == 1
    announced = parse_announcement(encode_datagram(sender.message, b""), b"")
    assert (announced.dp_rank, str(announced.kv)) == (1, "127.0.0.1:21002")
    plain = sender_for(config)
    assert plain is not None and parse_announcement(encode_datagram(plain.message, b""), b"").dp_rank is None
    with pytest.raises(ProtocolError, match="dp_rank"):
        parse_announcement(encode_datagram(Heartbeat("decode", "h:1", "", 1.0, "e", 1, 1, 5000), b""), b"")
    legacy = parse_connector_config("kv_consumer", 21002, "recompute", {
        "proxy_ip": "127.0.0.1", "proxy_port": 30001, "http_port": 8100, "heartbeat_format": "legacy"})
    with pytest.raises(ConfigError, match="data-parallel"):
        sender_for(legacy, 1, 1, 0)


def test_static_engines_and_their_headers() -> None:
    engine = Instance.parse("http://10.0.0.1:8000@10.0.0.1:21001#1")
    assert (str(engine.http), str(engine.kv), engine.dp_rank, engine.name) == (
        "10.0.0.1:8000", "10.0.0.1:21001", 1, "10.0.0.1:8000#1")
    assert engine.headers({"authorization": "Bearer k"}) == {"authorization": "Bearer k", DP_RANK_HEADER: "1"}
    plain = Instance.parse("10.0.0.1:8000")
    assert plain.dp_rank is None and plain.headers({}) == {} and plain.name == "10.0.0.1:8000"
    assert Instance.parse("10.0.0.1:8000#0").dp_rank == 0
    for bad in ("10.0.0.1:8000#", "10.0.0.1:8000#x", "10.0.0.1:8000#-1", "10.0.0.1:8000#9999"):
        with pytest.raises(ConfigError, match="RANK"):
            Instance.parse(bad)


def test_a_pool_keeps_the_engines_behind_one_address_apart() -> None:
    pool = Pool("decode", Policy.ROUND_ROBIN)
    http = Address.parse("10.0.0.1:8000")
    for rank in (0, 1):
        assert pool.heard_from(Instance(http, Address("10.0.0.1", 21000 + rank), rank), 0.0, 1e12)
    assert not pool.heard_from(Instance(http, Address("10.0.0.1", 21001), 1), 0.0, 1e12)  # renewed, not new
    assert sorted(s.instance.dp_rank or 0 for s in pool.states) == [0, 1]
    assert pool.remove(Instance(http, None, 0)) and [s.instance.dp_rank for s in pool.states] == [1]


def test_the_proxy_pins_each_request_to_the_engines_it_chose() -> None:
    """Two prefill and two decode engines behind one address each: every request's prefill and decode carry the
    rank of the engine chosen, and the prefill is told the chosen decode engine's KV address."""
    p_seen: list[dict[str, Any]] = []
    d_seen: list[dict[str, Any]] = []
    d_ranks: list[str | None] = []
    with (serve(stub_prefill(p_seen)) as p, serve(stub_decode(d_seen, dp_ranks=d_ranks)) as d,
          discovering_proxy() as (proxy, _, discovery)):
        senders = [HeartbeatSender(Address("127.0.0.1", discovery), role, Address.parse(http),
                                   Address("127.0.0.1", port + rank), 0.2, b"", dp_rank=rank)
                   for role, http, port in (("prefill", p, 21000), ("decode", d, 22000)) for rank in (0, 1)]
        for sender in senders:
            sender.start()
        try:
            wait_for(lambda: len(listed(proxy)) == 4)
            assert sorted((i["role"], i["dp_rank"], i["kv_address"]) for i in listed(proxy)) == [
                ("decode", 0, "127.0.0.1:22000"), ("decode", 1, "127.0.0.1:22001"),
                ("prefill", 0, "127.0.0.1:21000"), ("prefill", 1, "127.0.0.1:21001")]
            traced = []
            for _ in range(4):
                resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x", "max_tokens": 3})
                assert resp.status_code == 200
                traced.append((resp.headers["x-p2pkv-prefill"], resp.headers["x-p2pkv-decode"]))
        finally:
            for sender in senders:
                sender.close()
    assert len(p_seen) == len(d_ranks) == 4
    for seen, rank, (prefill_name, decode_name) in zip(p_seen, d_ranks, traced, strict=True):
        assert prefill_name == f"{p}#{seen['dp_rank']}"
        assert decode_name == f"{d}#{rank}"
        # The prefill engine pushes to the decode engine that then gets the request.
        assert seen["body"]["kv_transfer_params"]["decode_kv_address"] == f"127.0.0.1:{22000 + int(rank or 0)}"
    assert {s["dp_rank"] for s in p_seen} == {"0", "1"} and set(d_ranks) == {"0", "1"}


def test_up_gives_each_engine_a_run_of_ports_and_vllm_its_data_parallel_size() -> None:
    spec = InstanceSpec("kv_consumer", 8000, 21000, tp_size=2, dp_size=2)
    assert spec.ranks == 4
    argv = vllm_argv("/m", spec, "127.0.0.1", "float32")
    assert argv[argv.index("--data-parallel-size") + 1] == "2"
    assert "--data-parallel-size" not in vllm_argv("/m", InstanceSpec("kv_consumer", 8000, 21000), "127.0.0.1",
                                                   "float32")


def test_a_refused_connection_sends_requests_away_from_every_engine_behind_that_address() -> None:
    """A refused connection says the API server is down: its other engines are picked after the other servers'."""
    pool = Pool("prefill", Policy.ROUND_ROBIN)
    down, up = Address.parse("10.0.0.1:8000"), Address.parse("10.0.0.2:8000")
    for http in (down, up):
        for rank in (0, 1):
            pool.heard_from(Instance(http, None, rank), 0.0, 1e12)
    refused = pool.states[0]
    refused.refused()
    picked = {pool.pick(frozenset({refused.instance})).instance for _ in range(8)}  # type: ignore[union-attr]
    assert {i.http for i in picked} == {up} and {i.dp_rank for i in picked} == {0, 1}
    # With only the down server's engines left, they are still picked: better a try than no instance.
    assert pool.pick(frozenset(s.instance for s in pool.states if s.instance.http == up)) is not None


def test_server_wide_endpoints_are_asked_of_one_engine_per_server() -> None:
    """Models and stored responses belong to the API server: a lookup through the proxy asks each server once,
    not once per engine."""
    d_seen: list[dict[str, Any]] = []
    lookups: list[str] = []
    with (serve(stub_decode(d_seen, lookups=lookups)) as d, discovering_proxy() as (proxy, _, discovery)):
        senders = [HeartbeatSender(Address("127.0.0.1", discovery), "decode", Address.parse(d),
                                   Address("127.0.0.1", 22000 + rank), 0.2, b"", dp_rank=rank) for rank in (0, 1)]
        for sender in senders:
            sender.start()
        try:
            wait_for(lambda: len(listed(proxy)) == 2)
            resp = httpx.get(f"http://{proxy}/v1/responses/resp_missing", timeout=10)
            assert resp.status_code == 404
            resp = httpx.post(f"http://{proxy}/v1/responses", timeout=10, json={
                "model": "tiny", "input": "x", "previous_response_id": "resp_missing"})
            assert resp.status_code == 200
        finally:
            for sender in senders:
                sender.close()
    assert lookups == ["resp_missing", "resp_missing"]  # once for each request, not once per engine


def test_a_start_of_an_instance_is_told_by_vllms_engine_and_instance_ids() -> None:
    """Either id tells two starts apart where the other is the same; the same pair is the same start as far as peers
    can tell; with neither, none is said. (vLLM 0.32 never keeps an instance id: see the next test.)"""

    def config(engine_id: str | None, instance_id: str) -> Any:
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(engine_id=engine_id), instance_id=instance_id)

    starts = {_start_of(config(e, i)) for e, i in (("e1", "ab12c"), ("e1", "ff00d"), ("e2", "ab12c"))}
    assert len(starts) == 3
    assert _start_of(config("e1", "ab12c")) == _start_of(config("e1", "ab12c"))
    assert _start_of(config(None, "")) == "" and _start_of(config("", "ab12c")) != ""


def test_two_starts_with_the_same_engine_id_have_launches_of_their_own() -> None:
    """vLLM's own config, as each start builds it: `instance_id` comes from the clock even where it is given, so an
    instance whose `kv_transfer_config` sets `engine_id` still differs from its earlier start; and the workers get
    the scheduler's config pickled, so they name the same launch as it."""
    import pickle

    from vllm.config import KVTransferConfig, VllmConfig

    def start() -> Any:
        transfer = KVTransferConfig(kv_connector="P2pNcclConnector", kv_connector_module_path="p2pkv.vllm",
                                    kv_role="kv_both", engine_id="fixed-engine")
        return VllmConfig(kv_transfer_config=transfer, instance_id="fixed-instance")

    first, second = start(), start()
    assert launch_of(_start_of(first)) != launch_of(_start_of(second))
    assert launch_of(_start_of(pickle.loads(pickle.dumps(first)))) == launch_of(_start_of(first))
