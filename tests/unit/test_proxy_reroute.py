"""A decode instance that fails a request before answering (vLLM's 500 for KV it could not load under
`kv_load_failure_policy=fail`, or a stream opened with that error): the proxy sends the request again as a new
transfer, prefilled on a prefill instance not tried yet and decoded on another decode instance where there is one.
Stub backends, real HTTP."""

from __future__ import annotations

import json
import logging
import socket
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from p2pkv.proxy import Instance
from p2pkv.proxy.registry import SHUNNED_S, Policy, static_pool
from p2pkv.proxy.trace import DECODE_HEADER, PREFILL_HEADER, TRANSFER_HEADER
from p2pkv.proxy.upstream import stream_start
from tests.helpers.stubs import CHAT_PREAMBLE, ENGINE_ERROR
from tests.helpers.unit import DropsFirstRequest, Setup, request_lines


def streamed_text(text: str) -> str:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return "".join(json.loads(e)["choices"][0].get("text", "") for e in events if e != "[DONE]")


def test_a_streams_start_tells_an_error_in_place_of_the_first_token() -> None:
    error = f"data: {json.dumps(ENGINE_ERROR)}\n\n".encode()
    preamble = f"data: {json.dumps(CHAT_PREAMBLE)}\n\n".encode()
    assert stream_start(error + b"data: [DONE]\n\n") == 500
    assert stream_start(preamble + error) == 500  # chat names the role before the error
    assert stream_start(preamble) is None  # no token yet: read on
    assert stream_start(b'data: {"error": {"message": "cut off') is None
    assert stream_start(b'data: {"choices": [{"text": "a"}]}\n\n' + error) == 0  # the answer began
    for field in ("content", "reasoning", "reasoning_content"):  # a reasoning model's answer begins with reasoning
        assert stream_start(f'data: {{"choices": [{{"delta": {{"{field}": "a"}}}}]}}\n\n'.encode() + error) == 0
    assert stream_start(b'data: {"error": {"message": "bad", "code": 400}}\n\n') == 0
    assert stream_start(b"data: [DONE]\n\n") == 0
    assert stream_start(b": a comment, no data\n\n") is None
    assert stream_start(b"data: not json\n\n") == 0  # passed on as it is
    # A token whose text is held back (it ends inside a character): a stream that can be resumed from its token ids
    # has begun with it; another reads on, so that an error in its place may still go again.
    held = b'data: {"choices": [{"text": "", "token_ids": [7]}]}\n\n'
    assert stream_start(held) is None and stream_start(held + error) == 500
    assert stream_start(held, by_ids=True) == 0 and stream_start(held + error, by_ids=True) == 0
    assert stream_start(preamble, by_ids=True) is None  # the role is no token


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def test_the_start_of_a_responses_or_messages_stream_is_told_too() -> None:
    """The Responses and Anthropic Messages APIs open a stream with events that name no token yet; an error event
    in place of the first token is the server's (read as a 5xx: the request may go again) or the request's."""
    created = _event("response.created", {"response": {"status": "in_progress"}})
    progress = _event("response.in_progress", {"response": {"status": "in_progress"}})
    started = _event("message_start", {"message": {"content": []}})
    block = _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    assert stream_start(created + progress) is None and stream_start(started + block) is None  # read on
    internal = _event("error", {"error": {"type": "internal_error", "message": "engine"}})
    assert stream_start(started + internal) == 500
    assert stream_start(started + _event("error", {"error": {"type": "overloaded_error"}})) == 529
    assert stream_start(started + _event("error", {"error": {"type": "invalid_request_error"}})) == 0
    assert stream_start(created + _event("error", {"code": "server_error", "message": "x"})) == 500
    assert stream_start(created + _event("error", {"code": "invalid_prompt", "message": "x"})) == 0
    assert stream_start(created + _event("error", {"message": "no code"})) == 500
    assert stream_start(created + _event("response.output_text.delta", {"delta": "a"})) == 0  # the answer began
    assert stream_start(started + _event("content_block_delta", {"delta": {"text": "a"}}) + internal) == 0


@pytest.mark.parametrize("stream,chat", [(False, False), (True, False), (True, True)],
                         ids=["plain", "stream", "chat-stream"])
def test_a_failed_decode_goes_again_through_another_prefill_and_decode_instance(
        stream: bool, chat: bool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="p2pkv.proxy.requests")
    with ExitStack() as stack:
        s = Setup(stack, 2, [["error" if stream else "500"], []])
        status, headers, text = s.post(stream, chat)
        assert status == 200, text
        assert (streamed_text(text) if stream else json.loads(text)["choices"][0]["text"]) == "abc"
        # The first transfer went from prefill 0 to decode 0, which failed it; the second from prefill 1 to decode 1.
        [first], [second] = s.prefilled(0), s.prefilled(1)
        assert first != second
        assert s.decoded(0) == [first] and s.decoded(1) == [second]
        assert headers[TRANSFER_HEADER] == second
        assert headers[PREFILL_HEADER] == s.prefill[1] and headers[DECODE_HEADER] == s.decode[1]
        assert s.metric("p2pkv_proxy_reroutes_total") == 1
        assert s.metric('p2pkv_proxy_requests_total{outcome="ok"}') == 1
        assert s.metric('p2pkv_proxy_requests_total{outcome="decode_error"}') == 0
    [line] = request_lines(caplog, second)
    assert f"prefill={s.prefill[1]}" in line and "reroutes=1 status=200 outcome=ok" in line


def test_with_every_prefill_instance_tried_the_decode_instance_prefills_alone() -> None:
    with ExitStack() as stack:
        s = Setup(stack, 1, [["500"]])
        status, headers, text = s.post()
        assert status == 200, text
        [first] = s.prefilled(0)
        assert s.decoded(0) == [first, None]  # the second request carried no KV: the decode instance prefilled
        assert headers[PREFILL_HEADER] == "none"
        assert s.metric("p2pkv_proxy_reroutes_total") == 1
        assert s.metric("p2pkv_proxy_decode_only_fallbacks_total") == 1


@pytest.mark.parametrize("failure,stream,status", [("late", True, 200), ("400", False, 400), ("400", True, 400)],
                         ids=["error-after-a-token", "client-error", "client-error-stream"])
def test_failures_after_the_answer_began_or_of_the_request_itself_are_passed_on(failure: str, stream: bool,
                                                                                status: int) -> None:
    with ExitStack() as stack:
        s = Setup(stack, 2, [[failure], []])
        got, _, text = s.post(stream)
        assert got == status
        assert len(s.d_seen[0]) == 1 and not s.d_seen[1], "not sent again"
        assert s.metric("p2pkv_proxy_reroutes_total") == 0
        if failure == "late":
            assert '"code": 500' in text and streamed_text(text.split("data: {\"error\"")[0]) == "a"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("retries,calls", [(0, 1), (1, 2)])
def test_a_decode_instance_that_keeps_failing_gets_the_request_at_most_transfer_retries_more_times(
        retries: int, calls: int, stream: bool) -> None:
    with ExitStack() as stack:
        s = Setup(stack, 2, [["error" if stream else "500"] * 3], transfer_retries=retries)
        status, _, text = s.post(stream)
        if stream:  # the last attempt's stream goes to the client as it comes, its error event included
            assert status == 200 and '"code": 500' in text and text.rstrip().endswith("data: [DONE]")
        else:
            assert status == 500 and json.loads(text)["error"]["code"] == 500
            assert s.metric('p2pkv_proxy_requests_total{outcome="decode_error"}') == 1
        assert len(s.d_seen[0]) == calls
        assert s.metric("p2pkv_proxy_reroutes_total") == retries


def dead_address() -> str:
    """A loopback address where nothing listens (a port just freed), with a KV address so no probe is needed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"127.0.0.1:{port}@127.0.0.1:{port}"


def test_an_instance_that_refuses_connections_is_picked_after_the_others_for_a_while() -> None:
    dead = dead_address()
    with ExitStack() as stack:
        s = Setup(stack, 2, [[]], dead=(dead,))
        for _ in range(4):
            status, headers, text = s.post()
            assert status == 200, text
            assert headers[DECODE_HEADER] == s.decode[1]
        # The first request found the dead instance (listed first) and went again; the next ones went past it.
        assert s.metric("p2pkv_proxy_reroutes_total") == 1
        assert len(s.d_seen[0]) == 4 and len(s.prefilled(0)) + len(s.prefilled(1)) == 5
        listed = {i["address"]: i for i in httpx.get(f"http://{s.proxy}/instances").json()["instances"]}
        assert 0 < listed[dead.split("@")[0]]["shunned_s"] <= SHUNNED_S
        assert listed[s.decode[1]]["shunned_s"] == 0


def test_shunned_instances_go_last_and_only_for_a_while() -> None:
    a, b = Instance.parse("127.0.0.1:1"), Instance.parse("127.0.0.1:2")
    pool = static_pool("decode", (a, b), Policy.ROUND_ROBIN)
    pool.states[0].refused(now=100.0)
    assert {pool.pick(now=101.0).instance for _ in range(4)} == {b}  # type: ignore[union-attr]
    pool.states[1].refused(now=101.0)
    assert pool.pick(now=102.0) is not None, "with every instance shunned, one is still picked"
    assert pool.pick(frozenset({b}), now=102.0).instance == a  # type: ignore[union-attr]
    assert {pool.pick(now=100.0 + SHUNNED_S + 1.5).instance for _ in range(4)} == {a, b}  # type: ignore[union-attr]


def test_a_stream_that_breaks_before_its_first_event_goes_again() -> None:
    broken = DropsFirstRequest(after_headers=True)
    try:
        with ExitStack() as stack:
            s = Setup(stack, 2, [[]], dead=(broken.address,))
            status, headers, text = s.post(stream=True)
            assert status == 200, text
            assert streamed_text(text) == "abc" and headers[DECODE_HEADER] == s.decode[1]
            assert broken.requests == 1
            assert s.metric("p2pkv_proxy_reroutes_total") == 1
    finally:
        broken.close()
