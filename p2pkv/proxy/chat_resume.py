"""A chat stream resumed as a completion (`p2pkv.proxy.resume`): vLLM takes no prompt tokens on its chat API, so the
rest of a chat stream is asked for on the completions API with the chat prompt's tokens (which the chat stream said,
with `return_token_ids`), and its chunks are turned back into chat chunks."""

from __future__ import annotations

from typing import Any

# What a chat request and a completion request share: sampling and output options that mean the same in both.
_SHARED = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "ignore_eos",
           "min_tokens", "stop_token_ids", "skip_special_tokens", "spaces_between_special_tokens", "logit_bias",
           "allowed_token_ids", "bad_words", "stream", "stream_options", "priority", "user", "cache_salt",
           "return_token_ids", "length_penalty", "vllm_xargs", "stream_interval")
# Delta fields that carry output other than plain content (vLLM names reasoning `reasoning`; it was
# `reasoning_content`).
NOT_CONTENT = ("reasoning", "reasoning_content", "tool_calls", "function_call", "refusal")


def as_completion(chat: dict[str, Any]) -> dict[str, Any]:
    """The completion request with the chat request's sampling (its prompt still to be set)."""
    body = {k: chat[k] for k in _SHARED if k in chat}
    if "max_completion_tokens" in chat and chat["max_completion_tokens"] is not None:
        body["max_tokens"] = chat["max_completion_tokens"]
    return body


def carries_output(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    return isinstance(delta, dict) and any(delta.get(k) for k in ("content", *NOT_CONTENT))


def text_of(choice: dict[str, Any]) -> str:
    """The text a completion choice or a chat choice's delta content carries."""
    delta = choice.get("delta")
    text = choice.get("text") if "text" in choice else delta.get("content") if isinstance(delta, dict) else None
    return text if isinstance(text, str) else ""


def plain(choice: dict[str, Any]) -> bool:
    """Whether a chat choice's delta holds nothing but content (and the role)."""
    delta = choice.get("delta")
    return not isinstance(delta, dict) or not any(delta.get(k) for k in NOT_CONTENT)


def as_chat_chunk(chunk: dict[str, Any]) -> dict[str, Any]:
    """A completion chunk as a chat chunk (its choices' text as delta content)."""
    out = {k: v for k, v in chunk.items() if k != "choices"}
    out["object"] = "chat.completion.chunk"
    choices = []
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        text = choice.get("text")
        turned = {"index": choice.get("index", 0), "delta": {"content": text} if text else {}, "logprobs": None,
                  "finish_reason": choice.get("finish_reason")}
        for key in ("stop_reason", "token_ids"):
            if key in choice:
                turned[key] = choice[key]
        choices.append(turned)
    out["choices"] = choices
    return out
