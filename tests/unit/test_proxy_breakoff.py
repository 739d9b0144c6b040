"""A decode instance that breaks off a stream after its answer began (its process died, its connection broke, it
stalled past the request timeout): the client's stream ends with an error event in its API's form, after the whole
events that came before the break and never inside one, and the failure is counted. Stub backends, real HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from p2pkv.proxy import Instance, ProxyConfig, create_app
from tests.helpers.servers import serve
from tests.helpers.stubs import streaming_decode, stub_prefill
from tests.helpers.unit import metric

# A first event that carries a token, as each API streams one.
FIRST = {
    "/v1/completions": b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n',
    "/v1/chat/completions": b'data: {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": null}]}\n\n',
    "/v1/messages": b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, '
                    b'"delta": {"type": "text_delta", "text": "a"}}\n\n',
    "/v1/responses": b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", '
                     b'"delta": "a"}\n\n',
}
PARTIAL = b'data: {"choices": [{"index": 0, "text": "cut-sh'  # an event cut by the break


class Backend:
    """A decode instance whose streams send the first event, wait `gap_s`, send part of the next, then die (the
    connection closes without the stream's end) or stall for `stall_s`."""

    def __init__(self, gap_s: float = 0.0, stall_s: float = 0.0) -> None:
        self.gap_s, self.stall_s = gap_s, stall_s
        self.app = streaming_decode(tuple(FIRST), self._events)

    async def _events(self, path: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        yield FIRST[path]
        await asyncio.sleep(self.gap_s)
        yield PARTIAL
        if self.stall_s:
            await asyncio.sleep(self.stall_s)
        raise RuntimeError("the decode instance died")  # uvicorn closes the connection mid-stream


def stream(proxy: str, path: str) -> tuple[int, list[tuple[float, bytes]]]:
    """Status, and each piece of the body with the seconds from the request to its arrival."""
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 3, "stream": True}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"input": "x"} if path == "/v1/responses"
                else {"messages": [{"role": "user", "content": "x"}]})
    started = time.monotonic()
    pieces = []
    with httpx.stream("POST", f"http://{proxy}{path}", json=body, timeout=30) as resp:
        for piece in resp.iter_raw():
            pieces.append((time.monotonic() - started, piece))
        return resp.status_code, pieces


def events(pieces: list[tuple[float, bytes]]) -> list[bytes]:
    text = b"".join(p for _, p in pieces)
    assert text.endswith(b"\n\n"), "the stream ends with a whole event"
    return text.split(b"\n\n")[:-1]


@pytest.mark.parametrize("path", list(FIRST))
@pytest.mark.parametrize("retries", [0, 1], ids=["last-try", "may-go-again"])
def test_a_stream_broken_off_after_its_answer_began_ends_with_an_error_event(path: str, retries: int) -> None:
    with ExitStack() as stack:
        decode = Backend(gap_s=1.0)
        p = stack.enter_context(serve(stub_prefill([])))
        d = stack.enter_context(serve(decode.app))
        proxy = stack.enter_context(serve(create_app(ProxyConfig(
            prefill=(Instance.parse(p),), decode=(Instance.parse(d),), transfer_retries=retries))))
        status, pieces = stream(proxy, path)
        assert status == 200
        got = events(pieces)
        assert got[0] + b"\n\n" == FIRST[path], "the events before the break are passed on as they were"
        assert pieces[0][0] < 0.9 and pieces[0][1] == FIRST[path], "a whole event goes on at once, not with the next"
        assert not any(b"cut-sh" in e for e in got), "no part of the broken event"
        last = got[1].split(b"data: ", 1)[1]
        error = json.loads(last)
        if path == "/v1/messages":
            assert got[1].startswith(b"event: error\n") and error["type"] == "error"
            assert error["error"]["type"] == "api_error" and "broke off" in error["error"]["message"]
        elif path == "/v1/responses":
            assert got[1].startswith(b"event: error\n") and error["type"] == "error" and error["code"] == "502"
        else:
            assert error["error"]["code"] == 502 and "broke off" in error["error"]["message"]
            assert got[2:] == [b"data: [DONE]"]
        assert metric(proxy, 'p2pkv_proxy_requests_total{outcome="decode_error"}') == 1
        assert metric(proxy, 'p2pkv_proxy_requests_total{outcome="ok"}') == 0
        assert metric(proxy, "p2pkv_proxy_reroutes_total") == 0, "an answer that began is not sent again"
        instances = httpx.get(f"http://{proxy}/instances").json()["instances"]
        assert [i["in_flight"] for i in instances if i["role"] == "decode"] == [0]


def test_a_stream_that_stalls_past_the_request_timeout_ends_with_a_timeout_error() -> None:
    with ExitStack() as stack:
        p = stack.enter_context(serve(stub_prefill([])))
        d = stack.enter_context(serve(Backend(stall_s=5.0).app))
        proxy = stack.enter_context(serve(create_app(ProxyConfig(
            prefill=(Instance.parse(p),), decode=(Instance.parse(d),), request_timeout_s=1.0))))
        status, pieces = stream(proxy, "/v1/completions")
        assert status == 200
        got = events(pieces)
        assert json.loads(got[1].removeprefix(b"data: "))["error"]["code"] == 504
        assert got[2:] == [b"data: [DONE]"]
        assert pieces[-1][0] < 4.0, "ended by the proxy's timeout, not by the backend"
        assert metric(proxy, 'p2pkv_proxy_requests_total{outcome="decode_error"}') == 1
