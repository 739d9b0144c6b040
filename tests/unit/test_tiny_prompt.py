"""The tests' prompts for the tiny model: exactly as many tokens as asked (its tokenizer is one token per byte),
the same for a tag everywhere, and different between tags (so requests share no cached prefix)."""

from __future__ import annotations

from p2pkv.tinymodel import tiny_prompt


def test_a_prompt_has_the_length_asked_and_depends_only_on_its_tag() -> None:
    for length in (1, 7, 64, 2000):
        text = tiny_prompt("req-1", length)
        assert len(text.encode()) == length
        assert tiny_prompt("req-1", length) == text
    assert tiny_prompt("req-1", 64)[:16] != tiny_prompt("req-2", 64)[:16]
    assert tiny_prompt("req-1", 64).startswith("[req-1] ")
