"""Bounds on what one client request may cost the proxy: its body's size and the time it takes to arrive (an ASGI
middleware in front of every route), and how deeply its JSON nests.

The body is read here, whole, before any route sees it (every route reads it whole anyway): a `Content-Length`
above the cap is answered 413 before a byte of the body is read, a chunked body as soon as it passes the cap, and
a body still incomplete at its deadline 408; each of those answers closes the connection, so the rest of the body
is never read."""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_NESTING = 100  # JSON levels in a request body: deeper ones are refused before anything recurses over them


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float, keys: tuple[str, ...] = ()) -> None:
        """`keys`: where clients need a key, the keys that open some route (the clients' and the admin key): a
        request with a body and none of them is answered 401 before its body is read, so that clients without a
        key cannot have the proxy hold their bodies."""
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.bearers = tuple(f"Bearer {key}".encode() for key in keys if key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.bearers and scope["method"] not in ("GET", "HEAD") and not any(
                hmac.compare_digest(headers.get(b"authorization", b""), bearer) for bearer in self.bearers):
            await _refuse(send, 401, "missing or wrong API key", "authentication_error")
            return
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await _refuse(send, 413, self._too_large())
            return
        chunks: list[bytes] = []
        size, more = 0, True
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while more:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                await _refuse(send, 408, f"the request body did not arrive within {self.timeout_s:g} s "
                                         "(--body-timeout)")
                return
            if message["type"] == "http.disconnect":
                return  # the client went away before its body was in: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _refuse(send, 413, self._too_large())
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            """The body once, then what the client does next (it going away, which routes watch for)."""
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _too_large(self) -> str:
        return f"the request body is larger than {self.max_bytes / (1 << 20):g} MiB (--max-body-mb)"


async def _refuse(send: Send, status: int, message: str, kind: str = "invalid_request_error") -> None:
    """An OpenAI-style error, closing the connection (what is left of the body is not read)."""
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def too_deep(value: Any, limit: int = MAX_NESTING) -> bool:
    """Whether lists and objects in `value` nest deeper than `limit` levels (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False
