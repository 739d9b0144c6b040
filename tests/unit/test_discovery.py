"""Discovery: both heartbeat formats into a real proxy over ZMQ, expiry at request time, authentication, and the
instance-side sender, against stub OpenAI backends that are real HTTP servers."""

from __future__ import annotations

import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from p2pkv.bench.cluster import free_port
from p2pkv.config import launch_of, parse_connector_config
from p2pkv.discovery import HeartbeatSender, parse_announcement
from p2pkv.discovery.announcement import MAX_ANNOUNCEMENT_BYTES
from p2pkv.discovery.heartbeat import MAX_REASON_BYTES, MAX_REFUSAL_AGE_S, MAX_REFUSED, sender_for
from p2pkv.engine.refused import Refusal
from p2pkv.errors import ConfigError, ProtocolError
from p2pkv.hostaddr import advertised_host
from p2pkv.params import Address
from p2pkv.protocol import Heartbeat, PeerRefused, PushAbort, encode_datagram, encode_frame
from tests.helpers.servers import serve
from tests.helpers.stubs import stub_decode, stub_prefill
from tests.helpers.unit import discovering_proxy, listed, wait_for

SECRET = b"s3cret"


def legacy(kind: str, http: str, zmq_address: str = "127.0.0.1:7000") -> bytes:
    return msgspec.msgpack.encode({"type": kind, "http_address": http, "zmq_address": zmq_address})


def typed(role: str, http: str, kv: str = "127.0.0.1:7000", interval_s: float = 3.0, secret: bytes = b"") -> bytes:
    return encode_datagram(Heartbeat(role, http, kv, interval_s), secret)


def test_both_formats_parse() -> None:
    old = parse_announcement(legacy("D", "10.0.0.2:8000", "10.0.0.2:14579"), b"")
    assert (old.role, str(old.http), str(old.kv), old.interval_s, old.legacy) == (
        "decode", "10.0.0.2:8000", "10.0.0.2:14579", 3.0, True)
    assert parse_announcement(legacy("P", "h:1"), b"").role == "prefill"
    new = parse_announcement(typed("both", "h:2", "h:3", 0.5, SECRET), SECRET)
    assert (new.role, str(new.http), str(new.kv), new.interval_s, new.legacy) == ("both", "h:2", "h:3", 0.5, False)
    assert new.tp_size == 0  # not said
    sized = parse_announcement(encode_datagram(Heartbeat("decode", "h:4", "h:5", 1.0, "e", 4, 2), b""), b"")
    assert (sized.tp_size, sized.pp_size) == (4, 2)
    assert sized.launch == ""  # not said
    started = Heartbeat("decode", "h:4", "h:5", 1.0, "e", launch="0123456789abcdef")
    assert parse_announcement(encode_datagram(started, b""), b"").launch == "0123456789abcdef"


@pytest.mark.parametrize("raw, secret, error", [
    (b"", b"", "neither"),
    (b"\xc1garbage", b"", "neither"),
    (msgspec.msgpack.encode([1, 2]), b"", "expected a map"),
    (msgspec.msgpack.encode({"type": "X", "http_address": "h:1", "zmq_address": "h:2"}), b"", "'P' or 'D'"),
    (msgspec.msgpack.encode({"type": "P", "zmq_address": "h:2"}), b"", "http_address"),
    (msgspec.msgpack.encode({"type": "P", "http_address": "nohost", "zmq_address": "h:2"}), b"", "HOST:PORT"),
    (legacy("P", "h:1"), SECRET, "requires a shared secret"),
    (typed("prefill", "h:1"), SECRET, "authentication failed"),
    (typed("prefill", "h:1", secret=b"other"), SECRET, "authentication failed"),
    (typed("leader", "h:1"), b"", "role"),
    (typed("decode", "h:1", interval_s=0), b"", "interval"),
    (typed("decode", "h:1", interval_s=0.01), b"", "interval"),  # would cycle instances through the pools
    (typed("decode", "h:1", interval_s=61), b"", "interval"),
    (typed("decode", "h:1")[:-3], b"", "datagram"),
    (encode_datagram(Heartbeat("decode", "h:1", "", 1.0, "e", -1), b""), b"", "tp_size"),
    (encode_datagram(Heartbeat("decode", "h:1", "", 1.0, "e", 1, 5000), b""), b"", "pp_size"),
    (encode_datagram(Heartbeat("decode", "h:1", "", 1.0, refused=(PeerRefused("h:2", "x", 1.0),) * 17), b""), b"",
     "17 refused peers"),
    (encode_datagram(Heartbeat("decode", "h:1", "", 1.0, refused=(PeerRefused("h:2", "x", -1.0),)), b""), b"",
     "refusal age"),
    (encode_datagram(Heartbeat("decode", "h:1", "", 1.0, refused=(PeerRefused("nohost", "x", 1.0),)), b""), b"",
     "refused address"),
    (encode_datagram(Heartbeat("decode", "h:1", "", 1.0, launch="not-hex-digits!!"), b""), b"", "launch"),
    (encode_datagram(PushAbort("t", "r"), b""), b"", "expected a heartbeat"),
    (encode_frame(Heartbeat("decode", "h:1", "", 1.0), 10, b""), b"", "payload of 10 bytes"),
    (b"P2KV" + bytes(10_000), b"", "too large"),
])
def test_malformed_or_unauthenticated_messages_are_refused(raw: bytes, secret: bytes, error: str) -> None:
    with pytest.raises(ProtocolError, match=error):
        parse_announcement(raw, secret)


def metric(proxy: str, name: str) -> float:
    for line in httpx.get(f"http://{proxy}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def test_old_heartbeats_register_instances_and_garbage_does_not_stop_discovery() -> None:
    p_seen: list[dict[str, Any]] = []
    d_seen: list[dict[str, Any]] = []
    with serve(stub_prefill(p_seen)) as p, serve(stub_decode(d_seen)) as d, discovering_proxy() as (proxy, send, _):
        assert httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x"}).status_code == 503
        for raw in (b"\x00garbage", msgspec.msgpack.encode("not a map"), bytes(70_000)):
            send(raw)

        def beat() -> bool:
            # The oversized message made the proxy drop this connection; like a real sender, keep beating.
            send(legacy("P", p))
            send(legacy("D", d, "127.0.0.1:4321"))
            return len(listed(proxy)) == 2

        wait_for(beat)
        instances = {i["role"]: i for i in listed(proxy)}
        assert instances["prefill"]["address"] == p and instances["decode"]["address"] == d
        assert instances["decode"]["kv_address"] == "127.0.0.1:4321"
        assert instances["decode"]["source"] == "heartbeat"
        assert abs(instances["decode"]["last_heartbeat"] - time.time()) < 10
        resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "abc"
        # The heartbeat's KV address is used as is: no probe of the decode instance.
        assert p_seen[0]["body"]["kv_transfer_params"]["decode_kv_address"] == "127.0.0.1:4321"
        assert metric(proxy, 'p2pkv_proxy_heartbeats_total{outcome="refused"}') >= 2
        assert metric(proxy, 'p2pkv_proxy_instances{role="decode"}') == 1


def test_overdue_instances_are_dropped_at_request_time() -> None:
    p_seen: list[dict[str, Any]] = []
    d_seen: list[dict[str, Any]] = []
    with serve(stub_prefill(p_seen)) as p, serve(stub_decode(d_seen)) as d, discovering_proxy() as (proxy, send, _):
        send(typed("decode", d, interval_s=60))

        def beat() -> bool:
            send(typed("prefill", p, interval_s=0.3))
            return len(listed(proxy)) == 2 and httpx.post(f"http://{proxy}/v1/completions",
                                                          json={"prompt": "x"}).status_code == 200

        wait_for(beat)  # beats until it is listed and served, as a live instance would
        assert len(p_seen) >= 1
        served = len(p_seen)
        time.sleep(1.0)  # three missed intervals of the prefill instance; no other heartbeat arrives meanwhile
        resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x"})
        assert resp.status_code == 200  # the decode instance prefilled alone
        assert len(p_seen) == served and "kv_transfer_params" not in d_seen[-1]
        assert [i["role"] for i in listed(proxy)] == ["decode"]
        # A new heartbeat brings it back.
        send(typed("prefill", p, interval_s=0.3))
        wait_for(lambda: len(listed(proxy)) == 2)


def test_an_expired_decode_instance_gives_a_clear_503() -> None:
    d_seen: list[dict[str, Any]] = []
    with serve(stub_decode(d_seen)) as d, discovering_proxy(misses=2) as (proxy, send, _):
        wait_for(lambda: send(typed("decode", d, interval_s=0.2)) is None and len(listed(proxy)) == 1)
        time.sleep(0.6)
        resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x"})
        assert resp.status_code == 503 and "no decode instance" in resp.json()["error"]["message"]


def test_with_a_secret_only_signed_heartbeats_count() -> None:
    with serve(stub_decode([])) as d, discovering_proxy(secret=SECRET.decode()) as (proxy, send, _):
        send(legacy("D", d))
        send(typed("decode", d))
        send(typed("decode", d, secret=b"wrong"))
        wait_for(lambda: metric(proxy, 'p2pkv_proxy_heartbeats_total{outcome="refused"}') == 3)
        assert listed(proxy) == []
        send(typed("decode", d, secret=SECRET))
        wait_for(lambda: len(listed(proxy)) == 1)


def test_a_role_change_moves_the_instance_once_it_has_expired() -> None:
    """A heartbeat that changes a live instance's role is refused (anyone could send it); once the instance has
    missed its heartbeats (a restart with another role), the new role is taken."""
    with serve(stub_decode([])) as d, discovering_proxy() as (proxy, send, _):
        send(typed("prefill", d, interval_s=0.2))
        wait_for(lambda: [i["role"] for i in listed(proxy)] == ["prefill"])
        send(typed("decode", d, interval_s=0.2))
        wait_for(lambda: metric(proxy, 'p2pkv_proxy_heartbeats_total{outcome="rewrite"}') == 1)
        assert [i["role"] for i in listed(proxy)] == ["prefill"]
        wait_for(lambda: listed(proxy) == [])
        send(typed("decode", d, interval_s=0.2))
        wait_for(lambda: [i["role"] for i in listed(proxy)] == ["decode"])
        wait_for(lambda: listed(proxy) == [])
        send(typed("both", d))
        wait_for(lambda: sorted(i["role"] for i in listed(proxy)) == ["decode", "prefill"])


def test_the_sender_announces_only_while_its_server_is_healthy() -> None:
    with serve(stub_decode([])) as d, discovering_proxy(secret=SECRET.decode()) as (proxy, _, discovery):
        http = Address.parse(d)
        sender = HeartbeatSender(Address("127.0.0.1", discovery), "decode", http, Address("127.0.0.1", 5555), 0.2,
                                 SECRET)
        down = HeartbeatSender(Address("127.0.0.1", discovery), "prefill", Address("127.0.0.1", free_port()),
                               Address("127.0.0.1", 5556), 0.2, SECRET)
        sender.start()
        down.start()
        try:
            wait_for(lambda: len(listed(proxy)) == 1)
            time.sleep(1.0)
            (only,) = listed(proxy)
            assert (only["role"], only["address"], only["kv_address"]) == ("decode", d, "127.0.0.1:5555")
            assert sender.sent >= 2 and down.sent == 0
        finally:
            sender.close()
            down.close()
        wait_for(lambda: listed(proxy) == [], timeout_s=3)  # 3 missed intervals of 0.2 s


def test_a_server_slow_to_answer_its_health_check_is_still_announced() -> None:
    # A vLLM server starved of CPU can take over a second to answer /health. The sender waits for the answer until
    # the next beat is due instead of giving up (which, three times in a row, had the proxy drop a live instance).
    import asyncio

    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        await asyncio.sleep(1.3)
        return {"status": "ok"}

    with serve(app) as slow, discovering_proxy() as (proxy, _, discovery):
        sender = HeartbeatSender(Address("127.0.0.1", discovery), "decode", Address.parse(slow),
                                 Address("127.0.0.1", 5557), 2.0, b"")
        sender.start()
        try:
            wait_for(lambda: len(listed(proxy)) == 1, timeout_s=8)
            wait_for(lambda: sender.sent >= 2, timeout_s=8)  # and on, beat after beat
        finally:
            sender.close()


def test_sender_from_connector_config() -> None:
    config = parse_connector_config("kv_consumer", 14579, "recompute", {
        "proxy_ip": "127.0.0.1", "proxy_port": 30001, "http_port": 8100, "kv_host": "0.0.0.0",
        "heartbeat_interval_s": 1.5})
    sender = sender_for(config)
    assert sender is not None
    assert (sender.message.role, sender.message.http_address, sender.message.kv_address, sender.interval_s) == (
        "decode", "127.0.0.1:8100", "127.0.0.1:14579", 1.5)
    assert not sender.message.pulls and sender.message.launch == ""  # no engine id given
    started = sender_for(parse_connector_config("kv_consumer", 14579, "recompute", {
        "proxy_ip": "127.0.0.1", "proxy_port": 30001, "http_port": 8100}, "vllm-engine"))
    assert started is not None and parse_announcement(started.beat(), b"").launch == launch_of("vllm-engine")
    for role, pulls in (("kv_consumer", True), ("kv_producer", False)):
        got = sender_for(parse_connector_config(role, 14579, "recompute", {
            "proxy_ip": "127.0.0.1", "proxy_port": 30001, "http_port": 8100, "send_type": "GET"}))
        assert got is not None and got.message.pulls is pulls
        assert parse_announcement(got.beat(), b"").pulls is pulls
    assert sender_for(parse_connector_config("kv_producer", 1, "fail", {})) is None
    assert advertised_host("10.1.2.3", "127.0.0.1") == "10.1.2.3"
    with pytest.raises(ConfigError, match="http_port"):
        parse_connector_config("kv_producer", 1, "fail", {"proxy_ip": "h", "proxy_port": 1})


def test_legacy_heartbeats_reach_an_old_proxy_and_ours() -> None:
    """`heartbeat_format: legacy`: the old connector's msgpack map, sent to a ZMQ ROUTER as its proxy read them
    (one frame after the sender's identity), and listed by p2pkv's proxy (without a secret) as an old-format
    instance."""
    config = parse_connector_config("kv_producer", 14579, "recompute", {
        "proxy_ip": "127.0.0.1", "proxy_port": free_port(), "http_port": 8100, "kv_host": "127.0.0.1",
        "heartbeat_interval_s": 0.2, "heartbeat_format": "legacy"})
    with serve(stub_decode([])) as d:
        http = Address.parse(d)
        ctx = zmq.Context.instance()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        sender = HeartbeatSender(Address("127.0.0.1", port), "prefill", http, Address("127.0.0.1", 21001), 0.2,
                                 b"", legacy=True)
        sender.start()
        try:
            assert router.poll(5000), "no heartbeat"
            _identity, message = router.recv_multipart()
            assert msgspec.msgpack.decode(message) == {"type": "P", "http_address": d, "zmq_address": "127.0.0.1:21001"}
        finally:
            sender.close()
            router.close()
        with discovering_proxy() as (proxy, _, discovery):
            sender = HeartbeatSender(Address("127.0.0.1", discovery), "decode", http, Address("127.0.0.1", 5558), 0.2,
                                     b"", legacy=True)
            sender.start()
            try:
                wait_for(lambda: len(listed(proxy)) == 1)
                (only,) = listed(proxy)
                assert (only["role"], only["address"], only["kv_address"]) == ("decode", d, "127.0.0.1:5558")
            finally:
                sender.close()
    from_config = sender_for(config)
    assert from_config is not None and msgspec.msgpack.decode(from_config._legacy) == {
        "type": "P", "http_address": "127.0.0.1:8100", "zmq_address": "127.0.0.1:14579"}
    with pytest.raises(ConfigError, match="kv_both"):
        parse_connector_config("kv_both", 1, "fail", {"heartbeat_format": "legacy"})
    with pytest.raises(ConfigError, match="heartbeat_format"):
        parse_connector_config("kv_producer", 1, "fail", {"heartbeat_format": "v0"})


def test_an_instance_announces_itself_to_every_proxy_listed() -> None:
    """Proxies side by side (for availability): `proxy_ip` lists them, and each hears every heartbeat."""
    config = parse_connector_config("kv_consumer", 14579, "recompute", {
        "proxy_ip": "10.0.0.9, 10.0.0.10:31000,[::1]:32000", "proxy_port": 30001, "http_port": 8100})
    assert config.extra.proxies == [Address("10.0.0.9", 30001), Address("10.0.0.10", 31000), Address("::1", 32000)]
    for bad, error in (("10.0.0.9,,10.0.0.10", "empty address"), ("h:99999", "proxy_ip"), ("[::1]", "proxy_ip")):
        with pytest.raises(ConfigError, match=error):
            parse_connector_config("kv_consumer", 1, "fail", {"proxy_ip": bad, "proxy_port": 30001,
                                                               "http_port": 8100})
    with serve(stub_decode([])) as d, discovering_proxy() as (one, _, p1), discovering_proxy() as (two, _, p2):
        sender = HeartbeatSender([Address("127.0.0.1", p1), Address("127.0.0.1", p2)], "decode", Address.parse(d),
                                 Address("127.0.0.1", 5559), 0.2, b"")
        sender.start()
        try:
            wait_for(lambda: len(listed(one)) == 1 and len(listed(two)) == 1)
        finally:
            sender.close()
    from_config = sender_for(parse_connector_config("kv_producer", 1, "fail", {
        "proxy_ip": "127.0.0.1,127.0.0.2:40000", "proxy_port": 30001, "http_port": 8100}))
    assert from_config is not None and from_config.proxies == (Address("127.0.0.1", 30001),
                                                               Address("127.0.0.2", 40000))


def test_a_heartbeat_says_the_latest_refusals_with_their_age_within_the_size_bound() -> None:
    sender = HeartbeatSender(Address("127.0.0.1", 1), "decode", Address("h", 2), Address("h", 3), 1.0, SECRET)
    assert parse_announcement(sender.beat(), SECRET).refused == ()
    now = time.monotonic()
    notes = {f"host-{i:02d}.cluster.example.internal:{40000 + i}": Refusal("é" * 400, now - i) for i in range(20)}
    sender.note_refusals(notes)
    raw = sender.beat()
    assert len(raw) <= MAX_ANNOUNCEMENT_BYTES
    said = parse_announcement(raw, SECRET).refused
    assert [str(address) for address, *_ in said] == [f"host-{i:02d}.cluster.example.internal:{40000 + i}"
                                                      for i in range(MAX_REFUSED)]  # the latest first
    assert all(reason == "é" * (MAX_REASON_BYTES // 2) for _, reason, *_ in said)  # cut whole characters
    assert [round(age) for _, _, age, _ in said] == list(range(MAX_REFUSED))
    sender.note_refusals({"gone:1": Refusal("dtype", now - MAX_REFUSAL_AGE_S - 1), "here:1": Refusal("dtype", now)})
    assert [str(a) for a, *_ in parse_announcement(sender.beat(), SECRET).refused] == ["here:1"]  # not the old


def test_a_heartbeat_names_the_start_each_refusal_was_of_and_a_malformed_one_is_refused() -> None:
    """The refused hello's launch goes with each refusal (with 20 refusals of the longest reasons and launches the
    beat still fits the bound); a proxy's reader of three fields reads the beat; a launch that is not 16 hex digits
    is refused as any malformed field."""
    sender = HeartbeatSender(Address("127.0.0.1", 1), "decode", Address("h", 2), Address("h", 3), 1.0, SECRET)
    now = time.monotonic()
    sender.note_refusals({f"host-{i:02d}.cluster.example.internal:{40000 + i}": Refusal("é" * 400, now - i,
                                                                                      f"{i:016x}") for i in range(20)})
    raw = sender.beat()
    assert len(raw) <= MAX_ANNOUNCEMENT_BYTES
    assert [launch for *_, launch in parse_announcement(raw, SECRET).refused] == [f"{i:016x}" for i in range(8)]
    sender.note_refusals({"here:1": Refusal("dtype", now), "there:1": Refusal("dtype", now - 1, "ab" * 8)})
    assert [(str(a), launch) for a, *_, launch in parse_announcement(sender.beat(), SECRET).refused] == [
        ("here:1", ""), ("there:1", "ab" * 8)]

    class ThreeFields(msgspec.Struct, frozen=True, array_like=True):  # PeerRefused as a reader before launches
        address: str
        reason: str
        age_s: float

    beat = Heartbeat("decode", "h:2", "h:3", 1.0, refused=(PeerRefused("there:1", "dtype", 1.0, "ab" * 8),))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(beat.refused[0]), type=ThreeFields).address == "there:1"
    for bad in ("AB" * 8, "ab" * 7, "ab" * 9, "zz" * 8):
        malformed = msgspec.structs.replace(beat, refused=(PeerRefused("there:1", "dtype", 1.0, bad),))
        with pytest.raises(ProtocolError, match="refusal launch"):
            parse_announcement(encode_datagram(malformed, SECRET), SECRET)


def test_instances_that_refused_each_other_are_not_paired_until_the_refusal_is_old() -> None:
    """The decode instance's heartbeat says it refused rank 1 of prefill instance p1 (TP 2): requests are prefilled
    on p2 only. Then p2's heartbeat says it refused the decode instance (GET): no prefill instance is left, and the
    decode instance gets the requests alone. Refusals said to be 59.5 s old lapse half a second later: p1 prefills
    again; and at once when it restarts after a refusal."""
    p1_seen: list[dict[str, Any]] = []
    p2_seen: list[dict[str, Any]] = []
    d_seen: list[dict[str, Any]] = []
    p1_kv, p2_kv, d_kv = Address("127.0.0.1", 7100), Address("127.0.0.1", 7200), Address("127.0.0.1", 7300)

    def beat(role: str, http: str, kv: Address, refused: tuple[PeerRefused, ...] = (), engine: str = "e",
             interval_s: float = 3.0) -> bytes:
        return encode_datagram(Heartbeat(role, http, str(kv), interval_s, engine, 2, 1, refused=refused), b"")

    def ask(n: int) -> None:
        for _ in range(n):
            resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x", "max_tokens": 3})
            assert resp.status_code == 200, resp.text

    with serve(stub_prefill(p1_seen)) as p1, serve(stub_prefill(p2_seen)) as p2, serve(stub_decode(d_seen)) as d, \
            discovering_proxy() as (proxy, send, _):
        dtype = PeerRefused(str(p1_kv.offset(1)), "KV layout mismatch: dtype: ours float32, peer bfloat16", 0.0)
        send(beat("prefill", p1, p1_kv))
        send(beat("prefill", p2, p2_kv))
        send(beat("decode", d, d_kv, (dtype,)))
        wait_for(lambda: any(i["refused"] for i in listed(proxy)) and len(listed(proxy)) == 3)
        ask(4)
        assert (len(p1_seen), len(p2_seen)) == (0, 4)
        assert all("kv_transfer_params" in seen for seen in d_seen)
        decode = next(i for i in listed(proxy) if i["role"] == "decode")
        assert decode["refused"][0]["address"] == "127.0.0.1:7101" and "dtype" in decode["refused"][0]["reason"]
        assert metric(proxy, "p2pkv_proxy_pairs_passed_over_total") == 4
        assert metric(proxy, "p2pkv_proxy_unpaired") == 1
        send(beat("prefill", p2, p2_kv, (PeerRefused(str(d_kv), "KV layout mismatch: model.sliding_window", 0.0),)))
        wait_for(lambda: any(i["refused"] for i in listed(proxy) if i["address"] == p2))
        d_seen.clear()
        ask(2)
        assert (len(p1_seen), len(p2_seen)) == (0, 4)
        assert [seen.get("kv_transfer_params") for seen in d_seen] == [None, None]  # computed there
        assert metric(proxy, "p2pkv_proxy_decode_only_fallbacks_total") == 2
        assert metric(proxy, "p2pkv_proxy_unpaired") == 2  # the decode instance with either prefill instance
        send(beat("decode", d, d_kv, (msgspec.structs.replace(dtype, age_s=59.5),)))
        send(beat("prefill", p2, p2_kv))
        time.sleep(1.0)
        ask(2)
        assert len(p1_seen) >= 1, "the lapsed refusal pairs p1 again"
        # Refused afresh, p1 is passed over again; restarted (another engine id), it is paired again at once.
        send(beat("decode", d, d_kv, (dtype,)))
        wait_for(lambda: any(r["paired_again_in_s"] > 50 for i in listed(proxy) for r in i["refused"]))
        before = len(p1_seen)
        ask(2)
        assert len(p1_seen) == before
        send(beat("prefill", p1, p1_kv, interval_s=0.1))  # its last heartbeat; it restarts
        wait_for(lambda: p1 not in [i["address"] for i in listed(proxy)])
        send(beat("prefill", p1, p1_kv, engine="e2"))
        time.sleep(0.5)
        ask(2)
        assert len(p1_seen) > before, "refusals from before its restart no longer count"


def test_the_decode_instances_start_goes_to_the_prefill_instance_with_each_request() -> None:
    """A decode instance's heartbeats say its start (`launch`); the proxy lists it and names it in each prefill
    request for that decode instance (`decode_launch`), so that a prefill worker that refused an earlier start of it
    still holds the KV for it (GET). A restart's heartbeats name the new start, and the next request carries it."""
    p_seen: list[dict[str, Any]] = []
    p_kv, d_kv = Address("127.0.0.1", 7400), Address("127.0.0.1", 7500)
    with serve(stub_prefill(p_seen)) as p, serve(stub_decode([])) as d, discovering_proxy() as (proxy, send, _):
        for launch in ("0123456789abcdef", "fedcba9876543210"):
            send(encode_datagram(Heartbeat("prefill", p, str(p_kv), 3.0, "p"), b""))
            # The first start stops beating after one (0.2 s) interval: the restart's are taken once it expired.
            wait_for(lambda: d not in [i["address"] for i in listed(proxy)])
            send(encode_datagram(Heartbeat("decode", d, str(d_kv), 0.2 if launch[0] == "0" else 3.0, f"d-{launch}",
                                           1, 1, pulls=True, launch=launch), b""))
            wait_for(lambda: [i["launch"] for i in listed(proxy) if i["role"] == "decode"] == [launch])  # noqa: B023
            resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert resp.status_code == 200, resp.text
            params = p_seen[-1]["body"]["kv_transfer_params"]
            assert params["decode_launch"] == launch and params["send_type"] == "GET", params
        assert [i["launch"] for i in listed(proxy) if i["role"] == "prefill"] == [None]  # its heartbeats said none
