"""Helpers the unit tests share: stub proxies and their metrics and log lines, CPU caches in each physical order,
the scheduler side's fake requests and steps."""

from __future__ import annotations

import json
import math
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from p2pkv.bench.cluster import free_port
from p2pkv.proxy import Instance, ProxyConfig, create_app
from tests.helpers.servers import serve
from tests.helpers.stubs import stub_decode, stub_prefill

BS = 128


@dataclass(eq=False)
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    status: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(name="WAITING"))

    def set_status(self, name: str) -> None:
        self.status = SimpleNamespace(name=name)


@dataclass
class Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def step(new: list[SimpleNamespace] = (), cached: Cached | None = None,
         scheduled: dict[str, int] | None = None) -> SimpleNamespace:
    scheduled = scheduled or {}
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached or Cached(),
                           num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()))


def metric(proxy: str, name: str) -> float:
    for line in httpx.get(f"http://{proxy}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def request_lines(caplog: pytest.LogCaptureFixture, transfer_id: str, timeout_s: float = 5.0) -> list[str]:
    """The proxy's log lines for this transfer (a stream's is logged as it ends, just after the client read it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [r.getMessage() for r in caplog.records
                 if r.name == "p2pkv.proxy.requests" and f"transfer={transfer_id} " in r.getMessage()]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


class Setup:
    """Stub prefill and decode instances (decode i fails as `failures[i]` says) behind one proxy."""

    def __init__(self, stack: ExitStack, prefills: int, failures: list[list[str]], dead: tuple[str, ...] = (),
                 **options: Any) -> None:
        """`dead`: decode instances listed first, where nothing listens."""
        self.p_seen: list[list[dict[str, Any]]] = [[] for _ in range(prefills)]
        self.d_seen: list[list[dict[str, Any]]] = [[] for _ in failures]
        self.prefill = [stack.enter_context(serve(stub_prefill(seen))) for seen in self.p_seen]
        self.decode = [*dead, *(stack.enter_context(serve(stub_decode(seen, failures=f)))
                                for seen, f in zip(self.d_seen, failures, strict=True))]
        app: FastAPI = create_app(ProxyConfig(prefill=tuple(Instance.parse(p) for p in self.prefill),
                                              decode=tuple(Instance.parse(d) for d in self.decode), **options))
        self.proxy = stack.enter_context(serve(app))

    def post(self, stream: bool = False, chat: bool = False) -> tuple[int, dict[str, str], str]:
        body: dict[str, Any] = {"model": "tiny", "max_tokens": 3, "stream": stream}
        body.update({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})
        path = "/v1/chat/completions" if chat else "/v1/completions"
        with httpx.stream("POST", f"http://{self.proxy}{path}", json=body, timeout=30) as resp:
            return resp.status_code, dict(resp.headers), resp.read().decode()

    def metric(self, name: str) -> float:
        for line in httpx.get(f"http://{self.proxy}/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def prefilled(self, i: int) -> list[str]:
        return [s["body"]["kv_transfer_params"]["transfer_id"] for s in self.p_seen[i]]

    def decoded(self, i: int) -> list[str | None]:
        return [(b.get("kv_transfer_params") or {}).get("transfer_id") for b in self.d_seen[i]]


def proxy_for(prefill: str, decode: str) -> FastAPI:
    return create_app(ProxyConfig(prefill=(Instance.parse(prefill),), decode=(Instance.parse(decode),)))


def stub_prefill_status(status: int, seen: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def complete(request: Request) -> JSONResponse:
        seen.append(await request.json())
        return JSONResponse({"error": {"message": f"status {status}"}}, status_code=status)

    return app


def proxy_with(prefill: list[str], decode: str, **options: Any) -> FastAPI:
    return create_app(ProxyConfig(prefill=tuple(Instance.parse(p) for p in prefill),
                                  decode=(Instance.parse(decode),), **options))


class DropsFirstRequest:
    """A decode backend on a raw socket: the first completion request's connection is closed right after the
    request is read, without an answer (as a server closing an idle keep-alive connection while the request goes
    out); other requests (the proxy's KV-address probe too) are answered. `after_headers`: the first one gets the
    headers of an event stream, then the connection closes before any event."""

    ANSWER = {"choices": [{"text": "abc"}]}
    PROBE = {"choices": [{"text": ""}], "kv_transfer_params": {"p2pkv": 1, "kv_port": 23456, "kv_host": ""}}

    def __init__(self, after_headers: bool = False, reset: bool = False) -> None:
        """`reset`: the first request's connection is reset (RST), not closed."""
        self.after_headers = after_headers
        self.reset = reset
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _read_body(conn: socket.socket) -> bytes | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length")), 0)
        while len(body) < length:
            body += conn.recv(65536)
        return body

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                body = self._read_body(conn)
                if body is None:
                    continue
                sent = json.loads(body) if body else {}  # GET /v1/models has none
                probe = bool((sent.get("kv_transfer_params") or {}).get("probe"))
                if body and not probe:
                    self.requests += 1
                    if self.requests == 1:
                        if self.after_headers:
                            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                         b"Transfer-Encoding: chunked\r\n\r\n")
                        if self.reset:
                            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        continue  # closed (or reset) without an answer (or any event)
                reply = self.ANSWER if body and not probe else self.PROBE if probe else {"data": [{"id": "tiny"}]}
                answer = json.dumps(reply).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             + f"Content-Length: {len(answer)}\r\n\r\n".encode() + answer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.server.close()


PHYSICAL_ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def views(order: str, dtype: torch.dtype, sizes: dict[str, int], fill: bool) -> list[torch.Tensor]:
    """Per-layer logical [B, H, N, C] views of one flat buffer laid out in `order` (as vLLM's
    create_kv_cache_views does)."""
    numel = math.prod(sizes.values())
    flat = torch.randn(numel).to(dtype) if fill else torch.zeros(numel, dtype=dtype)
    stride = {}
    step = 1
    for dim in reversed(order):
        stride[dim] = step
        step *= sizes[dim]
    shape = [sizes[d] for d in "BHNC"]
    return [flat.as_strided(shape, [stride[d] for d in "BHNC"], layer * stride["L"]) for layer in range(sizes["L"])]


SIZES = {"L": 3, "B": 12, "H": 4, "N": 16, "C": 8}


def caches(order: str, fill: bool) -> list[torch.Tensor]:
    return views(order, torch.bfloat16, SIZES, fill)


@contextmanager
def discovering_proxy(secret: str = "", misses: float = 3.0, **options: Any
                      ) -> Iterator[tuple[str, Callable[[bytes], None], int]]:
    """A proxy with discovery only (no static instances; `options` for its config), a ZMQ DEALER that sends it raw
    messages, and the discovery port."""
    port = free_port()
    config = ProxyConfig(prefill=(), decode=(), discovery_port=port, secret=secret, heartbeat_misses=misses,
                         **options)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        with serve(create_app(config)) as proxy:
            sock.connect(f"tcp://127.0.0.1:{port}")
            yield proxy, lambda raw: sock.send(raw), port
    finally:
        sock.close()
        ctx.term()


def listed(proxy: str) -> list[dict[str, Any]]:
    instances: list[dict[str, Any]] = httpx.get(f"http://{proxy}/instances").json()["instances"]
    return instances


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)



@dataclass
class Cached:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    num_computed_tokens: list[int] = field(default_factory=list)
