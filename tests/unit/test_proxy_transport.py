"""The proxy's HTTP transport (httpx's client over aiohttp): what goes out and comes back is what was sent, and each
way an upstream can fail comes out as the httpx exception the proxy's routing tells apart. Real sockets: stub
backends over real HTTP, and raw socket servers for the faults."""

from __future__ import annotations

import asyncio
import gzip
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import aiohttp
import httpx
import pytest

from p2pkv.proxy.transport import upstream_client
from tests.helpers.servers import serve
from tests.helpers.unit import proxy_for

T = TypeVar("T")


def run_client(use: Callable[[httpx.AsyncClient], Awaitable[T]], read_timeout_s: float = 5.0) -> T:
    """`use` run with the proxy's client (`upstream_client`), its read deadline `read_timeout_s`."""
    async def main() -> T:
        async with upstream_client(read_timeout_s, 5.0) as client:
            return await use(client)

    return asyncio.run(main())


@contextmanager
def raw_server(answer: Callable[[socket.socket], None]) -> Iterator[str]:
    """A loopback TCP server that hands its connections in turn to `answer`, on the server's one thread, for faults
    no HTTP server makes on purpose."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                answer(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def read_request(conn: socket.socket) -> bytes:
    """A request's head (what came up to its blank line), read within 5 s."""
    conn.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def echo_app() -> Any:
    """An ASGI app answering with what it was sent (method, raw path, query, headers, body; the client's port in a
    header), a gzip'd body at /gzip, and a long body at /long."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/gzip":
            payload, headers = gzip.compress(b"squeezed"), [(b"content-encoding", b"gzip")]
        elif scope["path"] == "/long":
            payload, headers = b"x" * (4 << 20), []
        else:
            seen = b"\n".join(k + b": " + v for k, v in scope["headers"])
            payload = b"%s %s?%s\n%s\n\n%s" % (scope["method"].encode(), scope["raw_path"],
                                                scope["query_string"], seen, body)
            headers = [(b"x-client-port", str(scope["client"][1]).encode())]
            headers += [(b"x-twice", b"one"), (b"x-twice", b"two"), (b"set-cookie", b"session=1")]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    return app


def test_requests_and_answers_pass_through_unchanged() -> None:
    with serve(echo_app()) as backend:
        async def use(client: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response, httpx.Response]:
            echoed = await client.post(f"http://{backend}/v1/x%2Fy", params={"a": "1", "q": "a+b/c%d é"},
                                       content=b"\x00body\xff",
                                       headers=[("x-one", "1"), ("x-many", "a"), ("x-many", "b")])
            squeezed = await client.get(f"http://{backend}/gzip")
            again = await client.post(f"http://{backend}/v1/x", json={"k": "v"})
            return echoed, squeezed, again

        echoed, squeezed, again = run_client(use)
    assert echoed.status_code == 201
    head, _, body = echoed.content.partition(b"\n\n")
    assert body == b"\x00body\xff"
    assert head.startswith(b"POST /v1/x%2Fy?" + echoed.request.url.query + b"\n")  # as httpx encoded it
    assert echoed.request.url.query == b"a=1&q=a%2Bb%2Fc%25d+%C3%A9"
    assert b"x-one: 1" in head and b"x-many: a" in head and b"x-many: b" in head
    assert b"content-length: 6" in head and b"transfer-encoding" not in head
    assert echoed.headers.get_list("x-twice") == ["one", "two"]
    assert squeezed.text == "squeezed"  # gzip'd on the wire, decoded by httpx as with its own transport
    assert again.content.endswith(b'{"k":"v"}') and b"content-type: application/json" in again.content
    assert b"session=1" not in again.content  # a backend's cookie is not sent back on the next request


def test_instances_are_reached_directly_whatever_the_environment_names_as_proxy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        nowhere = taken.getsockname()[1]
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{nowhere}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with serve(echo_app()) as backend:
        answer = run_client(lambda client: client.get(f"http://{backend}/direct"))
    assert answer.status_code == 201 and answer.content.startswith(b"GET /direct?")


def test_a_refused_connection_is_a_connect_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
    with pytest.raises(httpx.ConnectError):
        run_client(lambda client: client.get(f"http://127.0.0.1:{port}/"))


def reset_while_connecting(req: Any) -> aiohttp.ClientConnectorError:
    """What aiohttp raises for a connection reset as it was set up (an instance killed under load)."""
    return aiohttp.ClientConnectorError(req.connection_key, ConnectionResetError(104, "connection reset by peer"))


def test_a_socket_fault_while_connecting_is_a_connect_error(monkeypatch: pytest.MonkeyPatch) -> None:
    async def dies_while_connecting(connector: aiohttp.TCPConnector, req: Any, *args: Any, **kwargs: Any) -> Any:
        raise reset_while_connecting(req)

    monkeypatch.setattr(aiohttp.TCPConnector, "connect", dies_while_connecting)
    with serve(echo_app()) as backend, pytest.raises(httpx.ConnectError):
        run_client(lambda client: client.get(f"http://{backend}/"))


def test_a_peer_that_closes_before_answering_is_a_protocol_error() -> None:
    with raw_server(lambda conn: read_request(conn)) as backend, pytest.raises(httpx.RemoteProtocolError):
        run_client(lambda client: client.post(f"http://{backend}/v1/completions", json={}))


def test_a_peer_that_never_answers_is_a_read_timeout() -> None:
    release = threading.Event()

    def silent(conn: socket.socket) -> None:
        read_request(conn)
        release.wait(10)

    with raw_server(silent) as backend:
        try:
            with pytest.raises(httpx.ReadTimeout):
                run_client(lambda client: client.get(f"http://{backend}/"), read_timeout_s=0.3)
        finally:
            release.set()


def test_a_body_cut_short_is_a_protocol_error_when_read() -> None:
    def short(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")

    with raw_server(short) as backend:
        async def use(client: httpx.AsyncClient) -> None:
            async with client.stream("GET", f"http://{backend}/") as resp:
                assert resp.status_code == 200
                await resp.aread()

        with pytest.raises(httpx.RemoteProtocolError):
            run_client(use)


def test_a_connection_is_reused_after_a_whole_answer_and_not_after_one_closed_half_read() -> None:
    with serve(echo_app()) as backend:
        async def use(client: httpx.AsyncClient) -> list[httpx.Response]:
            answers = [await client.post(f"http://{backend}/one"), await client.post(f"http://{backend}/two")]
            async with client.stream("GET", f"http://{backend}/long") as resp:
                async for _ in resp.aiter_raw():
                    break  # the rest of the 4 MiB is still on its way
            answers.append(await client.post(f"http://{backend}/next", content=b"after"))
            return answers

        one, two, after = run_client(use)
    assert after.content.startswith(b"POST /next?") and after.content.endswith(b"\n\nafter")
    ports = [a.headers["x-client-port"] for a in (one, two, after)]
    assert ports[0] == ports[1] != ports[2]


def test_a_socket_fault_while_connecting_to_a_prefill_instance_is_that_instance_failing(
        backends: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    p, d, p_seen, d_seen = backends
    port = int(p.rsplit(":", 1)[1])
    real = aiohttp.TCPConnector.connect

    async def dies_while_connecting(connector: aiohttp.TCPConnector, req: Any, *args: Any, **kwargs: Any) -> Any:
        if req.url.port == port:  # a socket that failed as it was set up: the instance was killed under load
            raise reset_while_connecting(req)
        return await real(connector, req, *args, **kwargs)

    monkeypatch.setattr(aiohttp.TCPConnector, "connect", dies_while_connecting)
    with serve(proxy_for(p, d)) as proxy:
        resp = httpx.post(f"http://{proxy}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
        metrics = httpx.get(f"http://{proxy}/metrics").text
    assert resp.status_code == 200, resp.text
    assert not p_seen and len(d_seen) == 1 and "kv_transfer_params" not in d_seen[0]
    assert "p2pkv_proxy_decode_only_fallbacks_total 1.0" in metrics
