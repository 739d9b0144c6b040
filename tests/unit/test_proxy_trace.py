"""Per-request tracing: the proxy's answers name the transfer and the instances it went through, and it logs one
line per request under that transfer id (stub backends that are real HTTP servers)."""

from __future__ import annotations

import logging
import re
from typing import Any

import httpx
import pytest

from p2pkv.proxy.trace import DECODE_HEADER, PREFILL_HEADER, PREFILL_MS_HEADER, TRANSFER_HEADER
from tests.helpers.servers import serve
from tests.helpers.unit import proxy_for, proxy_with, request_lines, stub_prefill_status


def test_an_answer_names_its_transfer_and_instances_and_is_logged_once(
        backends: Any, caplog: pytest.LogCaptureFixture) -> None:
    p, d, p_seen, d_seen = backends
    caplog.set_level(logging.INFO, logger="p2pkv.proxy.requests")
    with serve(proxy_for(p, d)) as proxy:
        resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert resp.status_code == 200
    tid = resp.headers[TRANSFER_HEADER]
    assert tid == p_seen[0]["body"]["kv_transfer_params"]["transfer_id"] == d_seen[0]["kv_transfer_params"][
        "transfer_id"]
    assert (resp.headers[PREFILL_HEADER], resp.headers[DECODE_HEADER]) == (p, d)
    assert float(resp.headers[PREFILL_MS_HEADER]) > 0
    [line] = request_lines(caplog, tid)
    assert f"prefill={p} " in line and f"decode={d} " in line
    assert "prefill_tries=1 " in line and "status=200 outcome=ok" in line
    total = re.search(r" ms=([\d.]+)$", line)
    assert total is not None and float(total.group(1)) >= float(resp.headers[PREFILL_MS_HEADER])


def test_a_stream_carries_the_headers_and_is_logged_when_it_ends(
        backends: Any, caplog: pytest.LogCaptureFixture) -> None:
    p, d, p_seen, _ = backends
    caplog.set_level(logging.INFO, logger="p2pkv.proxy.requests")
    with serve(proxy_for(p, d)) as proxy:
        body = {"prompt": "x", "max_tokens": 3, "stream": True}
        with httpx.stream("POST", f"http://{proxy}/v1/completions", json=body) as resp:
            tid = resp.headers[TRANSFER_HEADER]
            assert resp.headers[DECODE_HEADER] == d
            assert "data: [DONE]" in list(resp.iter_lines())
        [line] = request_lines(caplog, tid)
    assert tid == p_seen[0]["body"]["kv_transfer_params"]["transfer_id"]
    assert "status=200 outcome=ok" in line


def test_a_request_no_prefill_instance_served_says_so(backends: Any, caplog: pytest.LogCaptureFixture) -> None:
    _, d, _, d_seen = backends
    caplog.set_level(logging.INFO, logger="p2pkv.proxy.requests")
    with serve(proxy_with(["127.0.0.1:1", "127.0.0.1:2"], d)) as proxy:
        resp = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert resp.status_code == 200 and "kv_transfer_params" not in d_seen[0]
    assert resp.headers[PREFILL_HEADER] == "none"
    [line] = request_lines(caplog, resp.headers[TRANSFER_HEADER])
    assert "prefill=none " in line and "prefill_tries=2 " in line


def test_failed_and_rejected_requests_are_traced_too(backends: Any, caplog: pytest.LogCaptureFixture) -> None:
    p, d, _, _ = backends
    caplog.set_level(logging.INFO, logger="p2pkv.proxy.requests")
    # transfer_retries 0: the request's one attempt (a rerouted one is traced in test_proxy_reroute).
    with serve(proxy_with([p], "127.0.0.1:1@127.0.0.1:2", transfer_retries=0)) as proxy:
        broken = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x"})
    assert broken.status_code == 502 and broken.headers[PREFILL_HEADER] == p
    [line] = request_lines(caplog, broken.headers[TRANSFER_HEADER])
    assert "status=502 outcome=proxy_error" in line
    seen: list[dict[str, Any]] = []
    with serve(stub_prefill_status(400, seen)) as bad, serve(proxy_with([bad], d)) as proxy:
        rejected = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "x"})
    assert rejected.status_code == 400
    assert rejected.headers[TRANSFER_HEADER] == seen[0]["kv_transfer_params"]["transfer_id"]
    [line] = request_lines(caplog, rejected.headers[TRANSFER_HEADER])
    assert "status=400 outcome=prefill_rejected" in line
