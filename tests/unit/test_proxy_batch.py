"""Splitting a batch of prompts and merging the answers (pure functions; the proxy's use of them is in
test_proxy.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from p2pkv.proxy.batch import batch_prompts, merge, merge_streams, trace_headers


@pytest.mark.parametrize(("body", "path", "split"), [
    ({"prompt": ["a", "b"]}, "/v1/completions", ["a", "b"]),
    ({"prompt": [[1, 2], [3]]}, "/v1/completions", [[1, 2], [3]]),
    ({"prompt": [1, 2, 3]}, "/v1/completions", None),  # token ids of one prompt
    ({"prompt": ["a"]}, "/v1/completions", None),
    ({"prompt": "a"}, "/v1/completions", None),
    ({"prompt": ["a", [1]]}, "/v1/completions", None),  # mixed: left to vLLM to judge
    ({"prompt": ["a", "b"], "stream": True}, "/v1/completions", ["a", "b"]),  # merged as the events come
    ({"prompt": ["a", "b"]}, "/v1/chat/completions", None),
])
def test_which_requests_are_batches(body: dict[str, object], path: str, split: list[object] | None) -> None:
    assert batch_prompts(body, path) == split


def test_answers_merge_as_vllm_answers_a_batch() -> None:
    def answer(text: str, n: int, cached: int) -> bytes:
        return json.dumps({"id": f"cmpl-{text}", "object": "text_completion", "kv_transfer_params": {"x": 1},
                           "choices": [{"index": n - 1 - i, "text": f"{text}{n - 1 - i}"} for i in range(n)],
                           "usage": {"prompt_tokens": 4, "completion_tokens": 2 * n, "total_tokens": 4 + 2 * n,
                                     "prompt_tokens_details": {"cached_tokens": cached, "created": None}}}).encode()

    merged = json.loads(merge([answer("a", 2, 3), answer("b", 1, 0)]))
    assert merged["id"] == "cmpl-a" and "kv_transfer_params" not in merged
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "a0"), (1, "a1"), (2, "b0")]
    assert merged["usage"] == {"prompt_tokens": 8, "completion_tokens": 6, "total_tokens": 14,
                               "prompt_tokens_details": {"cached_tokens": 3, "created": None}}


@pytest.mark.parametrize("bad", [b"not json", b"[1, 2]"])
def test_an_answer_that_is_not_a_completion_cannot_be_merged(bad: bytes) -> None:
    with pytest.raises(ValueError):
        merge([b'{"choices": []}', bad])


def test_trace_headers_are_listed_in_prompt_order() -> None:
    joined = trace_headers([{"x-p2pkv-transfer-id": "t1", "x-p2pkv-decode": "d1"},
                            {"x-p2pkv-transfer-id": "t2", "x-p2pkv-decode": "d2"}])
    assert joined["x-p2pkv-transfer-id"] == "t1,t2" and joined["x-p2pkv-decode"] == "d1,d2"


class FakeStream:
    """A prompt's stream, its bytes cut at arbitrary points, that records whether it was closed."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.closed = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> bytes:
        if not self.pieces:
            raise StopAsyncIteration
        await asyncio.sleep(0)
        return self.pieces.pop(0)

    async def aclose(self) -> None:
        self.closed = True


def cut(text: str, every: int) -> list[bytes]:
    raw = text.encode()
    return [raw[i:i + every] for i in range(0, len(raw), every)]


def chunk(cid: str, index: int, text: str) -> str:
    return "data: " + json.dumps({"id": cid, "choices": [{"index": index, "text": text}]}) + "\n\n"


async def collect(stream: AsyncIterator[bytes]) -> list[Any]:
    out: list[Any] = []
    async for piece in stream:
        for event in piece.split(b"\n\n"):
            if event.startswith(b"data: "):
                data = event.removeprefix(b"data: ")
                out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


def test_streams_merge_as_vllm_streams_a_batch() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 2}}
    first = chunk("cmpl-1", 0, "x") + chunk("cmpl-1", 1, "y") + "data: " + json.dumps(
        {"id": "cmpl-1", "choices": [], "usage": usage}) + "\n\ndata: [DONE]\n\n"
    second = chunk("cmpl-2", 1, "z") + 'data: {"error": {"code": 400}}\n\n' + "data: " + json.dumps(
        {"id": "cmpl-2", "choices": [], "usage": usage}) + "\n\ndata: [DONE]\n\n"
    streams = [FakeStream(cut(first, 7)), FakeStream(cut(second, 5))]
    got = asyncio.run(collect(merge_streams(streams, 2)))  # type: ignore[arg-type]
    assert got[-1] == "[DONE]" and got.count("[DONE]") == 1
    assert got[-2]["choices"] == [] and got[-2]["usage"] == {"prompt_tokens": 6, "completion_tokens": 4,
                                                             "prompt_tokens_details": {"cached_tokens": 4}}
    texts = {c["choices"][0]["text"]: c["choices"][0]["index"] for c in got if isinstance(c, dict) and c.get("choices")}
    assert texts == {"x": 0, "y": 1, "z": 3}  # prompt 1's sample 1 is choice 1 * 2 + 1
    assert {"error": {"code": 400}} in got  # passed on as it came
    assert len({c["id"] for c in got if isinstance(c, dict) and "id" in c}) == 1  # the batch's one id
    assert all(s.closed for s in streams)


def test_a_merged_stream_ends_without_done_when_a_prompt_stream_broke_off() -> None:
    streams = [FakeStream(cut(chunk("a", 0, "x") + "data: [DONE]\n\n", 4)), FakeStream(cut(chunk("b", 0, "y"), 4))]
    got = asyncio.run(collect(merge_streams(streams, 1)))  # type: ignore[arg-type]
    assert "[DONE]" not in got and len(got) == 2
    assert all(s.closed for s in streams)
