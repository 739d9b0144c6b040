"""Splitting a batch of prompts and merging the answers (pure functions; the proxy's use of them is in
test_proxy.py)."""

from __future__ import annotations

import json

import pytest

from p2pkv.proxy.batch import batch_prompts, merge, trace_headers


@pytest.mark.parametrize(("body", "path", "split"), [
    ({"prompt": ["a", "b"]}, "/v1/completions", ["a", "b"]),
    ({"prompt": [[1, 2], [3]]}, "/v1/completions", [[1, 2], [3]]),
    ({"prompt": [1, 2, 3]}, "/v1/completions", None),  # token ids of one prompt
    ({"prompt": ["a"]}, "/v1/completions", None),
    ({"prompt": "a"}, "/v1/completions", None),
    ({"prompt": ["a", [1]]}, "/v1/completions", None),  # mixed: left to vLLM to judge
    ({"prompt": ["a", "b"], "stream": True}, "/v1/completions", None),
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
