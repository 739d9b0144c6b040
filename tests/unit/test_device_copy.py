"""Waiting for queued copies: markers asked without sleeping at first, then between sleeps that grow with the time
waited; the deadline kept either way."""

from __future__ import annotations

import time

import pytest

from p2pkv.kv import device_copy
from p2pkv.kv.device_copy import settle, wait_marker


def _done_after(seconds: float) -> tuple[device_copy.Marker, list[float]]:
    asked: list[float] = []
    due = time.monotonic() + seconds

    def marker() -> bool:
        asked.append(time.monotonic())
        return asked[-1] >= due

    return marker, asked


def test_while_spinning_the_marker_is_asked_without_a_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within SPIN_S the marker is asked again and again, the core yielded between asks but never slept on (a
    sleep lasts 50 us or more past what it asks, longer than a short copy)."""
    slept: list[float] = []
    monkeypatch.setattr(device_copy, "SPIN_S", 5.0)  # a loaded machine may take long between asks
    monkeypatch.setattr(device_copy.time, "sleep", slept.append)
    asks = iter([False] * 20 + [True])
    assert wait_marker(lambda: next(asks), time.monotonic() + 30)
    assert slept == []
    assert next(asks, None) is None, "asked until done"


def test_a_long_copy_is_asked_between_growing_sleeps_and_seen_soon_after() -> None:
    marker, asked = _done_after(0.08)
    started = time.monotonic()
    assert wait_marker(marker, started + 5)
    waited = time.monotonic() - started
    assert waited < 0.08 + 0.05, f"seen {waited - 0.08:.4f} s late"
    late = [t for t in asked if t - started > 0.01]
    assert 2 < len(late) < 200, f"{len(late)} asks after the first 10 ms: a spin would ask thousands of times"


def test_the_deadline_is_kept() -> None:
    started = time.monotonic()
    assert not wait_marker(lambda: False, started + 0.05)
    assert 0.05 <= time.monotonic() - started < 0.5
    assert not settle([lambda: False], time.monotonic() + 0.02, 0.02)
