"""Stub OpenAI backends for the proxy's tests: real HTTP apps that record what they were sent."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def stub_prefill(seen: list[dict[str, Any]], fail: bool = False) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    @app.post("/v1/responses")
    @app.post("/v1/messages")
    async def complete(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append({"body": body, "auth": request.headers.get("authorization"), "path": request.url.path,
                     "dp_rank": request.headers.get("x-data-parallel-rank")})
        if fail:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        tid = body["kv_transfer_params"]["transfer_id"]
        params = {"p2pkv": 1, "transfer_id": tid, "load_remote_kv": True, "num_prompt_tokens": 5}
        return JSONResponse({"choices": [{"text": "x"}], "kv_transfer_params": params})

    return app


ENGINE_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                          "code": 500}}  # how vLLM ends a request that failed in the engine (lost KV, policy fail)


CHAT_PREAMBLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}


def stub_decode(seen: list[dict[str, Any]], tp_size: int = 0, pp_size: int = 0, first_token_s: float = 0.0,
                failures: list[str] | None = None, stored: tuple[str, ...] = (),
                dp_ranks: list[str | None] | None = None, lookups: list[str] | None = None,
                pulls: bool = False) -> FastAPI:
    """A decode backend; its probe answer says `tp_size` and `pp_size` when given (a p2pkv connector older than
    that does not). A stream's headers go out at once and its first chunk `first_token_s` later, as vLLM's do.
    `failures`: how the next requests fail, one entry each, as vLLM fails them: "500" (a plain answer), "error"
    (a stream opened with an error event), "late" (a stream whose error comes after a token), "400". `stored`: the
    ids of the Responses API answers it holds. `dp_ranks`: gets each request's `X-data-parallel-rank` header.
    `lookups`: gets the id of each stored response asked for. `pulls`: its probe answer says it pulls its KV."""
    app = FastAPI()
    failures = failures if failures is not None else []

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": "tiny"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await request.json()
        seen.append({"tokenize": body, "auth": request.headers.get("authorization")})
        return {"tokens": [ord(c) for c in body["prompt"]], "count": len(body["prompt"])}

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> Any:
        if lookups is not None:
            lookups.append(response_id)
        if response_id not in stored:
            return JSONResponse({"error": {"message": "not found", "code": 404}}, status_code=404)
        return {"id": response_id, "object": "response", "status": "completed"}

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    @app.post("/v1/responses")
    @app.post("/v1/messages")
    async def complete(request: Request) -> Any:
        body = await request.json()
        params = body.get("kv_transfer_params") or {}
        if params.get("probe"):
            answer: dict[str, Any] = {"p2pkv": 1, "kv_port": 23456, "kv_host": ""}
            if tp_size:
                answer["tp_size"] = tp_size
            if pp_size:
                answer["pp_size"] = pp_size
            if pulls:
                answer["pulls"] = True
            return {"choices": [{"text": ""}], "kv_transfer_params": answer}
        seen.append(body)
        if dp_ranks is not None:
            dp_ranks.append(request.headers.get("x-data-parallel-rank"))
        failure = failures.pop(0) if failures else ""
        if failure in ("500", "400"):
            error = {"error": {**ENGINE_ERROR["error"], "code": int(failure)}}
            return JSONResponse(error, status_code=int(failure))
        if body.get("stream"):
            async def events() -> AsyncIterator[bytes]:
                if "messages" in body:  # a chat stream names the role first, before any token
                    yield f"data: {json.dumps(CHAT_PREAMBLE)}\n\n".encode()
                await asyncio.sleep(first_token_s)
                for i, word in enumerate(("a", "b", "c")):
                    if failure == "error" or (failure == "late" and i == 1):
                        yield f"data: {json.dumps(ENGINE_ERROR)}\n\n".encode()
                        break
                    choice = {"text": word, "index": 0, "prompt_seen": body.get("prompt")}
                    yield f"data: {json.dumps({'id': f'cmpl-{id(body)}', 'choices': [choice]})}\n\n".encode()
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield f"data: {json.dumps({'id': 'u', 'choices': [], 'usage': USAGE})}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        n = body.get("n") or 1
        return {"choices": [{"text": "abc", "index": i, "prompt_seen": body.get("prompt")} for i in range(n)],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3 * n, "prompt_tokens_details": {"cached_tokens": 4,
                                                                                                   "other": None}}}

    return app


@dataclass
class Observed:
    """What a slow stub saw: a request started, and whether its client (the proxy) went away before the end."""

    started: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)  # lets a held stream finish
    cancelled: threading.Event = field(default_factory=threading.Event)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    discards: list[dict[str, Any]] = field(default_factory=list)  # the proxy's discard requests, answered at once
    closed_early: list[Any] = field(default_factory=list)  # the prompt of each stream closed before its end


USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


async def _until_disconnected(request: Request, obs: Observed, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if await request.is_disconnected():
            obs.cancelled.set()
            return
        await asyncio.sleep(0.02)


def stub_slow(obs: Observed, kv_port: int = 23456) -> FastAPI:
    """A backend that holds its answers: a stream sends its first chunk and waits for `obs.release`; a plain
    request waits until its client disconnects (or 20 s). Records disconnects in `obs.cancelled`."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": "tiny"}]}

    @app.post("/v1/completions")
    async def complete(request: Request) -> Any:
        body = await request.json()
        if (body.get("kv_transfer_params") or {}).get("probe"):
            return {"choices": [{"text": ""}], "kv_transfer_params": {"p2pkv": 1, "kv_port": kv_port, "kv_host": ""}}
        if (body.get("kv_transfer_params") or {}).get("discard_transfer"):
            obs.discards.append(body)
            return {"choices": [{"text": "x"}]}
        obs.bodies.append(body)
        obs.started.set()
        if not body.get("stream"):
            await _until_disconnected(request, obs)
            return {"choices": [{"text": "late"}]}

        async def events() -> AsyncIterator[bytes]:
            finished = False
            try:
                yield f"data: {json.dumps({'choices': [{'text': 'a'}]})}\n\n".encode()
                deadline = time.monotonic() + 20
                while not obs.release.is_set() and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                yield f"data: {json.dumps({'choices': [{'text': 'b'}]})}\n\n".encode()
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield f"data: {json.dumps({'choices': [], 'usage': USAGE})}\n\n".encode()
                yield b"data: [DONE]\n\n"
                finished = True
            finally:
                if not finished:
                    obs.closed_early.append(body.get("prompt"))
                    obs.cancelled.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def streaming_decode(paths: tuple[str, ...], events: Callable[[str, dict[str, Any]], AsyncIterator[bytes]],
                     seen: list[dict[str, Any]] | None = None) -> FastAPI:
    """A decode backend whose answers on `paths` are the event streams `events(path, body)` gives (each body, with
    its `path`, goes to `seen`); it answers the proxy's KV-address probe and `/v1/models`."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": "tiny"}]}

    async def complete(request: Request) -> Any:
        body = await request.json()
        if (body.get("kv_transfer_params") or {}).get("probe"):
            return {"choices": [{"text": ""}], "kv_transfer_params": {"p2pkv": 1, "kv_port": 23456}}
        if seen is not None:
            seen.append({**body, "path": request.url.path})
        return StreamingResponse(events(request.url.path, body), media_type="text/event-stream")

    for path in paths:
        app.post(path)(complete)
    return app


def failing_relay(target: str, failing: str, answers: list[str]) -> FastAPI:
    """In front of a real server at `target` (host:port): every request is passed on and its answer passed back,
    except POSTs to the path `failing`, answered with a 500 as vLLM answers a worker method that raised (say, a
    checkpoint this host cannot read), without reaching the server. `answers` records each path it failed."""
    client = httpx.AsyncClient(base_url=f"http://{target}", timeout=300)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def relay(path: str, request: Request) -> Response:
        if request.method == "POST" and f"/{path}" == failing:
            answers.append(failing)
            return JSONResponse({"error": {"message": "checkpoint not readable on this host", "code": 500}},
                                status_code=500)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        resp = await client.request(request.method, f"/{path}", params=dict(request.query_params),
                                    headers=headers, content=await request.body())
        passed = {k: v for k, v in resp.headers.items()
                  if k.lower() not in ("content-length", "content-encoding", "transfer-encoding", "connection")}
        return Response(resp.content, status_code=resp.status_code, headers=passed)

    return app


def with_controls(app: FastAPI, name: str, calls: list[dict[str, Any]]) -> FastAPI:
    """`app` with vLLM's dev-mode controls added, each call recorded (instance, path, Authorization, body)."""

    async def record(request: Request) -> JSONResponse:
        body = (await request.body()).decode(errors="replace")
        calls.append({"name": name, "path": request.url.path, "auth": request.headers.get("authorization"),
                      "body": body})
        return JSONResponse({"status": "ok", "success": True, "is_paused": False, "results": []})

    for path in ("/pause", "/resume", "/reset_prefix_cache", "/collective_rpc"):
        app.add_api_route(path, record, methods=["POST"])
    app.add_api_route("/is_paused", record, methods=["GET"])
    return app
