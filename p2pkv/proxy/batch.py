"""A completion request with a list of prompts: vLLM runs one request per prompt, but a prefill instance answers
one request with one transfer, which only one of those prompts could load. The proxy sends each prompt as a request
of its own (its own transfer, prefill and decode instances) and merges the answers as vLLM would have answered the
batch: the choices in prompt order, numbered on, and the usage summed. Streams are left whole (their chunks of
several prompts interleave): one prompt's KV is transferred, the decode instance computes the others."""

from __future__ import annotations

import functools
import json
from typing import Any

from p2pkv.proxy.trace import DECODE_HEADER, PREFILL_HEADER, PREFILL_MS_HEADER, TRANSFER_HEADER

_TRACE_HEADERS = (TRANSFER_HEADER, PREFILL_HEADER, PREFILL_MS_HEADER, DECODE_HEADER)


def batch_prompts(body: dict[str, Any], path: str) -> list[Any] | None:
    """The prompts of a plain (not streamed) completion request that has several; None otherwise. A list of token
    ids is one prompt; a list of strings, or of lists of token ids, is a batch."""
    prompts = body.get("prompt")
    if path != "/v1/completions" or body.get("stream") or not isinstance(prompts, list) or len(prompts) < 2:
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
    """Each prompt's trace headers, joined with commas in prompt order."""
    return {name: ",".join(h.get(name, "") for h in headers) for name in _TRACE_HEADERS}
