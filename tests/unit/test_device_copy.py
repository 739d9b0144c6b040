"""Waiting for queued copies: markers asked without sleeping at first, then between sleeps that grow with the time
waited; the deadline kept either way."""

from __future__ import annotations

import itertools
import time

from p2pkv import device_copy
from p2pkv.device_copy import settle, wait_marker


def _done_after(seconds: float) -> tuple[device_copy.Marker, list[float]]:
    asked: list[float] = []
    due = time.monotonic() + seconds

    def marker() -> bool:
        asked.append(time.monotonic())
        return asked[-1] >= due

    return marker, asked


def test_a_short_copy_is_seen_done_without_a_sleep() -> None:
    marker, asked = _done_after(100e-6)
    started = time.monotonic()
    assert wait_marker(marker, started + 5)
    assert time.monotonic() - started < device_copy.SPIN_S + 0.05
    gaps = [b - a for a, b in itertools.pairwise(asked)]
    assert len(asked) > 3 and max(gaps) < 0.01, "asked in a loop, not between sleeps"


def test_a_long_copy_is_asked_between_growing_sleeps_and_seen_soon_after() -> None:
    marker, asked = _done_after(0.08)
    started = time.monotonic()
    assert wait_marker(marker, started + 5)
    waited = time.monotonic() - started
    assert waited < 0.08 + 0.08 / 8 + 0.01, f"seen {waited - 0.08:.4f} s late"
    late = [t for t in asked if t - started > 0.01]
    assert 5 < len(late) < 200, f"{len(late)} asks after the first 10 ms"


def test_the_deadline_is_kept() -> None:
    started = time.monotonic()
    assert not wait_marker(lambda: False, started + 0.05)
    assert 0.05 <= time.monotonic() - started < 0.06
    assert not settle([lambda: False], time.monotonic() + 0.02, 0.02)
