"""The proxy app factory: prefill with `max_tokens=1`, then decode with the `kv_transfer_params` it returned."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from p2pkv.params import Address, PrefillParams, ProbeParams
from p2pkv.proxy.instances import Instance, ProxyConfig, RoundRobin

log = logging.getLogger(__name__)
_DROP_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


def _error(status: int, message: str, kind: str = "proxy_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _forward_headers(request: Request) -> dict[str, str]:
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth else {}


class Router:
    """Per-app state: the HTTP client, the pairing policies and the learned KV addresses."""

    def __init__(self, config: ProxyConfig, client: httpx.AsyncClient) -> None:
        self.config = config
        self.client = client
        self.prefill = RoundRobin(config.prefill)
        self.decode = RoundRobin(config.decode)
        self._kv: dict[Instance, Address] = {d: d.kv for d in config.decode if d.kv is not None}

    async def kv_address(self, instance: Instance, headers: dict[str, str]) -> Address:
        """The decode instance's KV address; asked of the instance itself once when not configured."""
        known = self._kv.get(instance)
        if known is not None:
            return known
        models = await self.client.get(f"{instance.url}/v1/models", headers=headers)
        models.raise_for_status()
        model = models.json()["data"][0]["id"]
        probe = {"model": model, "prompt": [0], "max_tokens": 1,
                 "kv_transfer_params": ProbeParams().to_dict()}
        resp = await self.client.post(f"{instance.url}/v1/completions", json=probe, headers=headers)
        resp.raise_for_status()
        answer = resp.json().get("kv_transfer_params") or {}
        if not isinstance(answer.get("kv_port"), int):
            raise RuntimeError(f"{instance.http} did not report a KV port; is it running the p2pkv connector?")
        address = Address(answer.get("kv_host") or instance.http.host, answer["kv_port"])
        self._kv[instance] = address
        log.info("decode instance %s has its KV port at %s", instance.http, address)
        return address

    async def handle(self, request: Request, path: str) -> Response:
        try:
            body: Any = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        headers = _forward_headers(request)
        transfer_id = uuid.uuid4().hex
        prefill, decode = self.prefill.pick(), self.decode.pick()
        try:
            decode_kv: Address | None = await self.kv_address(decode, headers)
        except (httpx.HTTPError, RuntimeError, KeyError, IndexError, ValueError) as exc:
            # Without the decode side's KV address the prefill side cannot push; it holds the KV for a pull.
            log.warning("decode instance %s did not report its KV address (%s); using GET", decode.http, exc)
            decode_kv = None
        pre = dict(body)
        pre.update(max_tokens=1, stream=False, kv_transfer_params=PrefillParams(transfer_id, decode_kv).to_dict())
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        for key in _DROP_FOR_PREFILL:
            pre.pop(key, None)
        try:
            answer = await self.client.post(f"{prefill.url}{path}", json=pre, headers=headers)
        except httpx.HTTPError as exc:
            return _error(502, f"prefill instance {prefill.http} failed: {exc!r}")
        if answer.status_code != 200:
            return Response(answer.content, status_code=answer.status_code, media_type="application/json")
        kv_params = answer.json().get("kv_transfer_params")
        if not isinstance(kv_params, dict):
            return _error(502, f"prefill instance {prefill.http} returned no kv_transfer_params")
        log.info("transfer %s prefill=%s decode=%s", transfer_id, prefill.http, decode.http)
        body["kv_transfer_params"] = kv_params
        if body.get("stream"):
            return await self._stream(f"{decode.url}{path}", body, headers)
        try:
            final = await self.client.post(f"{decode.url}{path}", json=body, headers=headers)
        except httpx.HTTPError as exc:
            return _error(502, f"decode instance {decode.http} failed: {exc!r}")
        return Response(final.content, status_code=final.status_code, media_type="application/json")

    async def _stream(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        try:
            upstream = await self.client.send(self.client.build_request("POST", url, json=body, headers=headers),
                                              stream=True)
        except httpx.HTTPError as exc:
            return _error(502, f"decode instance failed: {exc!r}")
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, status_code=upstream.status_code, media_type="application/json")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(chunks(), media_type="text/event-stream")


def create_app(config: ProxyConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            app.state.router = Router(config, client)
            yield

    app = FastAPI(title="p2pkv proxy", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        router: Router = request.app.state.router
        return await router.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        router: Router = request.app.state.router
        return await router.handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        router: Router = request.app.state.router
        try:
            resp = await router.client.get(f"{config.decode[0].url}/v1/models", headers=_forward_headers(request))
        except httpx.HTTPError as exc:
            return _error(502, f"decode instance unavailable: {exc!r}")
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app
