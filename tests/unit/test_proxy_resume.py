"""A completion stream whose decode instance breaks off after its answer began is resumed: the rest is asked for as
a new transfer whose prompt is the prompt's tokens and the tokens already streamed, and its stream goes on as the
first one's (same id, usage of one request, no token ids the client did not ask for). Stub backends, real HTTP;
tests/integration/test_resume.py checks the text against vLLM's."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from fastapi import Request

from p2pkv.proxy import Instance, ProxyConfig, create_app
from p2pkv.proxy.chat_resume import as_completion
from p2pkv.proxy.resume import Progress, resumable
from tests.helpers.servers import serve
from tests.helpers.stubs import streaming_decode, stub_prefill
from tests.helpers.unit import metric

PROMPT_IDS = [1, 2, 3]


def chunk(cid: str, text: str, ids: list[int], prompt: list[int] | None = None, finish: str | None = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish, "token_ids": ids}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    return b"data: " + json.dumps({"id": cid, "object": "text_completion", "choices": [choice]}).encode() + b"\n\n"


class Decode:
    """A decode instance that streams one token per event, with token ids when asked: tokens 10, 11, ... (texts
    "a", "b", ...) counted on from the tokens its prompt has beyond PROMPT_IDS, as a continuation's go on. With
    `dies_after`, its first stream breaks off after that many tokens."""

    def __init__(self, name: str, dies_after: int = 0, delta: str = "content", per_event: int = 1,
                 detokenizes: bool = True) -> None:
        """`delta`: the field of a chat chunk's delta its tokens come in; `per_event`: tokens per event of a
        completion stream after the first (vLLM's stream interval); `detokenizes`: it answers `/detokenize`."""
        self.seen: list[dict[str, Any]] = []
        self.detokenized: list[list[int]] = []
        self.name, self.dies_after, self.delta, self.per_event = name, dies_after, delta, per_event
        self.app = streaming_decode(("/v1/completions", "/v1/chat/completions"), self._stream, self.seen)
        if detokenizes:
            self.app.post("/detokenize")(self._detokenize)

    async def _detokenize(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        self.detokenized.append(body["tokens"])
        return {"prompt": "".join(chr(ord("a") + t - 10) for t in body["tokens"])}

    def _stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        # Whether this is its first stream is known as the request comes (`seen` has it), not when it is read.
        return self._chat(body) if path.endswith("chat/completions") else self._events(body, len(self.seen) == 1)

    async def _chat(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """As vLLM streams a chat answer: the role first (with the prompt's ids, when asked), then the tokens."""
        ids = body.get("return_token_ids") is True
        role: dict[str, Any] = {"id": "chat-first", "object": "chat.completion.chunk",
                                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None}]}
        if ids:
            role["prompt_token_ids"] = PROMPT_IDS
        yield b"data: " + json.dumps(role).encode() + b"\n\n"
        for n in range(self.dies_after):
            choice: dict[str, Any] = {"index": 0, "delta": {self.delta: chr(ord("a") + n)}, "finish_reason": None}
            if ids:
                choice["token_ids"] = [10 + n]
            yield b"data: " + json.dumps({"id": "chat-first", "object": "chat.completion.chunk",
                                          "choices": [choice]}).encode() + b"\n\n"
        await asyncio.sleep(0.1)
        raise RuntimeError("the decode instance died")

    async def _events(self, body: dict[str, Any], first_stream: bool) -> AsyncIterator[bytes]:
        prompt = body["prompt"] if isinstance(body["prompt"], list) else PROMPT_IDS
        ids = body.get("return_token_ids") is True
        left = body.get("max_tokens") or 16
        first = 10 + len(prompt) - len(PROMPT_IDS)
        n = 0
        while n < left:
            if self.dies_after and n == self.dies_after and first_stream:
                await asyncio.sleep(0.1)
                raise RuntimeError("the decode instance died")
            tokens = list(range(first + n, first + min(left, n + (self.per_event if n else 1))))
            text = "".join(chr(ord("a") + token - 10) for token in tokens)
            n += len(tokens)
            finish = "length" if n == left else None
            event = chunk(f"cmpl-{self.name}", text, tokens, prompt if n == len(tokens) else None, finish)
            if not ids:
                event = event.replace(b', "token_ids": ' + json.dumps(tokens).encode(), b"")
                event = event.replace(b', "prompt_token_ids": ' + json.dumps(prompt).encode(), b"")
            yield event
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt), "completion_tokens": left, "total_tokens": len(prompt) + left}
            yield b"data: " + json.dumps({"id": f"cmpl-{self.name}", "choices": [], "usage": usage}).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"


def run(body: dict[str, Any], decodes: list[Decode], path: str = "/v1/completions", **options: Any
        ) -> tuple[list[Any], str, list[dict[str, Any]], dict[str, float]]:
    """The client's events (parsed; "[DONE]" as is), its whole text, what the prefill instance was sent, metrics."""
    prefilled: list[dict[str, Any]] = []
    with ExitStack() as stack:
        p = stack.enter_context(serve(stub_prefill(prefilled)))
        ds = [stack.enter_context(serve(d.app)) for d in decodes]
        proxy = stack.enter_context(serve(create_app(ProxyConfig(
            prefill=(Instance.parse(p),), decode=tuple(Instance.parse(d) for d in ds), **options))))
        with httpx.stream("POST", f"http://{proxy}{path}", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            raw = resp.read()
        names = ("stream_resumes_total", 'requests_total{outcome="ok"}', 'requests_total{outcome="decode_error"}')
        metrics = {n: metric(proxy, "p2pkv_proxy_" + n) for n in names}
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    parsed = [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for e in parsed if isinstance(e, dict) for c in e.get("choices", []))
    return parsed, text, [s["body"] for s in prefilled], metrics


BODY = {"model": "tiny", "prompt": "x", "max_tokens": 5, "stream": True, "temperature": 0}


@pytest.mark.parametrize("client_ids", [False, True], ids=["ids-not-asked", "ids-asked"])
def test_a_broken_stream_goes_on_from_the_tokens_it_streamed(client_ids: bool) -> None:
    decode = Decode("first", dies_after=2)  # the only one: the rest goes there too
    body = {**BODY, "stream_options": {"include_usage": True}, **({"return_token_ids": True} if client_ids else {})}
    events, text, prefilled, metrics = run(body, [decode])
    assert text == "abcde"
    first, rest = decode.seen
    assert first["return_token_ids"] is True, "the decode request asks for ids"
    assert rest["prompt"] == [*PROMPT_IDS, 10, 11] and rest["max_tokens"] == 3 and rest["return_token_ids"] is True
    assert [b["prompt"] for b in prefilled] == ["x", [*PROMPT_IDS, 10, 11]], "the rest is prefilled as a new transfer"
    assert rest["kv_transfer_params"]["transfer_id"] == prefilled[1]["kv_transfer_params"]["transfer_id"]
    assert rest["kv_transfer_params"]["transfer_id"] != first["kv_transfer_params"]["transfer_id"]
    chunks = [e for e in events if isinstance(e, dict)]
    assert {c["id"] for c in chunks} == {"cmpl-first"}, "the continuation goes on under the first stream's id"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert [("prompt_token_ids" in c) for c in choices] == [client_ids] + [False] * 4, "the prompt's ids come once"
    assert [c.get("token_ids") for c in choices] == ([[t] for t in range(10, 15)] if client_ids else [None] * 5)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert metrics["stream_resumes_total"] == 1
    assert metrics['requests_total{outcome="ok"}'] == 1 and metrics['requests_total{outcome="decode_error"}'] == 0


def test_a_first_token_without_text_reaches_the_client_before_the_next_token() -> None:
    """vLLM holds back the text of a token that ends inside a character, and streams the token with an empty text
    (vLLM's serving benchmark times the first token from that chunk). A resumable stream's first chunk goes to the
    client as it comes, not with the next token's: the decode instance here sends its second token only once the
    client has the first."""
    client_has_first = threading.Event()
    waited_in_vain: list[bool] = []

    async def events(path: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        assert body.get("return_token_ids") is True
        yield chunk("cmpl-held", "", [10], PROMPT_IDS)
        waited_in_vain.append(not await asyncio.to_thread(client_has_first.wait, 5))
        yield chunk("cmpl-held", "\u00e9", [11], finish="length")
        yield b"data: [DONE]\n\n"

    with ExitStack() as stack:
        p = stack.enter_context(serve(stub_prefill([])))
        d = stack.enter_context(serve(streaming_decode(("/v1/completions",), events)))
        proxy = stack.enter_context(serve(create_app(ProxyConfig(prefill=(Instance.parse(p),),
                                                                 decode=(Instance.parse(d),)))))
        with httpx.stream("POST", f"http://{proxy}/v1/completions", json={**BODY, "max_tokens": 2},
                          timeout=30) as resp:
            lines = (line for line in resp.iter_lines() if line.startswith("data: "))
            first = json.loads(next(lines).removeprefix("data: "))
            client_has_first.set()
            rest = list(lines)
    assert waited_in_vain == [False], "the first chunk was held for the second token"
    assert first["choices"][0]["text"] == "" and "token_ids" not in first["choices"][0]
    assert json.loads(rest[0].removeprefix("data: "))["choices"][0]["text"] == "\u00e9" and rest[-1] == "data: [DONE]"


def test_a_stream_breaks_off_again_and_goes_on_again_within_the_limit() -> None:
    decodes = [Decode("first", dies_after=2), Decode("second", dies_after=1)]
    _, text, prefilled, metrics = run(BODY, decodes, stream_resumes=2)
    assert text == "abcde"
    assert sorted(len(d.seen) for d in decodes) == [1, 2], "the rest goes to the instance that did not fail last"
    last = next(d.seen[1] for d in decodes if len(d.seen) == 2)
    assert last["prompt"] == [*PROMPT_IDS, 10, 11, 12] and last["max_tokens"] == 2
    assert metrics["stream_resumes_total"] == 2 and len(prefilled) == 3


@pytest.mark.parametrize("why,body,options", [
    ("limit", BODY, {"stream_resumes": 0}),
    ("stop strings", {**BODY, "stop": ["z"]}, {}),
    ("seed", {**BODY, "seed": 0}, {}),
])
def test_a_stream_that_may_not_go_on_ends_with_an_error(why: str, body: dict[str, Any], options: Any) -> None:
    decode = Decode("first", dies_after=2)
    events, text, _, metrics = run(body, [decode], **options)
    assert text == "ab" and len(decode.seen) == 1, why
    assert events[-2]["error"]["code"] == 502 and events[-1] == "[DONE]"
    assert "return_token_ids" not in decode.seen[0], "no ids asked for a stream that will not go on"
    assert metrics["stream_resumes_total"] == 0 and metrics['requests_total{outcome="decode_error"}'] == 1


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5, "stream": True,
        "temperature": 0, "stream_options": {"include_usage": True}, "chat_template_kwargs": {"a": 1}}


def test_a_broken_chat_stream_goes_on_as_a_completion_of_the_chat_prompts_tokens() -> None:
    decode = Decode("first", dies_after=2)
    events, text, prefilled, metrics = run(CHAT, [decode], "/v1/chat/completions")
    assert text == "abcde"
    first, rest = decode.seen
    assert first["path"] == "/v1/chat/completions" and first["return_token_ids"] is True
    assert rest["path"] == "/v1/completions" and "messages" not in rest and "chat_template_kwargs" not in rest
    assert rest["prompt"] == [*PROMPT_IDS, 10, 11] and rest["max_tokens"] == 3 and rest["temperature"] == 0
    assert [b["prompt"] for b in prefilled[1:]] == [rest["prompt"]]
    chunks = [e for e in events if isinstance(e, dict)]
    assert {(c["id"], c["object"]) for c in chunks} == {("chat-first", "chat.completion.chunk")}
    assert not [c for c in chunks if "prompt_token_ids" in c or any("token_ids" in x for x in c["choices"])]
    assert [c["choices"][0]["delta"] for c in chunks[1:6]] == [{"content": t} for t in "abcde"]
    assert chunks[5]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert events[-1] == "[DONE]" and metrics["stream_resumes_total"] == 1


def test_a_chat_streams_rest_keeps_its_sampling_and_stream_options_and_nothing_chat_only() -> None:
    chat = {**CHAT, "stream_interval": 4, "top_k": 5, "tools": None, "max_completion_tokens": 7}
    assert as_completion(chat) == {"model": "tiny", "max_tokens": 7, "stream": True, "temperature": 0,
                                   "stream_options": {"include_usage": True}, "stream_interval": 4, "top_k": 5}


def test_a_chat_stream_that_streamed_reasoning_is_not_resumed() -> None:
    decode = Decode("first", dies_after=2, delta="reasoning")
    events, _, _, metrics = run(CHAT, [decode], "/v1/chat/completions")
    assert len(decode.seen) == 1 and events[-2]["error"]["code"] == 502 and events[-1] == "[DONE]"
    assert metrics["stream_resumes_total"] == 0


def test_which_requests_can_be_resumed() -> None:
    assert resumable(CHAT, "/v1/chat/completions")
    for change in ({"tools": [{"type": "function"}]}, {"logprobs": True}, {"top_logprobs": 2}, {"n": 2},
                   {"response_format": {"type": "json_object"}}):
        assert not resumable({**CHAT, **change}, "/v1/chat/completions"), change
    assert not resumable({**BODY, "messages": []}, "/v1/responses")
    assert resumable(BODY, "/v1/completions") and resumable({**BODY, "prompt": [1, 2]}, "/v1/completions")
    assert resumable({**BODY, "stop": [], "seed": None, "presence_penalty": 0.0, "n": 1}, "/v1/completions")
    assert not resumable(BODY, "/v1/chat/completions")
    assert not resumable({**BODY, "stream": False}, "/v1/completions")
    for change in ({"n": 2}, {"logprobs": 0}, {"echo": True}, {"frequency_penalty": 0.5}, {"stop": "\n"},
                   {"response_format": {"type": "json_object"}}, {"prompt": ["a", "b"]},
                   {"stream_options": {"continuous_usage_stats": True}}):
        assert not resumable({**BODY, **change}, "/v1/completions"), change


def _progress(*chunks: tuple[list[int], str]) -> Progress:
    """A completion stream's progress after chunks of (token ids, text), the first naming the prompt's ids."""
    progress = Progress(BODY, "/v1/completions")
    for i, (ids, text) in enumerate(chunks):
        progress.passed(chunk("c", text, ids, PROMPT_IDS if i == 0 else None))
    return progress


def test_a_stream_goes_on_from_the_last_token_whose_text_went_out_whole() -> None:
    # The detokenizer holds back the bytes of a character split across tokens: token 11's text has not gone out.
    rest = _progress(([10], "a"), ([11], "")).continuation()
    assert rest is not None and rest[1]["prompt"] == [*PROMPT_IDS, 10] and rest[1]["max_tokens"] == 4
    # Then the character came whole with token 12.
    rest = _progress(([10], "a"), ([11], ""), ([12], "é")).continuation()
    assert rest is not None and rest[1]["prompt"] == [*PROMPT_IDS, 10, 11, 12] and rest[1]["max_tokens"] == 2
    # An event of no token that brings text (what was held back) brings all of it out.
    rest = _progress(([10], "a"), ([11], ""), ([], "é")).continuation()
    assert rest is not None and rest[1]["prompt"] == [*PROMPT_IDS, 10, 11]
    # A chunk of several tokens may end inside a character: not resumed until a chunk of one token had text.
    assert _progress(([10], "a"), ([11, 12], "bc")).continuation() is None
    rest = _progress(([10], "a"), ([11, 12], "bc"), ([13], "d")).continuation()
    assert rest is not None and rest[1]["prompt"] == [*PROMPT_IDS, 10, 11, 12, 13]
    assert _progress(([10], "a"), ([11], "b")).continuation() is not None
    assert _progress(([10], "a"), ([11], "b\n")).continuation() is not None
    assert Progress(BODY, "/v1/completions").continuation() is None, "no prompt ids seen"


@pytest.mark.parametrize("detokenizes", [True, False], ids=["detokenized", "no-detokenize"])
def test_a_stream_of_several_tokens_an_event_goes_on_from_where_its_text_ended(detokenizes: bool) -> None:
    """vLLM's stream interval (or speculative decoding) puts several tokens in an event, whose end may fall inside
    a character: an instance that did not fail detokenizes the tokens since the last known end; without that
    answer, the stream ends with an error."""
    decodes = [Decode("first", dies_after=3, per_event=2, detokenizes=detokenizes),
               Decode("second", per_event=2, detokenizes=detokenizes)]
    events, text, _, metrics = run(BODY, decodes)
    first, second = decodes
    assert first.detokenized == [] and second.detokenized == ([[11, 12]] if detokenizes else [])
    if not detokenizes:
        assert text == "abc" and events[-2]["error"]["code"] == 502 and len(second.seen) == 0
        assert metrics["stream_resumes_total"] == 0 and metrics['requests_total{outcome="decode_error"}'] == 1
        return
    assert text == "abcde" and events[-1] == "[DONE]"
    (rest,) = second.seen
    assert rest["prompt"] == [*PROMPT_IDS, 10, 11, 12] and rest["max_tokens"] == 2
    assert metrics["stream_resumes_total"] == 1 and metrics['requests_total{outcome="ok"}'] == 1


# 12, 13: the two bytes of "é"; 16 a special token (vLLM's `/detokenize` spells them out, a stream leaves them out)
_BYTES = {10: b"a", 11: b"b", 12: b"\xc3", 13: b"\xa9", 14: b"<", 15: b"", 16: b"</s>"}


def _settled(progress: Progress, answers: bool = True) -> list[list[int]]:
    """`progress` settled with a tokenizer of `_BYTES` (None from it, unless `answers`); what it was asked."""
    asked: list[list[int]] = []

    async def detokenize(ids: list[int]) -> str | None:
        asked.append(ids)
        return b"".join(_BYTES[t] for t in ids).decode("utf-8", "replace") if answers else None

    asyncio.run(progress.settle(detokenize))
    return asked


def test_an_event_of_several_tokens_is_settled_where_its_text_ended() -> None:
    progress = _progress(([10], "a"), ([11, 12, 13], "bé"))
    assert progress.continuation() is None, "not settled"
    assert _settled(progress) == [[11, 12, 13]]
    rest = progress.continuation()
    assert rest is not None and rest[1]["prompt"] == [*PROMPT_IDS, 10, 11, 12, 13] and rest[1]["max_tokens"] == 1
    # The event's last token began a character: its text is held back; the stream goes on from before it.
    progress = _progress(([10], "a"), ([11, 12], "b"))
    assert _settled(progress) == [[11, 12], [11]]
    rest = progress.continuation()
    assert rest is not None and rest[1]["prompt"] == [*PROMPT_IDS, 10, 11] and rest[1]["max_tokens"] == 3
    # A token of no text after the held one: held back too.
    progress = _progress(([10], "a"), ([11, 12, 15], "b"))
    assert _settled(progress) == [[11, 12, 15], [11, 12], [11]]
    # A special token after the held one: held back too, though spelled out it does not end in U+FFFD.
    progress = _progress(([10], "a"), ([11, 12, 16], "b"))
    assert _settled(progress) == [[11, 12, 16], [11, 12], [11]] and progress.whole == 2
    progress = _progress(([10], "a"), ([11, 16], "b"))
    assert _settled(progress) == [[11, 16], [11]] and progress.whole == 2
    # Tokens without text after the event are not asked about; they come again.
    progress = _progress(([10], "a"), ([11, 14], "b<"), ([12], ""))
    assert _settled(progress) == [[11, 14]]
    rest = progress.continuation()
    assert rest is not None and rest[1]["prompt"] == [*PROMPT_IDS, 10, 11, 14]
    # Settled from the start: every event had several tokens.
    progress = _progress(([10, 11], "ab"), ([14, 12], "<"))
    assert _settled(progress) == [[10, 11, 14, 12], [10, 11, 14]]
    assert progress.continuation() is not None


def _chat_chunk(content: str, ids: list[int], prompt: list[int] | None = None) -> bytes:
    chunk: dict[str, Any] = {"id": "chat", "object": "chat.completion.chunk",
                             "choices": [{"index": 0, "delta": {"content": content}, "token_ids": ids}]}
    if prompt is not None:
        chunk["prompt_token_ids"] = prompt
    return b"data: " + json.dumps(chunk).encode()


def test_a_chat_streams_events_of_several_tokens_are_settled_by_their_content() -> None:
    progress = Progress(CHAT, "/v1/chat/completions")
    progress.passed(_chat_chunk("", [], PROMPT_IDS))  # the role chunk
    progress.passed(_chat_chunk("a", [10]))
    progress.passed(_chat_chunk("b", [11, 12, 16]))  # "é" begun, then a special token: both held back
    assert progress.tail == "b"
    assert _settled(progress) == [[11, 12, 16], [11, 12], [11]]
    rest = progress.continuation()
    assert rest is not None and rest[0] == "/v1/completions" and rest[1]["prompt"] == [*PROMPT_IDS, 10, 11]


def test_a_stream_is_not_resumed_where_its_text_cannot_be_settled() -> None:
    progress = _progress(([10], "a"), ([11, 12], "b"))
    assert _settled(progress, answers=False) == [[11, 12]] and progress.continuation() is None
    # No end since the last sure one decodes without a character cut short (a byte that begins none went out as
    # U+FFFD): not resumed, never from before text that went out.
    progress = _progress(([10], "a"), ([13, 12], "\ufffd"))
    assert _settled(progress) == [[13, 12], [13]] and progress.continuation() is None
    # Sure ends are not asked about.
    assert _settled(_progress(([10], "a"), ([11], "b"))) == []
    # The client has the held-back token's id: it would come twice.
    progress = Progress({**BODY, "return_token_ids": True}, "/v1/completions")
    for i, (ids, text) in enumerate([([10], "a"), ([11, 12], "b")]):
        progress.passed(chunk("c", text, ids, PROMPT_IDS if i == 0 else None))
    _settled(progress)
    assert progress.whole == 2 and progress.continuation() is None


def test_each_prompt_of_a_streamed_batch_goes_on_by_itself() -> None:
    decode = Decode("first", dies_after=2)  # its first stream breaks off: one of the two prompts'
    events, _, prefilled, metrics = run({**BODY, "prompt": ["x", "y"]}, [decode])
    texts = ["", ""]
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == ["abcde", "abcde"] and events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert len(decode.seen) == 3 and len(prefilled) == 3
    assert metrics["stream_resumes_total"] == 1 and metrics['requests_total{outcome="ok"}'] == 2
