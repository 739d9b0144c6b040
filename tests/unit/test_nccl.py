"""The NCCL pipe's pieces that run without a GPU: the unique id's round trip through the control plane, and a clear
error where CuPy's NCCL binding is missing. The pipe itself is checked on a GPU (scripts/gpu_check.sh)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from p2pkv.errors import P2pkvError
from p2pkv.nccl import UNIQUE_ID_BYTES, communicator, from_bytes, to_bytes, unique_id


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


class FakeNccl:
    """CuPy's NCCL module as far as the id's form goes: CuPy 14 and later take bytes, earlier versions a tuple of
    signed chars; each refuses the other form with TypeError (Cython's argument check), before NCCL runs."""

    def __init__(self, takes: type) -> None:
        self.takes = takes
        self.made: list[Any] = []

    def NcclCommunicator(self, nranks: int, uid: Any, rank: int) -> tuple[int, Any, int]:
        if not isinstance(uid, self.takes):
            raise TypeError(f"Argument 'commId' has incorrect type (expected {self.takes.__name__})")
        self.made.append(uid)
        return nranks, uid, rank


@pytest.mark.parametrize("takes", [bytes, tuple], ids=["cupy-14", "cupy-13"])
def test_the_communicator_gets_the_id_in_the_form_the_installed_cupy_takes(takes: type) -> None:
    signed = tuple(((i * 37) % 256) - 128 for i in range(UNIQUE_ID_BYTES))
    raw = to_bytes(signed)
    assert to_bytes(raw) == raw  # CuPy 14's get_unique_id gives bytes already
    nccl = FakeNccl(takes)
    assert communicator(nccl, 2, raw, 1) == (2, raw if takes is bytes else signed, 1)
    assert nccl.made == [raw if takes is bytes else signed]
