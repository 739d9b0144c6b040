"""Requests whose first token comes far later than the others' are counted and logged with where their time went."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

import p2pkv.proxy.trace as trace_module
from p2pkv.proxy.trace import SLOW_AFTER, RequestTrace, SlowRequests
from tests.helpers.servers import serve
from tests.helpers.stubs import stub_prefill
from tests.helpers.unit import metric, proxy_with


def traced(tid: str) -> RequestTrace:
    trace = RequestTrace(tid, "decode:1", time.monotonic(), prefill_tries=1)
    trace.prefilled("prefill:1", time.monotonic() - 0.25)
    return trace


def test_only_first_tokens_both_over_a_second_and_ten_times_the_median_are_slow(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    counted: list[int] = []
    slow = SlowRequests(lambda: counted.append(1))
    caplog.set_level(logging.WARNING, "p2pkv.proxy.slow")
    assert not any(slow.note(traced("early"), 5.0) for _ in range(SLOW_AFTER))  # nothing to compare with yet
    for _ in range(300):
        slow.note(traced("usual"), 0.02)
    assert not slow.note(traced("t0"), 0.9)  # 45x the median, but under a second
    assert slow.note(traced("t1"), 1.5)
    assert counted == [1]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "first token after 1500 ms, 75x the median of the last 256 (20 ms)" in line
    assert "prefill on prefill:1 250 ms (1 tries), then decode on decode:1 1250 ms" in line
    assert "transfer t1" in line
    # Within 10 s of a line, the next slow ones are counted, and the line after says how many.
    assert slow.note(traced("t2"), 2.0)
    assert len(caplog.records) == 1 and counted == [1, 1]
    monkeypatch.setattr(trace_module, "SLOW_LOG_S", 0.0)
    assert slow.note(traced("t3"), 2.0)
    assert "transfer t3" in caplog.records[-1].getMessage()
    assert "(1 more since the last such line)" in caplog.records[-1].getMessage()
    # Where every request is slow-ish, only ten times the median is slow.
    busy = SlowRequests(lambda: None)
    for _ in range(100):
        busy.note(traced("busy"), 0.3)
    assert not busy.note(traced("t4"), 2.5)
    assert busy.note(traced("t5"), 3.5)


def test_the_proxy_counts_and_logs_a_request_held_long_on_its_decode_instance(
        caplog: pytest.LogCaptureFixture) -> None:
    seen: list[dict[str, Any]] = []
    decode = FastAPI()

    @decode.post("/v1/completions")
    async def complete(request: Request) -> dict[str, Any]:
        body = await request.json()
        if body["prompt"] == "held":
            await asyncio.sleep(1.2)
        return {"choices": [{"text": "a", "index": 0, "finish_reason": "length"}]}

    caplog.set_level(logging.WARNING, "p2pkv.proxy.slow")
    with serve(stub_prefill(seen)) as prefill, serve(decode) as decode_at, \
            serve(proxy_with([prefill], f"{decode_at}@127.0.0.1:9")) as proxy:
        for i in range(SLOW_AFTER + 4):
            reply = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2})
            assert reply.status_code == 200
        assert metric(proxy, "p2pkv_proxy_slow_requests_total") == 0
        reply = httpx.post(f"http://{proxy}/v1/completions", json={"prompt": "held", "max_tokens": 2}, timeout=10)
        assert reply.status_code == 200
        assert metric(proxy, "p2pkv_proxy_slow_requests_total") == 1
    (line,) = [r.getMessage() for r in caplog.records if r.name == "p2pkv.proxy.slow"]
    assert f"transfer {reply.headers['x-p2pkv-transfer-id']}" in line
    assert f"then decode on {decode_at}" in line
