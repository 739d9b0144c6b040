"""The failover benchmark's driver against a stub proxy (its own logic only; the benchmark itself runs a real
1P2D cluster and kills a decode instance): the kill comes once every stream has a third of its tokens, and a stream
that ends with an error, short of `[DONE]`, or with text other than the request sent again fails the run."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from p2pkv.bench.failover import body, drive
from tests.helpers.servers import serve

TOKENS = 12


def stub(after_kill: str, killed: list[int], sent: list[int]) -> FastAPI:
    """Streams of TOKENS tokens (`sent`: how many each stream has sent so far); once killed, a stream ends as
    `after_kill` says: "whole", "error" (an error event), "short" (no `[DONE]`), "other" (the request sent again
    gets other text)."""
    app = FastAPI()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("p2pkv_proxy_stream_resumes_total 3.0\np2pkv_proxy_reroutes_total 0.0\n")

    @app.post("/v1/completions")
    async def complete(request: Request) -> Any:
        body = await request.json()
        if not body["stream"]:
            return {"choices": [{"text": "t" * TOKENS if after_kill != "other" else "x"}]}

        stream = len(sent)
        sent.append(0)

        async def events() -> AsyncIterator[bytes]:
            for n in range(TOKENS):
                if killed and n >= TOKENS // 2 and after_kill == "error":
                    yield b'data: {"error": {"message": "broke off", "code": 502}}\n\n'
                    break
                yield b"data: " + json.dumps({"choices": [{"text": "t"}]}).encode() + b"\n\n"
                sent[stream] += 1
                await asyncio.sleep(0.02 if killed else 0.1)
            if after_kill != "short":
                yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.mark.parametrize("after_kill,ok", [("whole", True), ("error", False), ("short", False), ("other", False)])
def test_the_kill_comes_mid_stream_and_only_whole_equal_streams_pass(after_kill: str, ok: bool) -> None:
    killed: list[int] = []
    sent: list[int] = []
    at_kill: list[list[int]] = []

    def kill() -> None:
        killed.append(1)
        at_kill.append(list(sent))

    with serve(stub(after_kill, killed, sent)) as proxy:
        result = asyncio.run(drive(f"http://{proxy}", "tiny", 3, TOKENS, kill, timeout_s=30))
    assert killed == [1]
    # Each stream had sent a third of its tokens and not all (a token every 0.1 s before the kill: 0.8 s to spare).
    assert len(at_kill[0]) == 3 and all(TOKENS // 3 <= n < TOKENS for n in at_kill[0]), at_kill
    assert result.killed_at_s > 0
    assert result.ok() is ok
    assert result.metrics["p2pkv_proxy_stream_resumes_total"] == 3
    if after_kill == "whole":
        assert [s.tokens for s in result.streams] == [TOKENS] * 3 and result.again == ["t" * TOKENS] * 3


def test_streams_ask_for_the_stream_interval_and_the_requests_sent_again_do_not() -> None:
    assert body(0, "tiny", 9, interval=4)["stream_interval"] == 4
    assert "stream_interval" not in body(0, "tiny", 9, stream=False, interval=4)
    assert "stream_interval" not in body(0, "tiny", 9)
    assert body(1, "tiny", 9, interval=4)["prompt"] != body(0, "tiny", 9, interval=4)["prompt"]
