"""Server-sent events as the proxy relays a decode stream: its bytes passed on whole events at a time, and the
events that end a stream whose decode instance broke off after its answer began, in the form of the stream's API."""

from __future__ import annotations

import json
from typing import Any

from p2pkv.proxy.prefill import MESSAGES, RESPONSES

_END = b"\n\n"  # what ends an event (vLLM's streams, and the Responses and Messages APIs' it serves)
_DONE = b"data: [DONE]\n\n"


def split_events(pending: bytes) -> tuple[bytes, bytes]:
    """(the whole events at the start of `pending`, the rest: an event not yet complete, held back)."""
    end = pending.rfind(_END)
    if end < 0:
        return b"", pending
    return pending[: end + len(_END)], pending[end + len(_END):]


def break_off(api: str, status: int, message: str) -> bytes:
    """The events that end a stream cut short upstream, as the API sends an error once its stream has begun (the
    OpenAI APIs' error chunk and `[DONE]`, as vLLM ends a stream that failed; an `error` event for the Messages and
    Responses APIs)."""
    error: dict[str, Any]
    if api == MESSAGES:
        error = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + json.dumps(error).encode() + _END
    if api == RESPONSES:
        error = {"type": "error", "code": str(status), "message": message, "param": None}
        return b"event: error\ndata: " + json.dumps(error).encode() + _END
    chunk = {"error": {"message": message, "type": "proxy_error", "param": None, "code": status}}
    return b"data: " + json.dumps(chunk).encode() + _END + _DONE
