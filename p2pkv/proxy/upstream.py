"""The decode request and its answer on the way back to the client. The answer is passed on as it comes, except
that a failure before any of it went out is reported instead (None), so that the request can go again. vLLM
answers a request that failed inside the engine (KV that could not be loaded under `kv_load_failure_policy=fail`,
for one) with status 500, or, for a stream whose headers already went, with an event `data: {"error": {...,
"code": 500}}` in place of the first token; so while the request may still go again, a stream's first chunk is read
before the client is answered."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from p2pkv.proxy.metrics import ProxyMetrics
from p2pkv.proxy.registry import InstanceState
from p2pkv.proxy.trace import RequestTrace

log = logging.getLogger(__name__)


def stream_error(first_chunk: bytes) -> int:
    """The error code (5xx) a stream's first chunk carries in place of its first token; 0 when it carries none
    (tokens, a 4xx, or an event that does not fit in the chunk, which is then passed on as it is)."""
    text = first_chunk.decode("utf-8", errors="replace").lstrip()
    if not text.startswith("data:"):
        return 0
    line = text[len("data:"):].split("\n", 1)[0].strip()
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return 0
    error = event.get("error") if isinstance(event, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    return code if isinstance(code, int) and not isinstance(code, bool) and code >= 500 else 0


def error_response(status: int, message: str, kind: str = "proxy_error",
                   trace: RequestTrace | None = None) -> JSONResponse:
    """An OpenAI-style error answer; with `trace`, the request's line is logged and its headers go with it."""
    if trace is not None:
        trace.finish(status, kind)
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=trace.headers() if trace is not None else None)


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
        except httpx.TimeoutException:
            raise
        except httpx.TransportError as exc:
            log.warning("decode instance %s: %r; sending once more on a new connection", state.instance.http, exc)
            self.metrics.decode_resends.inc()
        return await self.client.send(self.client.build_request("POST", url, json=body, headers=headers),
                                      stream=True)

    async def answer(self, state: InstanceState, url: str, body: dict[str, Any], headers: dict[str, str],
                      trace: RequestTrace, last: bool = True) -> Response | None:
        """The decode instance's answer, for the client; None when it failed before any of it went out and the
        request may go again (not `last`)."""
        started = trace.started
        state.in_flight += 1
        try:
            upstream = await self._send_decode(state, url, body, headers)
        except httpx.TimeoutException as exc:
            state.in_flight -= 1
            self.metrics.requests.labels("decode_error").inc()
            return error_response(504, f"decode instance {state.instance.http} timed out: {exc!r}", trace=trace)
        except httpx.HTTPError as exc:
            state.in_flight -= 1
            state.failures += 1
            log.warning("decode instance %s failed: %r", state.instance.http, exc)
            if not last:
                return None
            self.metrics.requests.labels("decode_error").inc()
            return error_response(502, f"decode instance {state.instance.http} failed: {exc!r}", trace=trace)
        except asyncio.CancelledError:  # the client went away
            state.in_flight -= 1
            raise
        if upstream.status_code != 200 or not body.get("stream"):
            return await self._whole_answer(state, upstream, trace, last)
        raw = upstream.aiter_raw()
        first = b""
        if not last:  # read the first chunk before answering: a failure there may still go again
            try:
                first = await anext(raw, b"")
            except BaseException:
                await upstream.aclose()
                state.in_flight -= 1
                raise
            error = stream_error(first) if first else 502
            if error:
                await upstream.aclose()
                state.in_flight -= 1
                state.failures += 1
                log.warning("decode instance %s opened its stream with error %d", state.instance.http, error)
                return None
            self.metrics.ttft_seconds.observe(time.monotonic() - started)

        async def chunks() -> AsyncIterator[bytes]:
            # Cancelled when the client goes away, which closes the upstream request too.
            outcome, timed = "broken_off", bool(first)
            try:
                if first:
                    yield first
                async for chunk in raw:
                    if not timed:  # a stream's headers come before its first token (vLLM sends them at once)
                        timed = True
                        self.metrics.ttft_seconds.observe(time.monotonic() - started)
                    yield chunk
                self.metrics.requests.labels("ok").inc()
                outcome = "ok"
            finally:
                await upstream.aclose()
                state.in_flight -= 1
                self.metrics.decode_seconds.observe(time.monotonic() - started)
                trace.finish(200, outcome)

        return StreamingResponse(chunks(), media_type="text/event-stream", headers=trace.headers())

    async def _whole_answer(self, state: InstanceState, upstream: httpx.Response, trace: RequestTrace,
                            last: bool) -> Response | None:
        """A plain answer, or an error status of a stream, read whole; None for a failure that may go again."""
        try:
            content = await upstream.aread()
        except httpx.HTTPError as exc:
            content = b""
            log.warning("decode instance %s broke off its answer: %r", state.instance.http, exc)
        finally:
            await upstream.aclose()
            state.in_flight -= 1
        if (not content or upstream.status_code >= 500) and not last:
            state.failures += 1
            log.warning("decode instance %s answered %d (%d bytes)", state.instance.http, upstream.status_code,
                        len(content))
            return None
        # The whole answer came at once (vLLM sends a plain answer's headers with it): its first token is here.
        self.metrics.ttft_seconds.observe(time.monotonic() - trace.started)
        self.metrics.decode_seconds.observe(time.monotonic() - trace.started)
        if not content:
            self.metrics.requests.labels("decode_error").inc()
            return error_response(502, f"decode instance {state.instance.http} returned an empty answer", trace=trace)
        outcome = "ok" if upstream.status_code == 200 else "decode_error"
        self.metrics.requests.labels(outcome).inc()
        trace.finish(upstream.status_code, outcome)
        return Response(content, status_code=upstream.status_code, media_type="application/json",
                        headers=trace.headers())
