"""A request's prompt as token ids, as the instance that serves it would compute them: vLLM's own `/tokenize`
(chat template applied for chat requests), asked of an instance's API server, which tokenizes beside its engine."""

from __future__ import annotations

import logging
from typing import Any

import httpx

from p2pkv.proxy.instances import Instance

log = logging.getLogger(__name__)
MAX_TOKENS = 1 << 20  # a longer answer is not taken as a prompt
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# What of a chat request decides its template's output (vLLM's `/tokenize` takes the same).
_CHAT_KEYS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
              "tools", "add_special_tokens", "mm_processor_kwargs")


def given_tokens(body: dict[str, Any], path: str) -> list[int] | None:
    """The prompt's token ids where the request gives them itself (a completion whose prompt is token ids)."""
    prompt = body.get("prompt")
    if path == COMPLETIONS and isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None


def tokenize_body(body: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The `/tokenize` request for `body`; None for requests it cannot tokenize (other APIs, other prompt forms)."""
    model = {"model": body["model"]} if "model" in body else {}
    if path == COMPLETIONS and isinstance(body.get("prompt"), str):
        return {**model, "prompt": body["prompt"], "add_special_tokens": body.get("add_special_tokens", True)}
    if path == CHAT and isinstance(body.get("messages"), list):
        return {**model, **{k: body[k] for k in _CHAT_KEYS if k in body}}
    return None


async def prompt_tokens(client: httpx.AsyncClient, instance: Instance, body: dict[str, Any], path: str,
                        headers: dict[str, str], timeout_s: float) -> list[int] | None:
    """The prompt's token ids, or None where they cannot be had (the request is routed by load then)."""
    given = given_tokens(body, path)
    if given is not None:
        return given
    ask = tokenize_body(body, path)
    if ask is None:
        return None
    try:
        answer = await client.post(f"{instance.url}/tokenize", json=ask, headers=instance.headers(headers),
                                   timeout=timeout_s)
    except httpx.HTTPError as exc:
        log.debug("%s did not tokenize a prompt: %r", instance.name, exc)
        return None
    if answer.status_code != 200:
        return None  # the request itself will be answered with the reason (a bad request, a wrong model)
    try:
        tokens = answer.json().get("tokens")
    except (ValueError, AttributeError):
        return None
    if not (isinstance(tokens, list) and len(tokens) <= MAX_TOKENS and all(isinstance(t, int) for t in tokens)):
        return None
    return tokens
