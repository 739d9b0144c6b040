"""The NCCL communicator's call sequence, through a fake library with the surface of vLLM's binding
(`pynccl_wrapper.NCCLLibrary`: the same method names and arguments) and the two raw functions p2pkv declares on the
same library: made without blocking and polled to a deadline, channels through the communicator's config (never the
process environment), one group per send, and an abort where the peer never joins or a send outlives its deadline.
NCCL itself runs in scripts/gpu_check.sh."""

from __future__ import annotations

import ctypes
import os
import time
from types import SimpleNamespace
from typing import Any

import pytest

from p2pkv.errors import P2pkvError, TransferTimeout
from p2pkv.kv.nccl import IN_PROGRESS, SUCCESS, UINT8, UNIQUE_ID_BYTES, Communicator, NcclConfig, unique_id


class Uid(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


class FakeLibrary:
    """Records every call. `joins_after`: how many polls the peer takes to join (None: never); `sends_after`: how
    many polls a group takes to be enqueued (None: never); `config`: the library has ncclCommInitRankConfig."""

    def __init__(self, joins_after: int | None = 2, sends_after: int | None = 1, config: bool = True) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.config: NcclConfig | None = None
        self._pending = 0  # polls before the call in progress is done (-1: never)
        self._joins_after, self._sends_after = joins_after, sends_after
        self.lib = SimpleNamespace()  # the loaded library's functions, which take ctypes' declarations
        if config:
            self.lib.ncclCommInitRankConfig = lambda *args: self._init_config(*args)
            self.lib.ncclCommGetAsyncError = lambda *args: self._async_error(*args)
            self.lib.ncclGroupEnd = lambda: self._group_end()

    def _start(self, after: int | None) -> int:
        self._pending = -1 if after is None else after
        return IN_PROGRESS if after != 0 else SUCCESS

    def _init_config(self, comm: Any, nranks: int, uid: Any, rank: int, config: Any) -> int:
        comm._obj.value = 0xC0
        self.config = NcclConfig.from_buffer_copy(config._obj)
        self.calls.append(("ncclCommInitRankConfig", nranks, bytes(uid.internal) == bytes(range(128)), rank))
        return self._start(self._joins_after)

    def _async_error(self, comm: Any, state: Any) -> int:
        self.calls.append(("ncclCommGetAsyncError",))
        if self._pending > 0:
            self._pending -= 1
        state._obj.value = SUCCESS if self._pending == 0 else IN_PROGRESS
        return SUCCESS

    def _group_end(self) -> int:
        self.calls.append(("ncclGroupEnd",))
        return self._start(self._sends_after)

    # vLLM's NCCLLibrary's methods
    def ncclGetErrorString(self, result: int) -> str:
        return f"error {result}"

    def ncclGetUniqueId(self) -> Uid:
        self.calls.append(("ncclGetUniqueId",))
        return Uid((ctypes.c_byte * UNIQUE_ID_BYTES)(*[b - 256 if b > 127 else b for b in range(128)]))

    def unique_id_from_bytes(self, data: bytes) -> Uid:
        uid = Uid()
        ctypes.memmove(ctypes.addressof(uid.internal), data, UNIQUE_ID_BYTES)
        return uid

    def ncclCommInitRank(self, world_size: int, unique_id: Any, rank: int) -> Any:
        self.calls.append(("ncclCommInitRank", world_size, rank))
        return ctypes.c_void_p(0xB0)

    def ncclSend(self, sendbuff: Any, count: int, datatype: int, dest: int, comm: Any, stream: Any) -> None:
        self.calls.append(("ncclSend", sendbuff, count, datatype, dest, stream))

    def ncclRecv(self, recvbuff: Any, count: int, datatype: int, src: int, comm: Any, stream: Any) -> None:
        self.calls.append(("ncclRecv", recvbuff, count, datatype, src, stream))

    def ncclGroupStart(self) -> None:
        self.calls.append(("ncclGroupStart",))

    def ncclGroupEnd(self) -> None:
        self.calls.append(("ncclGroupEnd",))

    def ncclCommAbort(self, comm: Any) -> None:
        self.calls.append(("ncclCommAbort",))

    def ncclCommDestroy(self, comm: Any) -> None:
        self.calls.append(("ncclCommDestroy",))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


def test_the_id_travels_as_its_128_bytes() -> None:
    lib = FakeLibrary()
    uid = unique_id(lib)  # type: ignore[arg-type]
    assert uid == bytes(range(128))
    with pytest.raises(P2pkvError, match="128 bytes"):
        Communicator(lib, 2, uid[:-1], 0, 4, time.monotonic() + 1)  # type: ignore[arg-type]


def test_made_without_blocking_its_channels_in_its_config_then_one_group_per_send() -> None:
    lib = FakeLibrary(joins_after=3)
    before = {k: os.environ.get(k) for k in ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")}
    comm = Communicator(lib, 2, bytes(range(128)), 1, 4, time.monotonic() + 5)  # type: ignore[arg-type]
    assert lib.calls[0] == ("ncclCommInitRankConfig", 2, True, 1)
    assert lib.names()[1:] == ["ncclCommGetAsyncError"] * 3, "polled until the peer joined"
    assert lib.config is not None and lib.config.blocking == 0
    assert (lib.config.minCTAs, lib.config.maxCTAs) == (4, 4)
    assert lib.config.size == ctypes.sizeof(NcclConfig) and lib.config.magic == 0xCAFEBEEF
    assert {k: os.environ.get(k) for k in before} == before, "the process environment is not touched"
    lib.calls.clear()
    comm.send(0x1000, 4096, 0, 77, time.monotonic() + 5)
    comm.recv(0x2000, 8192, 0, 77, time.monotonic() + 5)
    assert lib.calls == [("ncclGroupStart",), ("ncclSend", 0x1000, 4096, UINT8, 0, 77), ("ncclGroupEnd",),
                         ("ncclCommGetAsyncError",),
                         ("ncclGroupStart",), ("ncclRecv", 0x2000, 8192, UINT8, 0, 77), ("ncclGroupEnd",),
                         ("ncclCommGetAsyncError",)]
    comm.close()
    comm.close()  # idempotent
    assert lib.names()[-1] == "ncclCommDestroy" and lib.names().count("ncclCommDestroy") == 1


def test_a_peer_that_never_joins_is_given_up_at_the_deadline_and_aborted() -> None:
    lib = FakeLibrary(joins_after=None)
    started = time.monotonic()
    with pytest.raises(TransferTimeout, match="making the communicator missed its deadline"):
        Communicator(lib, 2, bytes(range(128)), 0, 0, started + 0.2)  # type: ignore[arg-type]
    assert 0.2 <= time.monotonic() - started < 1.0, "the caller's thread is back at the deadline, not stuck"
    assert lib.names()[-1] == "ncclCommAbort"
    assert lib.config is not None and lib.config.minCTAs == -(2**31), "0 channels: NCCL's own choice"


def test_a_send_still_in_progress_at_its_deadline_aborts_the_communicator() -> None:
    lib = FakeLibrary(joins_after=0, sends_after=None)
    comm = Communicator(lib, 2, bytes(range(128)), 0, 2, time.monotonic() + 5)  # type: ignore[arg-type]
    with pytest.raises(TransferTimeout, match="a send missed its deadline"):
        comm.send(0x1000, 4096, 1, 0, time.monotonic() + 0.1)
    assert lib.names()[-1] == "ncclCommAbort"
    comm.close()  # already aborted: nothing more
    assert lib.names().count("ncclCommAbort") == 1 and "ncclCommDestroy" not in lib.names()


def test_a_library_without_config_falls_back_to_a_blocking_init(caplog: pytest.LogCaptureFixture) -> None:
    lib = FakeLibrary(config=False)
    comm = Communicator(lib, 2, bytes(range(128)), 1, 4, time.monotonic() + 5)  # type: ignore[arg-type]
    assert lib.calls[0] == ("ncclCommInitRank", 2, 1)
    assert "nccl_num_channels is not applied" in caplog.text
    comm.send(0x1000, 16, 0, 5, time.monotonic() + 5)
    assert lib.names()[1:] == ["ncclGroupStart", "ncclSend", "ncclGroupEnd"]
    comm.close(abort=True)
    assert lib.names()[-1] == "ncclCommAbort"
