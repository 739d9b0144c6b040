"""The proxy's HTTP transport: httpx's, with the faults its socket layer lets out when an instance dies while a
connection to it is being set up turned into httpx's connection error, so that they count as that instance failing
(retried elsewhere) rather than as an error of the proxy (a 500 to the client).

Seen in this project's 2P2D test, with a prefill instance killed under load: anyio's socket stream asked for the
peer name of a socket already closed (`AttributeError: 'NoneType' object has no attribute 'getpeername'`, raised
inside httpcore's connection set-up)."""

from __future__ import annotations

import httpx


class SturdyTransport(httpx.AsyncHTTPTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except (AttributeError, OSError) as exc:  # not httpx's: the socket layer's, on a socket already gone
            raise httpx.ConnectError(f"the connection failed as it was set up: {exc!r}", request=request) from exc
