"""Resuming a stream whose decode instance broke off after its answer began (its process died, its connection
broke, it stalled past the request timeout): the proxy sends what is left as a new completion request, whose prompt
is the original prompt's tokens followed by the tokens already streamed, prefilled and decoded as a new transfer,
and passes its stream on as the rest of the first (the first stream's id, usage counted as one request's; for a
chat stream, its events turned into chat chunks: `p2pkv.proxy.chat_resume`).

Only where the continuation is the same request: a `/v1/completions` stream of one prompt, or a
`/v1/chat/completions` stream without tools, of one sample whose sampling does not depend on where its output began
(no stop strings, which hold text back; no seed, whose generator would start again; no frequency or presence
penalties, which count output tokens only; no structured output, whose grammar would start again; no logprobs, echo
or prompt truncation), and only while every token streamed came with its id and, for chat, as plain content (a
reasoning or tool-call parser on the server works on the whole output, which a continuation would not give it).
The decode request asks vLLM for token ids (`return_token_ids`), which the client gets only if it asked for them.

The continuation starts after the last token whose text went out: vLLM's detokenizer holds back a character's bytes
until it is whole, and a prompt that ends inside a character makes the continuation's detokenizer start wrongly
(vLLM 0.32 then streamed the whole prompt back as text). An event of one token with text ends where its text does;
the end of an event of several (vLLM's `--stream-interval`, speculative decoding) is found by asking an instance to
detokenize the tokens since (`Progress.settle`). Tokens after that end come again, so a stream whose client asked
for token ids is not resumed past tokens it was sent the ids of."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from p2pkv.proxy import chat_resume

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
_STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "guided_decoding_backend")
_ABSENT: tuple[Any, ...] = (None, 0, 0.0, False, "", [])
_REPLACEMENT = "\ufffd"  # what a tokenizer decodes the bytes of a character cut short to
_TAIL = 8  # characters of the text after a known end that its settled end must match
_HELD_AT_MOST = 8  # tokens held back at the end of a stream: a character's bytes, and special tokens among them


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def resumable(body: dict[str, Any], path: str) -> bool:
    """Whether the stream `body` asks for can be resumed from the tokens it streamed (see the module)."""
    if body.get("stream") is not True:
        return False
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (_is_ids(prompt) and prompt)) or body.get("logprobs") is not None:
            return False
    elif path == CHAT:
        if not isinstance(body.get("messages"), list) or body.get("logprobs") or body.get("tools"):
            return False
    else:
        return False
    options = body.get("stream_options") or {}
    return (body.get("n") in (None, 1) and body.get("best_of") in (None, 1) and body.get("seed") is None
            and all(body.get(k) in _ABSENT for k in ("stop", "frequency_penalty", "presence_penalty", "echo",
                                                       "truncate_prompt_tokens", "prompt_embeds", "suffix",
                                                       "top_logprobs", *_STRUCTURED))
            and body.get("prompt_logprobs") is None
            and isinstance(options, dict) and not options.get("continuous_usage_stats"))


def with_token_ids(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "return_token_ids": True}


_DECODE = msgspec.json.Decoder()  # a stream's every event goes through here: 1 us where json took 8
_ENCODE = msgspec.json.Encoder()


def _data(event: bytes) -> Any:
    if not event.startswith(b"data:"):
        return None
    data = event[len(b"data:"):].strip()
    if data == b"[DONE]":
        return None
    try:
        return _DECODE.decode(data)
    except msgspec.DecodeError:
        return None


def _encode(chunk: dict[str, Any]) -> bytes:
    return b"data: " + _ENCODE.encode(chunk)


class Progress:
    """What a resumable stream has passed on: its prompt's tokens, the tokens streamed since, its id. Its events go
    through `passed` (the token ids the client did not ask for taken out) and a continuation's through
    `continued`."""

    def __init__(self, body: dict[str, Any], path: str) -> None:
        self.body, self.path = body, path
        self.client_ids = body.get("return_token_ids") is True
        self.prompt: list[int] | None = None
        self.streamed: list[int] = []
        # Tokens whose text has surely gone out whole: the detokenizer holds back the bytes of a character split
        # across tokens, so this is the end of the last event of one token that had text (or of no token: it
        # brought out what was held back). A continuation from inside a character would detokenize its start
        # wrongly. `text_end`: the end of the last event with text; beyond `whole` after an event of several tokens
        # (with speculative decoding, or vLLM's stream interval), whose end `settle` checks.
        self.whole = 0
        self.text_end = 0
        self.tail = ""  # the end of the text that went out after `whole`
        self.finished = False
        self.unsure = False  # a token came without its id, or (chat) as other than plain content
        self.first: dict[str, Any] = {}  # the first chunk's id, created and model

    def passed(self, event: bytes) -> bytes:
        chunk = _data(event)
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not isinstance(chunk, dict) or not isinstance(choices, list):
            return event
        if not self.first:
            self.first = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
        taken = False  # ids the client did not ask for, taken out
        if _is_ids(chunk.get("prompt_token_ids")):  # where a chat stream says them
            self.prompt = chunk["prompt_token_ids"]
            taken = not self.client_ids and chunk.pop("prompt_token_ids") is not None
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if _is_ids(choice.get("prompt_token_ids")):
                self.prompt = choice["prompt_token_ids"]
            text = choice.get("text") or chat_resume.carries_output(choice)
            if _is_ids(choice.get("token_ids")):
                self.streamed += choice["token_ids"]
                if text:
                    self.text_end = len(self.streamed)
                    if len(choice["token_ids"]) <= 1:  # of no token: it brought out what was held back
                        self.whole, self.tail = self.text_end, ""
                    else:
                        self.tail = (self.tail + chat_resume.text_of(choice))[-_TAIL:]
            elif text:
                self.unsure = True
            if self.path == CHAT and not chat_resume.plain(choice):
                self.unsure = True
            self.finished = self.finished or choice.get("finish_reason") is not None
            if not self.client_ids:
                taken = choice.pop("prompt_token_ids", None) is not None or taken
                taken = choice.pop("token_ids", None) is not None or taken
        return _encode(chunk) if taken else event

    async def settle(self, detokenize: Callable[[list[int]], Awaitable[str | None]]) -> None:
        """After an event of several tokens with text: find where its text ended, with `detokenize` (the model's
        tokenizer, on an instance: None if it could not be asked). The detokenizer held back every token after the
        last one whose text went out (their text ended inside a character, in U+FFFD; special tokens, which vLLM's
        `/detokenize` spells out, among them), at most a character's bytes; so that token ends the tokens, counted
        from a known end, whose text ends as the text that went out does and not in U+FFFD."""
        if self.text_end == self.whole or self.prompt is None or self.finished or self.unsure:
            return
        tail = self.tail.lstrip()  # a tokenizer may drop a space at the start of what it decodes
        for end in range(self.text_end, max(self.whole, self.text_end - _HELD_AT_MOST), -1):
            text = await detokenize(self.streamed[self.whole : end])
            if text is None:
                return
            if text and not text.endswith(_REPLACEMENT) and text.endswith(tail):
                self.whole = self.text_end = end
                return

    def continuation(self) -> tuple[str, dict[str, Any]] | None:
        """The path and body of the request for the rest of the stream; None if it cannot be resumed (its
        prompt's tokens never came, a token came without its id, it had ended, where its text ended is not known
        (see `settle`), the client has the ids of tokens that would come again, or nothing is left to generate)."""
        if self.prompt is None or self.finished or self.unsure or self.text_end > self.whole:
            return None
        if self.client_ids and self.whole < len(self.streamed):
            return None  # the tokens after `whole` (their text held back) come again, and their ids with them
        body = chat_resume.as_completion(self.body) if self.path == CHAT else dict(self.body)
        body.pop("kv_transfer_params", None)
        self.streamed = self.streamed[: self.whole]  # the rest comes again (`continued` counts usage from here)
        body["prompt"] = self.prompt + self.streamed
        done = len(self.streamed)
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, int):
            if max_tokens - done <= 0:
                return None
            body["max_tokens"] = max_tokens - done
        min_tokens = body.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens:
            body["min_tokens"] = max(0, min_tokens - done)
        return COMPLETIONS, with_token_ids(body)

    def continued(self, event: bytes) -> bytes:
        """An event of the continuation (a completion stream) as the first stream's: its id (for chat, a chat
        chunk), without the (longer) prompt's tokens, its usage counted from the first stream's prompt."""
        chunk = _data(event)
        if not isinstance(chunk, dict) or "error" in chunk:
            return event
        chunk.update(self.first)
        for choice in chunk.get("choices") or []:
            if isinstance(choice, dict):
                choice.pop("prompt_token_ids", None)
                if not self.client_ids:
                    choice.pop("token_ids", None)
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            usage["prompt_tokens"] -= len(self.streamed)
            if isinstance(usage.get("completion_tokens"), int):
                usage["completion_tokens"] += len(self.streamed)
        return _encode(chat_resume.as_chat_chunk(chunk) if self.path == CHAT else chunk)


def each_event(block: bytes, change: Callable[[bytes], bytes]) -> bytes:
    """`block` (whole events) with each event changed by `change`."""
    events = block.split(b"\n\n")
    return b"".join(change(e) + b"\n\n" if e else b"" for e in events[:-1]) + events[-1]
