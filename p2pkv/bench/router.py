"""A router that drives instances with vLLM's standard disaggregation protocol, as llm-d's routing sidecar, vLLM
production-stack's router and the proxy of vLLM's NIXL tests do; not p2pkv's proxy, and it knows nothing of p2pkv.

For each request: (1) the client's body to a prefill instance (round robin) with `max_tokens` and
`max_completion_tokens` 1, `stream` false, no `stream_options`, an `X-Request-Id` header, and `kv_transfer_params`
`{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
"remote_host": null, "remote_port": null}`; (2) the client's body to a decode instance (round robin) with
`kv_transfer_params` replaced, verbatim, by what the prefill answer carried (left out when it carried none), its
answer relayed to the client as it comes. No heartbeats, no retries. `p2pkv bench serve --router standard` puts it
in front of a cluster; the integration tests drive real vLLM through it.

Run: `python -m p2pkv.bench.router --port 8000 --prefill http://HOST:PORT ... --decode http://HOST:PORT ...`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger(__name__)

STANDARD_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
PATHS = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill request's body: the client's, asking for one token, not streamed, with the standard params."""
    out = {key: value for key, value in body.items() if key != "stream_options"}
    out.update(max_tokens=1, max_completion_tokens=1, stream=False, kv_transfer_params=dict(STANDARD_PREFILL_PARAMS))
    return out


def decode_body(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any]:
    """The decode request's body: the client's, its `kv_transfer_params` those of the prefill answer, verbatim."""
    out = {key: value for key, value in body.items() if key != "kv_transfer_params"}
    params = prefill_answer.get("kv_transfer_params")
    if params:
        out["kv_transfer_params"] = params
    return out


class StandardRouter:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str], timeout_s: float = 600.0) -> None:
        if not prefill or not decode:
            raise ValueError("the router needs at least one prefill and one decode instance")
        self._prefill: Iterator[str] = itertools.cycle([url.rstrip("/") for url in prefill])
        self._decode: Iterator[str] = itertools.cycle([url.rstrip("/") for url in decode])
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application()
        for path in PATHS:
            app.router.add_post(path, self.handle)
        app.router.add_get("/health", self._health)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _open(self, _: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout)

    async def _close(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": "the body is not JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the body is not a JSON object"}, status=400)
        headers = {"X-Request-Id": request.headers.get("X-Request-Id") or str(uuid.uuid4())}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        prefill, decode = next(self._prefill), next(self._decode)
        try:
            async with self._session.post(prefill + request.path, json=prefill_body(body), headers=headers) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    return web.Response(status=resp.status, body=raw, content_type="application/json")
                answer = json.loads(raw)
            async with self._session.post(decode + request.path, json=decode_body(body, answer),
                                          headers=headers) as resp:
                out = web.StreamResponse(status=resp.status)
                out.content_type = resp.content_type
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("request %s failed upstream: %r", headers["X-Request-Id"], exc)
            return web.json_response({"error": f"upstream failed: {exc!r}"}, status=502)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m p2pkv.bench.router", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", nargs="+", required=True, help="prefill instances' base URLs")
    parser.add_argument("--decode", nargs="+", required=True, help="decode instances' base URLs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    web.run_app(StandardRouter(args.prefill, args.decode).app(), host=args.host, port=args.port,
                access_log=None, print=None)


if __name__ == "__main__":
    main()
