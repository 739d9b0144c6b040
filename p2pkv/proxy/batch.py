"""A completion request with a list of prompts: vLLM runs one request per prompt, but a prefill instance answers
one request with one transfer, which only one of those prompts could load. The proxy sends each prompt as a request
of its own (its own transfer, prefill and decode instances) and merges the answers as vLLM would have answered the
batch: the choices in prompt order, numbered on (prompt i's sample j is choice i * n + j), and the usage summed.
Streams are merged as their events come: each chunk's choices renumbered, each prompt's final usage chunk summed
into one, and one `[DONE]` once every prompt's stream has ended with its own."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import anyio

from p2pkv.proxy.trace import DECODE_HEADER, PREFILL_HEADER, PREFILL_MS_HEADER, TRANSFER_HEADER
from p2pkv.proxy.upstream import Relay

_TRACE_HEADERS = (TRANSFER_HEADER, PREFILL_HEADER, PREFILL_MS_HEADER, DECODE_HEADER)
# Prompts a batch's trace headers name: HTTP clients refuse headers much larger than 16 KiB in all.
TRACED_PROMPTS = 32


def batch_prompts(body: dict[str, Any], path: str) -> list[Any] | None:
    """The prompts of a completion request that has several; None otherwise. A list of token
    ids is one prompt; a list of strings, or of lists of token ids, is a batch."""
    prompts = body.get("prompt")
    if path != "/v1/completions" or not isinstance(prompts, list) or len(prompts) < 2:
        return None
    if all(isinstance(p, str) for p in prompts) or all(isinstance(p, list) for p in prompts):
        return prompts
    return None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _counts(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two usages added up, count by count (nested ones too); a field only one has is kept."""
    out = dict(a)
    for key, value in b.items():
        old = out.get(key)
        if _count(value) and _count(old):
            out[key] = old + value
        elif isinstance(value, dict) and isinstance(old, dict):
            out[key] = _counts(old, value)
        elif old is None:
            out[key] = value
    return out


def merge(answers: list[bytes]) -> bytes:
    """One answer for the batch from the answers for each of its prompts (in order, each a JSON completion)."""
    parsed = [json.loads(a) for a in answers]
    if not all(isinstance(a, dict) for a in parsed):
        raise ValueError("an answer is not a JSON object")
    merged = dict(parsed[0])
    choices: list[dict[str, Any]] = []
    for answer in parsed:
        for choice in sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0)):
            choices.append({**choice, "index": len(choices)})
    merged["choices"] = choices
    usages = [a["usage"] for a in parsed if isinstance(a.get("usage"), dict)]
    if usages:
        merged["usage"] = functools.reduce(_counts, usages)
    merged.pop("kv_transfer_params", None)
    return json.dumps(merged).encode()


def trace_headers(headers: list[dict[str, str]]) -> dict[str, str]:
    """Each prompt's trace headers, joined with commas in prompt order: the first `TRACED_PROMPTS`, then `+N` for
    the N prompts not named (each prompt's log line names all)."""
    named, more = headers[:TRACED_PROMPTS], len(headers) - TRACED_PROMPTS
    rest = [f"+{more}"] if more > 0 else []
    return {name: ",".join([*(h.get(name, "") for h in named), *rest]) for name in _TRACE_HEADERS}


_DONE = b"data: [DONE]"


class _StreamMerge:
    """The state of a merged stream: the batch's one id, and each prompt's final usage chunk."""

    def __init__(self, samples: int) -> None:
        self.samples = samples
        self.id: Any = None
        self.usages: list[dict[str, Any]] = []

    def event(self, prompt: int, event: bytes) -> bytes | None:
        """Prompt `prompt`'s event as the batch's (None: held back, a final usage chunk, or `[DONE]`)."""
        data = event.removeprefix(b"data:").strip() if event.startswith(b"data:") else None
        if data is None or data == b"[DONE]":
            return event if data is None else None
        try:
            chunk = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return event
        if not isinstance(chunk, dict) or "error" in chunk:
            return event
        if chunk.get("choices") == [] and isinstance(chunk.get("usage"), dict):
            self.usages.append(chunk)
            return None
        self.id = chunk.get("id") if self.id is None else self.id
        if "id" in chunk:
            chunk["id"] = self.id
        for choice in chunk.get("choices") or []:
            if isinstance(choice, dict):
                choice["index"] = prompt * self.samples + int(choice.get("index") or 0)
        return b"data: " + json.dumps(chunk).encode()

    def usage(self) -> bytes | None:
        """The batch's final usage chunk: the prompts' summed."""
        if not self.usages:
            return None
        chunk = {**self.usages[0], "usage": functools.reduce(_counts, [u["usage"] for u in self.usages])}
        if self.id is not None:
            chunk["id"] = self.id
        return b"data: " + json.dumps(chunk).encode()


async def _events(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A stream's server-sent events, whole (without their blank line), however its bytes were cut."""
    pending = b""
    async for piece in stream:
        pending += piece
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if event.strip():
                yield event
    if pending.strip():
        yield pending


async def merge_streams(streams: Sequence[Relay], samples: int) -> AsyncGenerator[bytes, None]:
    """One stream for the batch from each prompt's (in prompt order), events passed on as they come. Ends with
    `[DONE]` only if every prompt's stream did. Closing it (the client went away) closes every prompt's stream."""
    queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()

    async def read(prompt: int, stream: Relay) -> None:
        try:
            async for event in _events(stream):
                await queue.put((prompt, event))
        finally:
            await queue.put((prompt, None))

    merge = _StreamMerge(samples)
    readers = [asyncio.ensure_future(read(i, s)) for i, s in enumerate(streams)]
    finished, done = 0, [False] * len(streams)
    try:
        while finished < len(streams):
            prompt, event = await queue.get()
            if event is None:
                finished += 1
                continue
            if event.strip() == _DONE:
                done[prompt] = True
            out = merge.event(prompt, event)
            if out is not None:
                yield out + b"\n\n"
        usage = merge.usage()
        if usage is not None:
            yield usage + b"\n\n"
        if all(done):
            yield _DONE + b"\n\n"
    finally:
        for reader in readers:
            reader.cancel()
        # Shielded: this runs as the client goes away, in a task anyio is cancelling (see upstream.Relay).
        with anyio.CancelScope(shield=True):
            for reader in readers:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader
            for stream in streams:  # each one's upstream request closed, also for one its reader never began
                await stream.aclose()
