"""`p2pkv bench routing`'s workload: deterministic, shuffled, and the ideal hit rate it is measured against."""

from __future__ import annotations

from typing import Any

from p2pkv.bench.routing import RoutingSettings, ideal_hit_rate, workload


def chars(text: str) -> dict[str, Any]:
    """A tokenizer of one token per character (the bench takes any with HF's call signature)."""
    return {"input_ids": [ord(c) for c in text]}


def test_the_workload_is_the_same_for_a_seed_and_every_prefix_gets_its_questions() -> None:
    s = RoutingSettings("m", prefixes=3, questions=4, prefix_tokens=300, seed=7)
    first, again = workload(s, chars), workload(s, chars)
    assert [text for _, text, _ in first] == [text for _, text, _ in again]
    assert sorted(i for i, _, _ in first) == [0] * 4 + [1] * 4 + [2] * 4
    assert [i for i, _, _ in first] != sorted(i for i, _, _ in first)  # shuffled
    assert all(len(tokens) > 250 for _, _, tokens in first)
    other = workload(RoutingSettings("m", prefixes=3, questions=4, prefix_tokens=300, seed=8), chars)
    assert [text for _, text, _ in other] != [text for _, text, _ in first]


def test_the_ideal_counts_the_full_blocks_an_earlier_prompt_computed() -> None:
    a, b = list(range(10)), list(range(100, 110))
    requests = [(0, "", [*a, 50, 51]), (0, "", [*a, 60, 61]), (1, "", [*b, 70, 71]), (0, "", [*a[:5], 99])]
    # Blocks of 4: the second prompt finds 8 tokens (two blocks), the third none, the fourth one block.
    assert ideal_hit_rate(requests, 4) == (8 + 0 + 4) / (12 + 12 + 12 + 6)
