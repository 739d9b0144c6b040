"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import pytest

from p2pkv.engine import TransferEngine
from p2pkv.kv.staging import STAGE_ENV


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


@pytest.fixture(params=["host-cache", "staged"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """KV in host memory read in place, or handled as a GPU's is (`P2PKV_STAGE_KV`: device copies, batched and
    landed as they arrive). A test module may define its own modes."""
    if request.param == "staged":
        monkeypatch.setenv(STAGE_ENV, "1")
    return str(request.param)
