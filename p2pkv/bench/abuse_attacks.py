"""The attacks of `p2pkv bench abuse`, each bounded in count and time; each says whether the target answered it as
it must (`Verdict`). They come from the bench's own process, with nothing but sockets and the public wire formats."""

from __future__ import annotations

import contextlib
import os
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.queues import Queue

import httpx
import msgspec
import zmq

from p2pkv import PROTOCOL_VERSION
from p2pkv.bench.abuse_peer import BLOCK_BYTES, BLOCKS, LAYERS, engine, layout
from p2pkv.engine.handshake import client_handshake
from p2pkv.params import Address
from p2pkv.protocol import (
    MAGIC,
    PREFIX_BYTES,
    FrameLimits,
    Heartbeat,
    Hello,
    HelloReply,
    PullInstead,
    PushAbort,
    decode_message,
    decode_prefix,
    encode_datagram,
    encode_frame,
)
from p2pkv.transport.tcp import TcpConnection

CLOSED_WITHIN_S = 5.0  # an engine that refuses a connection closes it at once; this is the most it may take


@dataclass(frozen=True)
class Verdict:
    ok: bool
    what: str


@dataclass
class Target:
    """What the attacks aim at: the proxy (its client key, admin key, discovery port) and the attacked engine."""

    proxy_url: str
    discovery: str
    client_key: str
    admin_key: str
    kv_address: str
    secret: str
    max_connections: int
    body_timeout_s: float
    transfer_ids: Queue[str]
    landed: Queue[str | None]  # transfers for the attacked engine to take, as a decode worker would

    def admin(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.admin_key}"}

    def client(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.client_key}"}

    def listed(self) -> int:
        answer = httpx.get(f"{self.proxy_url}/instances", headers=self.admin(), timeout=10)
        answer.raise_for_status()
        return len(answer.json()["instances"])


Attack = Callable[[Target], Verdict]


# -- the proxy --

def forged_heartbeats(target: Target) -> Verdict:
    """5,000 unsigned heartbeats, each a new decode instance, and 200 in the old connector's format."""
    before = target.listed()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100000)
    try:
        sock.connect(f"tcp://{target.discovery}")
        for i in range(5000):
            port = 20000 + i
            sock.send(encode_datagram(Heartbeat("decode", f"127.0.0.1:{port}", f"127.0.0.1:{port}", 3.0,
                                                f"forged{i}"), b""))
        for i in range(200):
            sock.send(msgspec.msgpack.encode({"type": "D", "http_address": f"127.0.0.1:{40000 + i}",
                                              "zmq_address": f"127.0.0.1:{40000 + i}"}))
        time.sleep(1.0)
    finally:
        sock.close()
        ctx.term()
    after = target.listed()
    return Verdict(after == before, f"instances listed {before} -> {after}")


def admin_routes(target: Target) -> Verdict:
    """The admin routes with no key and with the client key: none may pause or reach the instances."""
    seen = []
    with httpx.Client(base_url=target.proxy_url, timeout=10) as client:
        for headers in ({}, target.client()):
            seen.append(client.post("/pause", headers=headers).status_code)
            seen.append(client.post("/collective_rpc", headers=headers,
                                    json={"method": "reload_weights", "kwargs": {"path": "/tmp/attacker"}}
                                    ).status_code)
            seen.append(client.get("/instances", headers=headers).status_code)
            seen.append(client.get("/metrics", headers=headers).status_code)
        paused = client.get("/is_paused", headers=target.admin()).json().get("is_paused")
    refused = all(code in (401, 403) for code in seen)
    return Verdict(refused and paused is False, f"answers {sorted(set(seen))}, paused afterwards: {paused}")


def _huge_body(nbytes: int) -> Iterator[bytes]:
    chunk = b" " * (1 << 20)
    yield b'{"model": "stub", "prompt": "'
    for _ in range(nbytes >> 20):
        yield chunk
    yield b'"}'


def huge_bodies(target: Target) -> Verdict:
    """Four 100 MB bodies at once, sent chunked (no length said up front)."""
    codes: list[int | str] = []

    def one() -> None:
        try:
            answer = httpx.post(f"{target.proxy_url}/v1/completions", content=_huge_body(100 << 20),
                                headers=target.client(), timeout=30)
            codes.append(answer.status_code)
        except httpx.HTTPError as exc:  # the proxy may close the connection once it has answered 413
            codes.append(type(exc).__name__)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    ok = all(code in (413, "RemoteProtocolError", "WriteError", "ReadError") for code in codes) and 413 in codes
    return Verdict(ok, f"answers {codes}")


def many_prompts(target: Target) -> Verdict:
    """One request of 2,000 prompts."""
    answer = httpx.post(f"{target.proxy_url}/v1/completions", headers=target.client(), timeout=30,
                        json={"model": "stub", "prompt": [f"p{i}" for i in range(2000)], "max_tokens": 1})
    return Verdict(answer.status_code == 400, f"answer {answer.status_code}, {len(str(answer.headers))} B of headers")


def deep_json(target: Target) -> Verdict:
    """A body nested 5,000 deep."""
    body = b'{"model": "stub", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    answer = httpx.post(f"{target.proxy_url}/v1/completions", headers={**target.client(),
                        "content-type": "application/json"}, content=body, timeout=30)
    return Verdict(answer.status_code == 400, f"answer {answer.status_code}")


def slow_clients(target: Target) -> Verdict:
    """300 clients that send their headers and then one body byte a second."""
    host, _, port = target.proxy_url.removeprefix("http://").rpartition(":")
    socks = []
    for _ in range(300):
        sock = socket.create_connection((host, int(port)), timeout=5)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"authorization: Bearer " + target.client_key.encode() + b"\r\ncontent-length: 1000\r\n\r\n")
        socks.append(sock)
    deadline = time.monotonic() + target.body_timeout_s + 5
    open_socks = list(socks)
    try:
        while open_socks and time.monotonic() < deadline:
            for sock in list(open_socks):
                try:
                    sock.send(b" ")
                except OSError:
                    open_socks.remove(sock)
                    continue
                readable, _, _ = select.select([sock], [], [], 0)
                if readable:  # an answer (408) or the close: either way the proxy let go of it
                    open_socks.remove(sock)
            time.sleep(1.0)
    finally:
        for sock in socks:
            sock.close()
    return Verdict(not open_socks, f"{len(socks) - len(open_socks)} of {len(socks)} let go within "
                                   f"{target.body_timeout_s + 5:.0f} s")


# -- the engine --

def _closed(sock: socket.socket, within_s: float) -> bytes | None:
    """What the peer sent before it closed `sock`; None if it was still open after `within_s`."""
    got = b""
    deadline = time.monotonic() + within_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            return None
        try:
            data = sock.recv(65536)
        except OSError:
            return got
        if not data:
            return got
        got += data


def _kv_socket(target: Target) -> socket.socket:
    address = Address.parse(target.kv_address)
    return socket.create_connection((address.host, address.port), timeout=5)


def garbage(target: Target) -> Verdict:
    """50 connections of random bytes, 50 frames claiming 4 GiB, 50 hellos signed with another secret."""
    frames = [os.urandom(4096) for _ in range(50)]
    frames += [struct.pack("!4sHHIQ", MAGIC, PROTOCOL_VERSION, 0, 0xFFFFFFFF, 4 << 30) + bytes(32)
               for _ in range(50)]
    frames += [encode_frame(Hello(f"intruder{i}", 0, layout()), 0, b"wrong secret") for i in range(50)]
    still_open = 0
    for frame in frames:
        with _kv_socket(target) as sock:
            sock.sendall(frame)
            if _closed(sock, CLOSED_WITHIN_S) is None:
                still_open += 1
    return Verdict(not still_open, f"{len(frames) - still_open} of {len(frames)} closed by the engine")


class _Recorder:
    """A relay in front of the attacked engine that keeps what the first client sent: what an eavesdropper on the
    network between two engines holds."""

    def __init__(self, target: str) -> None:
        self._target = Address.parse(target)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.sent = bytearray()
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        self._listener.settimeout(30)
        with contextlib.suppress(OSError):
            client, _ = self._listener.accept()
            server = socket.create_connection((self._target.host, self._target.port), timeout=30)
            with client, server:
                pair = {client: server, server: client}
                while True:
                    readable, _, _ = select.select(list(pair), [], [], 30)
                    if not readable:
                        return
                    for sock in readable:
                        data = sock.recv(1 << 20)
                        if not data:
                            return
                        if sock is client:
                            self.sent += data
                        pair[sock].sendall(data)

    def close(self) -> None:
        self._listener.close()
        self._thread.join(35)


def replayed_stream(target: Target) -> Verdict:
    """A recorded connection of a real engine (its hello and a pushed transfer) played again to the engine."""
    recorder = _Recorder(target.kv_address)
    sender = engine(target.secret)
    try:
        data = bytes(LAYERS * BLOCKS * BLOCK_BYTES)
        views = [(memoryview(data)[i * BLOCKS * BLOCK_BYTES:(i + 1) * BLOCKS * BLOCK_BYTES],) for i in range(LAYERS)]
        sender.push_layers("recorded-1", Address.parse(recorder.address), 0, BLOCKS, views, time.monotonic() + 10)
        sender.wait_outgoing("recorded-1", 10)
        target.landed.put("recorded-1")
    finally:
        sender.close()
        recorder.close()
    with _kv_socket(target) as sock:
        sock.sendall(bytes(recorder.sent))
        answer = _closed(sock, CLOSED_WITHIN_S)
    accepted = answer is not None and _accepted_hello(answer, target.secret.encode())
    return Verdict(answer is not None and not accepted,
                   f"{len(recorder.sent)} recorded bytes replayed: "
                   f"{'accepted' if accepted else 'refused' if answer is not None else 'left open'}")


def _accepted_hello(answer: bytes, secret: bytes) -> bool:
    if len(answer) < PREFIX_BYTES:
        return False
    try:
        prefix = decode_prefix(answer[:PREFIX_BYTES], FrameLimits())
        reply = decode_message(answer[:PREFIX_BYTES], prefix, answer[PREFIX_BYTES:PREFIX_BYTES + prefix.message_len],
                               secret)
    except Exception:  # anything that is not an accepting reply signed as a hello's is a refusal
        return False
    return isinstance(reply, HelloReply) and reply.accepted


def connection_flood(target: Target) -> Verdict:
    """`max_connections` + 64 connections that never say hello."""
    socks = [_kv_socket(target) for _ in range(target.max_connections + 64)]
    try:
        time.sleep(0.5)
        at_once = sum(1 for sock in socks if select.select([sock], [], [], 0)[0])
        left_open = sum(1 for sock in socks if _closed(sock, 15.0) is None)
    finally:
        for sock in socks:
            sock.close()
    return Verdict(at_once >= 64 and not left_open,
                   f"{at_once} closed at once, {len(socks) - left_open} of {len(socks)} closed within 15 s")


def hijack(target: Target) -> Verdict:
    """A peer that holds the secret names the good sender's transfer ids: PullInstead and PushAbort for each."""
    conn = TcpConnection.connect(Address.parse(target.kv_address), time.monotonic() + 5, target.secret.encode(),
                                 FrameLimits())
    deadline = time.monotonic() + 5
    conn = client_handshake(conn, Hello("hijacker", 0, layout()), deadline)  # type: ignore[assignment]
    named = 0
    try:
        end = time.monotonic() + 3
        while time.monotonic() < end:
            try:
                tid = target.transfer_ids.get(timeout=0.5)
            except queue.Empty:
                continue
            conn.send_frames([(PullInstead(tid), ()), (PushAbort(tid, "hijacked"), ())], time.monotonic() + 5)
            named += 1
    finally:
        conn.close()
    return Verdict(named > 0, f"named {named} transfers of another connection (lost ones show below)")


def drain(ids: Queue[str]) -> None:
    with contextlib.suppress(queue.Empty):
        while True:
            ids.get_nowait()


ATTACKS: tuple[tuple[str, Attack], ...] = (
    ("forged heartbeats (5,200)", forged_heartbeats),
    ("admin routes, no or client key", admin_routes),
    ("four 100 MB bodies", huge_bodies),
    ("2,000 prompts in a request", many_prompts),
    ("JSON 5,000 deep", deep_json),
    ("300 slow clients", slow_clients),
    ("KV port: garbage, 4 GiB, wrong secret", garbage),
    ("KV port: a recorded stream replayed", replayed_stream),
    ("KV port: connection flood", connection_flood),
    ("KV port: another's transfer ids", hijack),
)
