"""The proxy's HTTP transport: httpx's client interface (requests, responses, errors, timeouts) over aiohttp's
connection pool and HTTP/1.1 parser.

Why: httpx's own transport (httpcore on anyio) cost about 0.75 ms of CPU per call against 0.22 ms for aiohttp, on
this project's stub backends (one process, uvloop, sequential POSTs), and the proxy makes two calls per request
(`docs/design.md`, "Parts"). The rest of the proxy keeps httpx's types: the choice stays in this module.

Failures come out as httpx's exceptions, which the proxy's routing tells apart: a connection that could not be
made (refused, reset as it was set up: an instance killed under load) is `httpx.ConnectError`, that instance
failing; a connect or read deadline passed is a `httpx.TimeoutException`; a peer that closed the connection early
or spoke broken HTTP is `httpx.RemoteProtocolError`; other faults of the socket are `httpx.ReadError`. Bodies are
passed through as they came (no decompression here: httpx decodes)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from http.cookiejar import CookieJar, DefaultCookiePolicy

import aiohttp
import httpx
from yarl import URL

# Headers aiohttp sets itself from the body it is given (the proxy's request bodies are always whole bytes).
_BODY_HEADERS = frozenset({"content-length", "transfer-encoding"})


def upstream_client(request_timeout_s: float, connect_timeout_s: float,
                    max_connections: int = 1024) -> httpx.AsyncClient:
    """The proxy's client for its instances. It keeps no cookies: one an instance set would otherwise go back to
    it with every later request, whichever client made it (the client's own cookies are forwarded per request).
    Nothing comes from the environment (`HTTP_PROXY` and the like, `.netrc`): instances are reached directly."""
    return httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=connect_timeout_s),
                             transport=UpstreamTransport(max_connections), trust_env=False,
                             cookies=CookieJar(DefaultCookiePolicy(allowed_domains=[])))


class UpstreamTransport(httpx.AsyncBaseTransport):
    """`keepalive_s`: how long an idle connection is kept for the next request; under the 5 s after which uvicorn
    (vLLM's server) closes one, so that a request rarely goes out on a connection its server is closing."""

    def __init__(self, max_connections: int = 1024, keepalive_s: float = 4.0) -> None:
        self._max_connections = max_connections
        self._keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None  # made in the event loop, on the first request

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0,
                                             keepalive_timeout=self._keepalive_s)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False, trust_env=False,
                                                  cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(total=None, connect=timeouts.get("pool"),
                                        sock_connect=timeouts.get("connect"), sock_read=timeouts.get("read"))
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in _BODY_HEADERS]
        body = await request.aread()
        try:
            # The URL as httpx encoded it (`encoded`: yarl does not quote it again).
            resp = await self._get_session().request(request.method, URL(str(request.url), encoded=True),
                                                     data=body or None, headers=headers, allow_redirects=False,
                                                     timeout=timeout)
        except (aiohttp.ClientError, OSError) as exc:
            raise _as_httpx(exc, request) from exc
        return httpx.Response(resp.status, headers=resp.raw_headers, stream=_Body(resp, request), request=request,
                              extensions={"http_version": b"HTTP/1.1", "reason_phrase": (resp.reason or "").encode()})

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


class _Body(httpx.AsyncByteStream):
    """A response body as it arrives; closed before its end, its connection is closed, not reused half read."""

    def __init__(self, resp: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._resp = resp
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, OSError) as exc:
            raise _as_httpx(exc, self._request) from exc

    async def aclose(self) -> None:
        self._resp.release()  # back to the pool if the body was read to its end; closed otherwise


def _as_httpx(exc: aiohttp.ClientError | OSError, request: httpx.Request) -> httpx.TransportError:
    """httpx's exception for a failure of aiohttp, or of the socket under it. Only a connection that could not be
    made is a connect error (the instance is shunned, a decode request not sent again); a connection reset or closed
    after it was made, as a pooled one its server closed as the request went out, is not."""
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, (aiohttp.ServerTimeoutError, TimeoutError)):
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientResponseError)):
        return httpx.RemoteProtocolError(message, request=request)
    return httpx.ReadError(message, request=request)
