"""vLLM's controls for weight updates (an RL trainer's pause, cache reset and resume), sent by the proxy to every
instance in the order disaggregation needs.

vLLM serves them where its dev mode is on (`VLLM_SERVER_DEV_MODE=1`). Sent to each instance by hand they race:
a decode instance that pauses and clears its cache before a prefill instance has sent what it computed keeps KV
of the old weights, and a prefill instance pauses only once the blocks it holds for pulls are pulled or their
lease ends. Through the proxy:
- `POST /pause` pauses the prefill instances first (each returns once its pushes in flight are sent), then the
  decode instances; if one fails, those it paused are resumed. With `mode=abort` (vLLM's default) and the cache
  cleared, the prefill instances first reset their caches with the connector's, so they stop holding blocks for
  pulls that the abort makes moot;
- `POST /reset_prefix_cache` resets the prefill instances, then the decode instances;
- `POST /resume` resumes the decode instances, then the prefill instances;
- `GET /is_paused` asks them all;
- `POST /collective_rpc` (vLLM's: a method run on every worker, e.g. `reload_weights` from a checkpoint path) goes
  to every instance at once, with the client's body unchanged. Where it fails on some instances only, the proxy
  pairs no prefill instance with a decode instance on the other side of that split until an update reaches both.
They are admin routes (`p2pkv.proxy.admin`): what they send the instances carries the clients' key, never the
admin key. Each answers with every instance's answer, and 502 if any instance failed (503 with no instance known:
then nothing is paused). One request per API server (its data-parallel engines pause together). From a pause until
the resume, client requests wait at the proxy (at most their `request_timeout_s`, then 503), not in a paused
instance's queue, where their prefill would time out and go to a decode instance alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from p2pkv.params import Address
from p2pkv.proxy.admin import admin_refusal, instance_headers
from p2pkv.proxy.instances import ProxyConfig
from p2pkv.proxy.registry import Pool
from p2pkv.proxy.upstream import error_response

log = logging.getLogger(__name__)
CONTROL_TIMEOUT_S = 600.0  # a pause in mode=wait lasts as long as the longest request in flight


class Controlled(Protocol):
    """What of the proxy's router the controls use."""

    config: ProxyConfig
    client: httpx.AsyncClient
    prefill: Pool
    decode: Pool
    running: asyncio.Event  # cleared while paused: new requests wait at the proxy


def _servers(pool: Pool) -> list[Address]:
    return [state.instance.http for state in pool.servers()]


async def _send(router: Controlled, method: str, role: str, servers: list[Address], path: str,
                params: dict[str, str], headers: dict[str, str], body: bytes | None = None) -> list[dict[str, Any]]:
    if body is not None:
        headers = {**headers, "content-type": "application/json"}

    async def one(server: Address) -> dict[str, Any]:
        answer: dict[str, Any] = {"instance": str(server), "role": role}
        try:
            resp = await router.client.request(method, f"http://{server}{path}", params=params, headers=headers,
                                               content=body, timeout=CONTROL_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return {**answer, "status_code": 502, "error": f"{type(exc).__name__}: {exc}"}
        try:
            answered: Any = resp.json()
        except ValueError:
            answered = resp.text
        return {**answer, "status_code": resp.status_code, "body": answered}

    return list(await asyncio.gather(*(one(server) for server in servers)))


def _ok(answers: list[dict[str, Any]]) -> bool:
    return all(a["status_code"] == 200 for a in answers)


def _answer(key: str, value: Any, answers: list[dict[str, Any]]) -> Response:
    if not answers:
        return error_response(503, "no instances known to the proxy")
    failed = not _ok(answers)
    return JSONResponse({key: value, "instances": answers}, status_code=502 if failed else 200)


def _truthy(value: str | None, default: bool) -> bool:
    return default if value is None else value.lower() in ("1", "true", "yes", "on")


async def pause(router: Controlled, request: Request) -> Response:
    params = dict(request.query_params)
    headers = instance_headers(router.config.api_key)
    prefill, decode = _servers(router.prefill), _servers(router.decode)
    if not prefill and not decode:  # nothing to pause: requests must not wait for a resume
        return _answer("status", "failed", [])
    answers: list[dict[str, Any]] = []
    router.running.clear()  # from now on, new requests wait here for the resume
    if params.get("mode", "abort") == "abort" and _truthy(params.get("clear_cache"), True):
        # Blocks held for pulls would keep each prefill instance busy until their lease ends; the abort makes
        # those pulls moot. vLLM's reset fails while the blocks are held: its answer is not the pause's.
        await _send(router, "POST", "prefill", prefill, "/reset_prefix_cache", {"reset_external": "true"}, headers)
    answers += await _send(router, "POST", "prefill", prefill, "/pause", params, headers)
    if _ok(answers):
        answers += await _send(router, "POST", "decode", decode, "/pause", params, headers)
    if not _ok(answers):
        # Not paused: no instance is left paused either (requests would wait there, each until its prefill timed
        # out), and the requests held here go on. A retry of the pause holds them again.
        paused = [Address.parse(a["instance"]) for a in answers if a["status_code"] == 200]
        await _send(router, "POST", "rollback", paused, "/resume", {}, headers)
        router.running.set()
    return _answer("status", "paused" if _ok(answers) else "failed", answers)


async def reset_prefix_cache(router: Controlled, request: Request) -> Response:
    params, headers = dict(request.query_params), instance_headers(router.config.api_key)
    answers = await _send(router, "POST", "prefill", _servers(router.prefill), "/reset_prefix_cache", params, headers)
    answers += await _send(router, "POST", "decode", _servers(router.decode), "/reset_prefix_cache", params, headers)
    success = _ok(answers) and all(isinstance(a["body"], dict) and a["body"].get("success") for a in answers)
    return _answer("success", success, answers)


async def resume(router: Controlled, request: Request) -> Response:
    headers = instance_headers(router.config.api_key)
    answers = await _send(router, "POST", "decode", _servers(router.decode), "/resume", {}, headers)
    answers += await _send(router, "POST", "prefill", _servers(router.prefill), "/resume", {}, headers)
    router.running.set()  # an instance that failed to resume queues what it gets; the others serve
    return _answer("status", "resumed" if _ok(answers) else "failed", answers)


async def is_paused(router: Controlled, request: Request) -> Response:
    headers = instance_headers(router.config.api_key)
    answers = await _send(router, "GET", "prefill", _servers(router.prefill), "/is_paused", {}, headers)
    answers += await _send(router, "GET", "decode", _servers(router.decode), "/is_paused", {}, headers)
    paused = _ok(answers) and all(isinstance(a["body"], dict) and a["body"].get("is_paused") for a in answers)
    return _answer("is_paused", paused, answers)


async def collective_rpc(router: Controlled, request: Request) -> Response:
    """Every instance runs the method (each its own weights, so all at once). The body is vLLM's to check. Where
    it failed on some instances only, their weights may now differ from the others': see `took_update`."""
    body, headers = await request.body(), instance_headers(router.config.api_key)
    prefill, decode = await asyncio.gather(
        _send(router, "POST", "prefill", _servers(router.prefill), "/collective_rpc", {}, headers, body),
        _send(router, "POST", "decode", _servers(router.decode), "/collective_rpc", {}, headers, body))
    answers = prefill + decode
    took_update(router, _method(body), answers)
    return _answer("status", "done" if _ok(answers) else "failed", answers)


def took_update(router: Controlled, method: str, answers: list[dict[str, Any]]) -> None:
    """A method run on every worker may change the weights (`reload_weights` does). The instances where it
    succeeded are marked as having taken this update, the others keep their mark, and instances of different
    marks are not paired (`p2pkv.proxy.pairs`): KV computed with other weights would make the decode instance
    answer as neither model does, without an error. Where it succeeded everywhere, or nowhere, the marks still
    match. An update through the proxy that reaches them all matches them again."""
    done = {a["instance"] for a in answers if a["status_code"] == 200}
    if not done:
        return
    mark = f"{method} {uuid.uuid4().hex[:8]}"
    for pool in (router.prefill, router.decode):
        for state in pool.states:
            if str(state.instance.http) in done:
                state.weights = mark
    failed = sorted({a["instance"] for a in answers} - done)
    if failed:
        log.warning("collective_rpc %s failed on %s and succeeded on %s: their weights may differ, so prefill and "
                    "decode instances of the two groups are not paired until an update reaches them all",
                    method, ", ".join(failed), ", ".join(sorted(done)))


def _method(body: bytes) -> str:
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return "collective_rpc"
    method = parsed.get("method") if isinstance(parsed, dict) else None
    return method[:64] if isinstance(method, str) and method else "collective_rpc"


def add_control_routes(app: FastAPI) -> None:
    handlers = {"/pause": (pause, "POST"), "/resume": (resume, "POST"),
                "/reset_prefix_cache": (reset_prefix_cache, "POST"), "/is_paused": (is_paused, "GET"),
                "/collective_rpc": (collective_rpc, "POST")}
    for path, (handler, method) in handlers.items():
        app.add_api_route(path, _endpoint(handler), methods=[method], include_in_schema=False)


def _endpoint(handler: Any) -> Any:
    async def endpoint(request: Request) -> Response:
        router: Controlled = request.app.state.router
        refusal = admin_refusal(request, router.config.admin_key)
        if refusal is not None:
            return refusal
        response: Response = await handler(router, request)
        return response
    return endpoint
