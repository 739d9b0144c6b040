"""Fixtures shared by every test tier."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.servers import serve
from tests.helpers.stubs import stub_decode, stub_prefill


@pytest.fixture
def backends() -> Iterator[tuple[str, str, list[dict[str, Any]], list[dict[str, Any]]]]:
    """A stub prefill and a stub decode instance (real HTTP servers): their addresses and what each was sent."""
    p_seen: list[dict[str, Any]] = []
    d_seen: list[dict[str, Any]] = []
    with serve(stub_prefill(p_seen)) as p, serve(stub_decode(d_seen)) as d:
        yield p, d, p_seen, d_seen
