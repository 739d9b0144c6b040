"""The NCCL pipe's pieces that run without a GPU: the unique id's round trip through the control plane, and a clear
error where CuPy's NCCL binding is missing. The pipe itself is checked on a GPU (scripts/gpu_check.sh)."""

from __future__ import annotations

import importlib.util

import pytest

from p2pkv.errors import P2pkvError
from p2pkv.nccl import UNIQUE_ID_BYTES, from_bytes, to_bytes, unique_id


def test_unique_id_round_trips_through_bytes() -> None:
    uid = tuple(((i * 37) % 256) - 128 for i in range(UNIQUE_ID_BYTES))  # cupy's signed chars
    raw = to_bytes(uid)
    assert len(raw) == UNIQUE_ID_BYTES and from_bytes(raw) == uid
    with pytest.raises(P2pkvError, match="128 bytes"):
        from_bytes(raw[:-1])


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="checks the error without CuPy")
def test_without_cupy_the_error_says_what_to_install() -> None:
    with pytest.raises(P2pkvError, match="needs CuPy with NCCL"):
        unique_id()
