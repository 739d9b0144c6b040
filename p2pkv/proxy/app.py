"""The proxy app: its routes (completions and chat through the `Router`, passthrough, control, metrics) and its
lifetime (discovery listener, probes of static instances, the upstream client)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from p2pkv.config import AUTH_SECRET_ENV
from p2pkv.proxy.admin import admin_refusal
from p2pkv.proxy.cachehits import CacheHits
from p2pkv.proxy.control import add_control_routes
from p2pkv.proxy.discovery import DiscoveryListener, start
from p2pkv.proxy.instances import ProxyConfig
from p2pkv.proxy.kvevents import EventFeeds
from p2pkv.proxy.limits import BodyLimit
from p2pkv.proxy.metrics import ProxyMetrics
from p2pkv.proxy.passthrough import add_passthrough_routes
from p2pkv.proxy.poll import StaticPoller
from p2pkv.proxy.prefill import MESSAGES, RESPONSES
from p2pkv.proxy.router import Router
from p2pkv.proxy.transport import upstream_client
from p2pkv.proxy.upstream import error_response

log = logging.getLogger(__name__)
_DETOKENIZE_S = 10.0  # for an instance to detokenize a broken-off stream's tokens (`Progress.settle`)


async def _client_gone(request: Request) -> None:
    """Return once the client disconnects (the request body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(config: ProxyConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with upstream_client(config.request_timeout_s, config.connect_timeout_s) as client:
            router = Router(config, client, ProxyMetrics())
            app.state.router = router
            task: asyncio.Task[None] | None = None
            if config.discovery_port:
                host = config.discovery_bind
                if config.unauthenticated_beyond_loopback:  # only with --allow-unauthenticated-discovery
                    log.warning("UNAUTHENTICATED DISCOVERY on %s:%d (--allow-unauthenticated-discovery): anyone who "
                                "reaches this port can add instances that receive client requests, or take over "
                                "expired ones; set %s on the proxy and the instances instead", host,
                                config.discovery_port, AUTH_SECRET_ENV)
                listener = DiscoveryListener(host, config.discovery_port, config.secret.encode(), router.announce,
                                             router.metrics.heartbeats.labels("refused").inc)
                task = start(listener)
            feeds: asyncio.Task[None] | None = None
            if config.prefill_policy == "prefix" or config.decode_only_below:
                feeds = asyncio.create_task(EventFeeds(router.index, router.metrics, lambda: [
                    s for pool in router.pools for s in pool.states]).run(), name="p2pkv-kv-events")
            hits = asyncio.create_task(CacheHits(client, router.metrics, lambda: [
                s for pool in router.pools for s in pool.states]).run(), name="p2pkv-cache-hits")
            poller: asyncio.Task[None] | None = None
            if config.probe_interval_s:  # each probe bounded by the interval, or 10 s for shorter ones
                poller = asyncio.create_task(StaticPoller(
                    lambda: [s for pool in router.pools for s in pool.states], router.static_probe, router.probed,
                    config.probe_interval_s, max(10.0, config.probe_interval_s)).run())
            try:
                yield
            finally:
                for running in (task, poller, feeds, hits):
                    if running is not None:
                        running.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await running

    app = FastAPI(title="p2pkv proxy", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=int(config.max_body_mb * (1 << 20)), timeout_s=config.body_timeout_s,
                       keys=(config.api_key, config.admin_key) if config.api_key else ())

    async def route(request: Request, path: str) -> Response:
        router: Router = request.app.state.router
        if not router.authorized(request):
            return error_response(401, "missing or wrong API key", "authentication_error")
        await request.body()  # read whole, so the next receive() can only be the client going away
        handler = asyncio.current_task()
        assert handler is not None
        gone = asyncio.Event()

        async def watch() -> None:
            await _client_gone(request)
            gone.set()
            handler.cancel()  # closes whichever upstream request the handler is waiting on (prefill or decode)

        watcher = asyncio.create_task(watch())
        try:
            return await router.handle(request, path)
        except asyncio.CancelledError:
            if not gone.is_set():
                raise
            handler.uncancel()
            router.metrics.requests.labels("client_gone").inc()
            log.info("client went away; its upstream requests were cancelled")
            return Response(status_code=499)
        finally:
            watcher.cancel()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route(request, "/v1/chat/completions")

    @app.post(RESPONSES)
    async def responses(request: Request) -> Response:
        return await route(request, RESPONSES)

    @app.post(MESSAGES)
    async def messages(request: Request) -> Response:
        return await route(request, MESSAGES)

    add_passthrough_routes(app)
    add_control_routes(app)

    @app.get("/instances")
    async def instances(request: Request) -> Response:
        router: Router = request.app.state.router
        refusal = admin_refusal(request, config.admin_key)
        if refusal is not None:
            return refusal
        for pool in router.pools:
            pool.prune()
        return JSONResponse({"instances": [s.describe() for pool in router.pools for s in pool.states]})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        router: Router = request.app.state.router
        refusal = admin_refusal(request, config.admin_key)
        if refusal is not None:
            return refusal
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app
