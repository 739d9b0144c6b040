"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import pytest

from p2pkv.engine import TransferEngine


class HasEngine(Protocol):
    engine: TransferEngine


@pytest.fixture
def sides() -> Iterator[list[HasEngine]]:
    """Test sides made by a test (each with a started engine, or a connector worker side): shut down after it."""
    made: list[HasEngine] = []
    yield made
    for side in made:
        shutdown = getattr(side, "shutdown", None)
        if callable(shutdown):
            shutdown()
        else:
            side.engine.close()
