"""Abuse of a real proxy process's HTTP port: huge, dripping and deeply nested bodies, huge batches, connection
floods. Each is refused cheaply, and good requests keep being answered."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.helpers.proxy_process import ProxyProcess, proxy_process

GOOD = {"model": "tiny", "prompt": "x", "max_tokens": 2}


def served(proxy: ProxyProcess, n: int = 5, timeout_s: float = 10.0) -> list[int]:
    return [httpx.post(f"{proxy.url}/v1/completions", json=GOOD, timeout=timeout_s).status_code for _ in range(n)]


def connect(proxy: ProxyProcess, content_length: int | None = None, chunked: bool = False) -> socket.socket:
    """A connection that has sent a completion request's headers, and no body yet."""
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {content_length}"
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{framing}\r\n\r\n"
                 .encode())
    return sock


def answer(sock: socket.socket, timeout_s: float = 5.0) -> tuple[int, bytes]:
    """The status and the rest of what the proxy sent until it closed the connection (0 if it sent nothing)."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pass  # not closed: what came is the answer
    except ConnectionResetError:
        pass
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, data


def test_bodies_over_the_cap_are_refused_without_being_buffered(tmp_path: Path, backends: Any) -> None:
    """A 100 MiB Content-Length is answered 413 before any of its body is read, four times over; a chunked body is
    answered 413 once it passes the cap, the connection closed; the proxy's memory does not grow by the bodies."""
    p, d, _, _ = backends
    with proxy_process(tmp_path, "--discovery-port", "0", "--prefill", p, "--decode", d,
                       "--max-body-mb", "1") as proxy:
        assert served(proxy) == [200] * 5
        before = proxy.rss_mb()
        for _ in range(4):
            with connect(proxy, 100 << 20) as sock:
                status, data = answer(sock)
                assert status == 413 and b"--max-body-mb" in data, data[:300]
        with connect(proxy, chunked=True) as sock:
            chunk = b"x" * (64 << 10)
            sent = 0
            try:
                while sent < (32 << 20):  # paced, so that what the proxy answers is not lost to a reset
                    sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    sent += len(chunk)
                    time.sleep(0.005)
            except OSError:
                pass  # the proxy closed the connection
            status, data = answer(sock)
            assert status == 413, data[:300]
            assert sent < (8 << 20), f"{sent} bytes sent before the proxy refused a 1 MiB cap"
        assert proxy.rss_mb() - before < 30
        assert served(proxy) == [200] * 5


def test_with_a_client_key_bodies_without_a_key_are_refused_before_they_are_read(tmp_path: Path,
                                                                                  backends: Any) -> None:
    """Clients without the key cannot have the proxy hold their bodies: a request with a body and no key is answered
    401 at its headers (a chunked body too: nothing of it is read), and the proxy's memory does not grow."""
    p, d, _, _ = backends
    key = "client-key"
    with proxy_process(tmp_path, "--discovery-port", "0", "--prefill", p, "--decode", d,
                       env={"P2PKV_PROXY_API_KEY": key}) as proxy:
        before = proxy.rss_mb()
        socks = [connect(proxy, 15 << 20) for _ in range(8)] + [connect(proxy, chunked=True) for _ in range(8)]
        try:
            for sock in socks:
                status, data = answer(sock)
                assert status == 401 and b"API key" in data, data[:300]
        finally:
            for sock in socks:
                sock.close()
        assert proxy.rss_mb() - before < 30
        good = httpx.post(f"{proxy.url}/v1/completions", json=GOOD, headers={"authorization": f"Bearer {key}"},
                          timeout=10)
        assert good.status_code == 200


def test_a_huge_batch_is_refused_and_a_large_one_has_headers_clients_can_read(tmp_path: Path,
                                                                              backends: Any) -> None:
    """2,000 prompts in one request are answered 400 at once, naming --max-prompts; 40 (under the cap) are answered
    with trace headers that name 32 prompts and count the rest."""
    p, d, _, _ = backends
    with proxy_process(tmp_path, "--discovery-port", "0", "--prefill", p, "--decode", d) as proxy:
        started = time.monotonic()
        resp = httpx.post(f"{proxy.url}/v1/completions", json={**GOOD, "prompt": [f"p{i}" for i in range(2000)]},
                          timeout=15)
        assert resp.status_code == 400 and "--max-prompts" in resp.text, resp.text[:300]
        assert time.monotonic() - started < 5
        resp = httpx.post(f"{proxy.url}/v1/completions", json={**GOOD, "prompt": [f"p{i}" for i in range(40)]},
                          timeout=30)
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 40
        transfers = resp.headers["x-p2pkv-transfer-id"].split(",")
        assert len(transfers) == 33 and transfers[-1] == "+8"
        assert sum(len(k) + len(v) for k, v in resp.headers.items()) < 8192
        assert served(proxy) == [200] * 5


def test_deeply_nested_json_is_a_bad_request_not_a_crash(tmp_path: Path, backends: Any) -> None:
    """Bodies nested 5,000 and 150 levels deep are answered 400, with no traceback in the proxy's log; a weight
    update's body nested as deep reaches no 500 either."""
    p, d, _, _ = backends
    with proxy_process(tmp_path, "--discovery-port", "0", "--prefill", p, "--decode", d) as proxy:
        for depth in (5000, 150):
            body = '{"prompt": "x", "a": ' + "[" * depth + "]" * depth + "}"
            resp = httpx.post(f"{proxy.url}/v1/completions", content=body,
                              headers={"content-type": "application/json"}, timeout=10)
            assert resp.status_code == 400, (depth, resp.status_code, resp.text[:300])
        rpc = '{"method": ' + "[" * 5000 + "]" * 5000 + "}"
        resp = httpx.post(f"{proxy.url}/collective_rpc", content=rpc, timeout=10)
        assert resp.status_code != 500, resp.text[:300]
        assert served(proxy) == [200] * 5
        assert "Traceback" not in proxy.log()


def test_slow_clients_are_cut_off_and_good_ones_served(tmp_path: Path, backends: Any) -> None:
    """300 clients open requests and drip their bodies a byte at a time, on a proxy that may open 256 files: each
    is answered (408 once its body is late, 503 beyond the connections served at once) and closed, and good clients
    that come while the drip goes on are answered."""
    p, d, _, _ = backends
    with proxy_process(tmp_path, "--discovery-port", "0", "--prefill", p, "--decode", d, "--body-timeout", "1",
                       "--max-connections", "64", open_files=256) as proxy:
        assert served(proxy) == [200] * 5
        slow = [connect(proxy, 4096) for _ in range(300)]
        stop = threading.Event()

        def drip() -> None:
            until = time.monotonic() + 8.0
            while not stop.is_set() and time.monotonic() < until:
                for sock in slow:
                    try:
                        sock.send(b" ")
                    except OSError:
                        pass
                stop.wait(0.3)

        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        try:
            time.sleep(2.5)
            statuses: list[Any] = []
            for _ in range(10):
                try:
                    statuses.append(served(proxy, 1, timeout_s=4.0)[0])
                except httpx.HTTPError as exc:
                    statuses.append(type(exc).__name__)
            assert statuses == [200] * 10
            answers = [answer(sock, 3.0)[0] for sock in slow]
            assert set(answers) <= {408, 503} and answers.count(408) >= 1, sorted(set(answers))
        finally:
            stop.set()
            dripper.join(10)
            for sock in slow:
                sock.close()
        log = proxy.log()
        assert "Traceback" not in log, log[-2000:]
        body = json.dumps(GOOD)
        assert httpx.post(f"{proxy.url}/v1/completions", content=body, timeout=10).status_code == 200
