"""The decode request and its answer on the way back to the client. The answer is passed on as it comes, except
that a failure before any of it went out is reported instead (None), so that the request can go again. vLLM
answers a request that failed inside the engine (KV that could not be loaded under `kv_load_failure_policy=fail`,
for one) with status 500, or, for a stream whose headers already went, with an event `data: {"error": {...,
"code": 500}}` in place of the first token (a chat stream names the role first; a Messages API stream opens with
`message_start` and sends an `error` event; a Responses API stream opens with `response.created` and breaks off);
so while the request may still go again, a stream is read until its answer has begun before the client is
answered."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from p2pkv.proxy.chat_resume import NOT_CONTENT
from p2pkv.proxy.metrics import ProxyMetrics
from p2pkv.proxy.registry import InstanceState
from p2pkv.proxy.resume import Progress, each_event
from p2pkv.proxy.sse import break_off, split_events
from p2pkv.proxy.trace import RequestTrace

log = logging.getLogger(__name__)


_MAX_HEAD = 1 << 16  # bytes of a stream read, at most, before its answer is known to have begun


def stream_start(head: bytes, by_ids: bool = False) -> int | None:
    """What the first bytes of a stream say: the error code (5xx) of an error event sent in place of the first
    token; 0 once the answer has begun (a token, the end, a 4xx, or bytes that are not such events, passed on as
    they are); None while only a preamble has come (chat's first chunk, which names the role before any token,
    or an empty text): read on. `by_ids` (a resumable stream, which carries its token ids): a chunk with token ids
    begins the answer even where their text is empty (held back inside a character, or a special token), so that
    the client's first chunk is not held for the next token's."""
    *events, _ = head.split(b"\n\n")  # the last piece is an event not yet complete (or nothing)
    for event in events:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:"):].strip()
            if data == b"[DONE]":
                return 0
            try:
                message = json.loads(data)
            except (json.JSONDecodeError, UnicodeDecodeError):
                return 0
            code = _error_code(message)
            if code:
                return code if code >= 500 else 0
            if not _preamble(message) or (by_ids and _has_token_ids(message)):
                return 0
    return None if len(head) < _MAX_HEAD else 0


_DELTA_OUTPUT = ("content", *NOT_CONTENT)  # fields of a chat chunk's delta that carry output
# Events of the Responses and Anthropic Messages APIs' streams that come before any token.
_PREAMBLE_EVENTS = frozenset({"response.created", "response.in_progress", "response.output_item.added",
                              "response.content_part.added", "message_start", "content_block_start", "ping"})
# Error types (Anthropic's) and codes (the Responses API's) for a failure of the server; others are the request's
# fault, passed on.
_SERVER_ERRORS = {"api_error": 500, "internal_error": 500, "overloaded_error": 529, "server_error": 500}


def _error_code(message: Any) -> int:
    error = message.get("error") if isinstance(message, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    if isinstance(message, dict) and message.get("type") == "error":  # an Anthropic or Responses error event
        kind = error.get("type") if isinstance(error, dict) else message.get("code")
        if not isinstance(kind, str):
            return 500
        return int(kind) if kind.isdigit() else _SERVER_ERRORS.get(kind, 400)
    return 0


def _preamble(message: Any) -> bool:
    """A chunk that carries no part of the answer yet: each choice with no text, content or tool call, unfinished;
    or an event of the Responses or Messages API that opens the answer before its first token."""
    if isinstance(message, dict) and message.get("type") in _PREAMBLE_EVENTS:
        return True
    choices = message.get("choices") if isinstance(message, dict) else None
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("finish_reason") is not None or choice.get("text"):
            return False
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict) or any(delta.get(k) for k in _DELTA_OUTPUT):
            return False
    return True


def _has_token_ids(message: Any) -> bool:
    choices = message.get("choices") if isinstance(message, dict) else None
    return isinstance(choices, list) and any(isinstance(c, dict) and c.get("token_ids") for c in choices)


def error_response(status: int, message: str, kind: str = "proxy_error",
                   trace: RequestTrace | None = None) -> JSONResponse:
    """An OpenAI-style error answer; with `trace`, the request's line is logged and its headers go with it."""
    if trace is not None:
        trace.finish(status, kind)
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=trace.headers() if trace is not None else None)


async def _close(upstream: httpx.Response) -> None:
    """Close an upstream answer, shielded: this runs as the client goes away, often in a task that anyio is
    cancelling, which cancels each await there; httpx would then mark the answer closed without closing its
    connection, and the decode instance would go on decoding for nobody."""
    with anyio.CancelScope(shield=True):
        await upstream.aclose()


@dataclass
class Resume:
    """A resumable stream's progress, and how to send the request for its rest: the continuation's stream, or None
    when it could not be had (its failure counted)."""

    progress: Progress
    send: Callable[[str, dict[str, Any]], Awaitable[Relay | None]]
    detokenize: Callable[[list[int]], Awaitable[str | None]]  # the model's tokenizer, on an instance (`settle`)

    async def rest(self) -> tuple[str, dict[str, Any]] | None:
        """The path and body of the request for the rest of the stream, once it broke off; None if it cannot go
        on."""
        await self.progress.settle(self.detokenize)
        return self.progress.continuation()


class Relay:
    """A decode stream on its way to the client: the chunks read ahead (`head`), then the rest as it comes, passed on
    whole events at a time. If its decode instance breaks off (the connection breaks, or stalls past the request
    timeout), the stream goes on from a new request for its rest where it can (`resume`), or else ends with an error
    event in its API's form (`api`: its path) rather than mid-event, and the failure is counted. Its upstream
    request is closed, and its instance's count of requests in flight taken back, once: when it has been read to
    its end, or broke off, or is closed (`aclose`, which also works for one never read: a batch's prompt whose
    stream is not needed)."""

    def __init__(self, head: list[bytes], raw: AsyncIterator[bytes], upstream: httpx.Response, state: InstanceState,
                 metrics: ProxyMetrics, trace: RequestTrace, api: str = "/v1/completions",
                 resume: Resume | None = None) -> None:
        """`resume`: how the stream goes on once its decode instance broke off (`p2pkv.proxy.resume`)."""
        self._chunks = self._read(head, raw)
        self._upstream, self._state, self._metrics, self._trace = upstream, state, metrics, trace
        self._api = api
        self._resume = resume
        self._rest: Relay | None = None  # the stream's continuation, once resumed
        self._timed = bool(head)
        self._closed = False

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> bytes:
        return await anext(self._chunks)

    async def _read(self, head: list[bytes], raw: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
        # Cancelled when the client goes away, which closes the upstream request too.
        outcome = "broken_off"
        whole, pending = split_events(b"".join(head))
        progress = self._resume.progress if self._resume is not None else None
        try:
            if whole:
                yield whole if progress is None else each_event(whole, progress.passed)
            try:
                async for chunk in raw:
                    if not self._timed:  # a stream's headers come before its first token (vLLM sends them at once)
                        self._timed = True
                        self._metrics.first_token(self._trace, time.monotonic() - self._trace.started)
                    whole, pending = split_events(pending + chunk)
                    if whole:
                        yield whole if progress is None else each_event(whole, progress.passed)
            except httpx.HTTPError as exc:
                rest = await self._resume.rest() if self._resume is not None else None
                if self._resume is None or rest is None:
                    outcome = "decode_error"
                    yield self._broke_off(exc, pending)
                    return
                outcome = "resumed"
                async for block in self._continue(exc, self._resume, *rest):
                    yield block
                return
            if pending:
                yield pending
            self._metrics.requests.labels("ok").inc()
            outcome = "ok"
        finally:
            await self._release(outcome)
            if self._rest is not None:
                await self._rest.aclose()

    async def _continue(self, exc: httpx.HTTPError, resume: Resume, path: str, body: dict[str, Any]
                        ) -> AsyncGenerator[bytes, None]:
        """The rest of the stream from a new request for it (counted there), passed on as this one's."""
        self._state.failures += 1
        log.warning("transfer %s: decode instance %s broke off its stream after %d tokens (%r); resuming it",
                    self._trace.transfer_id, self._state.instance.name, len(resume.progress.streamed), exc)
        await self._release("resumed")  # this instance's part is over
        self._rest = await resume.send(path, body)
        if self._rest is None:
            yield break_off(self._api, 502, f"decode instance {self._state.instance.name} broke off the stream, "
                                            f"and it could not be resumed: {exc!r}")
            return
        async for block in self._rest:
            yield each_event(block, resume.progress.continued)

    def _broke_off(self, exc: httpx.HTTPError, held: bytes) -> bytes:
        """The events that end the client's stream once its decode instance broke off; `held`: the part of an event
        that came before the break, dropped."""
        self._state.failures += 1
        self._metrics.requests.labels("decode_error").inc()
        status = 504 if isinstance(exc, httpx.TimeoutException) else 502
        name = self._state.instance.name
        log.warning("transfer %s: decode instance %s broke off its stream after its answer began (%r; %d bytes of an "
                    "event dropped); the stream ends with an error", self._trace.transfer_id, name, exc, len(held))
        return break_off(self._api, status, f"decode instance {name} broke off the stream: {exc!r}")

    async def _release(self, outcome: str) -> None:
        if self._closed:
            return
        self._closed = True
        await _close(self._upstream)
        self._state.in_flight -= 1
        self._metrics.decode_seconds.observe(time.monotonic() - self._trace.started)
        self._trace.finish(200, outcome)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._chunks.aclose()  # runs `_read`'s cleanup if it began
            await self._release("broken_off")


class RelayResponse(StreamingResponse):
    """A streamed answer whose upstream requests are closed once it is over, however it ended: also when the client
    went away before it began, when Starlette never reads the body (so a relay's own cleanup would never run, its
    upstream request would stay open and its instance's count of requests in flight would stay up)."""

    def __init__(self, content: AsyncIterator[bytes], closers: list[Callable[[], Awaitable[None]]],
                 headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._closers = closers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # see Relay._release
                for close in self._closers:
                    await close()


class Decoder:
    """Sends decode requests and passes their answers on."""

    def __init__(self, client: httpx.AsyncClient, metrics: ProxyMetrics) -> None:
        self.client = client
        self.metrics = metrics

    async def _send_decode(self, state: InstanceState, url: str, body: dict[str, Any],
                           headers: dict[str, str]) -> httpx.Response:
        """The decode request, sent once more on a new connection when the first broke before any answer: a
        pooled keep-alive connection the server closed as the request went out (the decode side still holds the
        transfer, so the second try finds it)."""
        try:
            return await self.client.send(self.client.build_request("POST", url, json=body, headers=headers),
                                          stream=True)
        except (httpx.TimeoutException, httpx.ConnectError):
            raise  # a new connection was refused: sending again would only be refused again
        except httpx.TransportError as exc:
            log.warning("decode instance %s: %r; sending once more on a new connection", state.instance.name, exc)
            self.metrics.decode_resends.inc()
        return await self.client.send(self.client.build_request("POST", url, json=body, headers=headers),
                                      stream=True)

    async def answer(self, state: InstanceState, url: str, body: dict[str, Any], headers: dict[str, str],
                      trace: RequestTrace, last: bool = True, resume: Resume | None = None) -> Response | None:
        """The decode instance's answer, for the client; None when it failed before any of it went out and the
        request may go again (not `last`). `resume`: a stream's, for a break after its answer began."""
        started = trace.started
        state.in_flight += 1
        try:
            upstream = await self._send_decode(state, url, body, headers)
        except httpx.TimeoutException as exc:
            state.in_flight -= 1
            self.metrics.requests.labels("decode_error").inc()
            return error_response(504, f"decode instance {state.instance.name} timed out: {exc!r}", trace=trace)
        except httpx.HTTPError as exc:
            state.in_flight -= 1
            state.failures += 1
            log.warning("decode instance %s failed: %r", state.instance.name, exc)
            if isinstance(exc, httpx.ConnectError):
                state.refused()
            if not last:
                return None
            self.metrics.requests.labels("decode_error").inc()
            return error_response(502, f"decode instance {state.instance.name} failed: {exc!r}", trace=trace)
        except asyncio.CancelledError:  # the client went away
            state.in_flight -= 1
            raise
        if upstream.status_code != 200 or not body.get("stream"):
            return await self._whole_answer(state, upstream, trace, last)
        raw = upstream.aiter_raw()
        head: list[bytes] = []
        if not last:  # read until the answer has begun before answering: a failure there may still go again
            try:
                error = await self._stream_start(raw, head, resume is not None)
            except BaseException:
                await _close(upstream)
                state.in_flight -= 1
                raise
            if error:
                await _close(upstream)
                state.in_flight -= 1
                state.failures += 1
                log.warning("decode instance %s opened its stream with error %d", state.instance.name, error)
                return None
            self.metrics.first_token(trace, time.monotonic() - started)

        relay = Relay(head, raw, upstream, state, self.metrics, trace, httpx.URL(url).path, resume)
        return RelayResponse(relay, [relay.aclose], trace.headers())

    @staticmethod
    async def _stream_start(raw: AsyncIterator[bytes], head: list[bytes], by_ids: bool) -> int:
        """Read a stream's chunks into `head` until its answer has begun (0) or an error came in its place (the
        code; 502 for a stream that ended, or broke off, with nothing); `by_ids`: see `stream_start`."""
        while True:
            try:
                chunk = await anext(raw, b"")
            except httpx.HTTPError as exc:  # the stream broke off: what came (if anything) is not an answer
                log.warning("a decode stream broke off before its answer began: %r", exc)
                return 502
            if not chunk:
                return 0 if head else 502
            head.append(chunk)
            verdict = stream_start(b"".join(head), by_ids)
            if verdict is not None:
                return verdict

    async def _whole_answer(self, state: InstanceState, upstream: httpx.Response, trace: RequestTrace,
                            last: bool) -> Response | None:
        """A plain answer, or an error status of a stream, read whole; None for a failure that may go again."""
        try:
            content = await upstream.aread()
        except httpx.HTTPError as exc:
            content = b""
            log.warning("decode instance %s broke off its answer: %r", state.instance.name, exc)
        finally:
            await _close(upstream)
            state.in_flight -= 1
        if (not content or upstream.status_code >= 500) and not last:
            state.failures += 1
            log.warning("decode instance %s answered %d (%d bytes)", state.instance.name, upstream.status_code,
                        len(content))
            return None
        # The whole answer came at once (vLLM sends a plain answer's headers with it): its first token is here.
        self.metrics.first_token(trace, time.monotonic() - trace.started)
        self.metrics.decode_seconds.observe(time.monotonic() - trace.started)
        if not content:
            self.metrics.requests.labels("decode_error").inc()
            return error_response(502, f"decode instance {state.instance.name} returned an empty answer", trace=trace)
        outcome = "ok" if upstream.status_code == 200 else "decode_error"
        self.metrics.requests.labels(outcome).inc()
        trace.finish(upstream.status_code, outcome)
        return Response(content, status_code=upstream.status_code, media_type="application/json",
                        headers=trace.headers())
