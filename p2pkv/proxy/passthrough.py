"""Endpoints that touch no KV, passed on to a decode instance: the model list, tokenizing, the version, token counts,
and stored responses (OpenAI's Responses API keeps them on the instance that made them)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from p2pkv.proxy.prefill import MESSAGES, RESPONSES
from p2pkv.proxy.registry import InstanceState, Pool
from p2pkv.proxy.upstream import error_response

_LOOKUP_TIMEOUT_S = 10.0  # asking a decode instance whether it holds a stored response
_PLAIN = (("/v1/models", "GET"), ("/version", "GET"), ("/tokenize", "POST"), ("/detokenize", "POST"),
          (MESSAGES + "/count_tokens", "POST"))


class Routing(Protocol):
    """What of the proxy's router these endpoints use."""

    client: httpx.AsyncClient
    decode: Pool

    def authorized(self, request: Request) -> bool: ...


def forward_headers(request: Request) -> dict[str, str]:
    """The client's headers that go on to an instance: its API key."""
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth else {}


async def holder(router: Routing, response_id: Any, headers: dict[str, str]) -> InstanceState | None:
    """The decode instance whose response store holds this response (Responses API), if one does: asked of each
    in turn."""
    if not isinstance(response_id, str) or not response_id or "/" in response_id:
        return None
    for state in router.decode.servers():
        try:
            resp = await router.client.get(f"{state.instance.url}{RESPONSES}/{response_id}",
                                           headers=state.instance.headers(headers),
                                           timeout=_LOOKUP_TIMEOUT_S)
        except httpx.HTTPError:
            continue
        if resp.status_code == 200:
            return state
    return None


async def forward(request: Request, path: str, find: bool = False) -> Response:
    """The first decode instance that answers, answers. With `find`, for something one decode instance holds (a
    stored response): the first that does not answer 404."""
    router: Routing = request.app.state.router
    if not router.authorized(request):
        return error_response(401, "missing or wrong API key", "authentication_error")
    body = await request.body() if request.method == "POST" else None
    headers = forward_headers(request)
    if body is not None:
        headers["content-type"] = request.headers.get("content-type", "application/json")
    missing: Response | None = None
    for state in router.decode.servers():
        try:
            resp = await router.client.request(request.method, f"{state.instance.url}{path}", content=body,
                                               headers=state.instance.headers(headers),
                                               params=request.query_params)
        except httpx.HTTPError:
            continue
        answer = Response(resp.content, status_code=resp.status_code,
                          media_type=resp.headers.get("content-type", "application/json"))
        if not (find and resp.status_code == 404):
            return answer
        missing = answer
    return missing or error_response(502, f"no decode instance answered {path}")


def _forwarder(path: str) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await forward(request, path)
    return endpoint


def add_passthrough_routes(app: FastAPI) -> None:
    for path, method in _PLAIN:
        app.add_api_route(path, _forwarder(path), methods=[method], include_in_schema=False)

    @app.get(RESPONSES + "/{response_id}")
    async def stored_response(request: Request, response_id: str) -> Response:
        return await forward(request, f"{RESPONSES}/{response_id}", find=True)

    @app.post(RESPONSES + "/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        return await forward(request, f"{RESPONSES}/{response_id}/cancel", find=True)
