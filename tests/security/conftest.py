"""Fixtures of the security tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from p2pkv.engine import TransferEngine
from tests.helpers.attack import readers, wait_for


@pytest.fixture
def engines() -> Iterator[list[TransferEngine]]:
    """Engines a test started: closed after it, and no reader thread of theirs left behind."""
    made: list[TransferEngine] = []
    yield made
    for engine in made:
        engine.close()
    assert wait_for(lambda: readers() == 0, 5), "reader threads left behind"
