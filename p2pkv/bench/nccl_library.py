"""The NCCL library the GPU check and `bench transfer` use: vLLM's binding where vLLM is installed (as on every
deployment of a CUDA build); else, on a GPU machine that carries no vLLM, a stand-in with the same surface over the
same library torch loads. The connector itself uses vLLM's binding only (`p2pkv.kv.nccl.load_library`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from typing import Any

from p2pkv.errors import P2pkvError
from p2pkv.kv.nccl import UNIQUE_ID_BYTES, NcclLibrary, load_library


class _Uid(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


def _find() -> str:
    """libnccl as torch ships it (the nvidia-nccl wheel beside it, or torch's own lib), else the system's."""
    import torch

    roots = [os.path.dirname(torch.__file__)]
    try:
        import nvidia.nccl  # type: ignore[import-not-found]

        roots += list(nvidia.nccl.__path__)
    except ImportError:
        pass
    for root in roots:
        found = sorted(glob.glob(os.path.join(root, "**", "libnccl.so*"), recursive=True))
        if found:
            return found[0]
    name = ctypes.util.find_library("nccl")
    if name is None:
        raise P2pkvError("no libnccl found beside torch or on the system")
    return name


class StandIn:
    """NCCLLibrary's methods over libnccl with ctypes: what the check needs where vLLM is not installed."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(_find())
        ptr, size, num = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        for name, args in (("ncclGetUniqueId", [ctypes.POINTER(_Uid)]),
                           ("ncclCommInitRank", [ctypes.POINTER(ptr), num, _Uid, num]),
                           ("ncclSend", [ptr, size, num, num, ptr, ptr]), ("ncclRecv", [ptr, size, num, num, ptr, ptr]),
                           ("ncclGroupStart", []), ("ncclGroupEnd", []), ("ncclCommAbort", [ptr]),
                           ("ncclCommDestroy", [ptr])):
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, num
        self.lib.ncclGetErrorString.argtypes, self.lib.ncclGetErrorString.restype = [num], ctypes.c_char_p

    def _check(self, result: int) -> None:
        if result != 0:
            raise RuntimeError(f"NCCL error: {self.ncclGetErrorString(result)}")

    def ncclGetErrorString(self, result: int) -> str:
        return str(self.lib.ncclGetErrorString(result).decode())

    def ncclGetUniqueId(self) -> _Uid:
        uid = _Uid()
        self._check(self.lib.ncclGetUniqueId(ctypes.byref(uid)))
        return uid

    def unique_id_from_bytes(self, data: bytes) -> _Uid:
        uid = _Uid()
        ctypes.memmove(ctypes.addressof(uid.internal), data, UNIQUE_ID_BYTES)
        return uid

    def ncclCommInitRank(self, world_size: int, unique_id: Any, rank: int) -> Any:
        comm = ctypes.c_void_p()
        self._check(self.lib.ncclCommInitRank(ctypes.byref(comm), world_size, unique_id, rank))
        return comm

    def ncclSend(self, sendbuff: Any, count: int, datatype: int, dest: int, comm: Any, stream: Any) -> None:
        self._check(self.lib.ncclSend(sendbuff, count, datatype, dest, comm, stream))

    def ncclRecv(self, recvbuff: Any, count: int, datatype: int, src: int, comm: Any, stream: Any) -> None:
        self._check(self.lib.ncclRecv(recvbuff, count, datatype, src, comm, stream))

    def ncclGroupStart(self) -> None:
        self._check(self.lib.ncclGroupStart())

    def ncclGroupEnd(self) -> None:
        self._check(self.lib.ncclGroupEnd())

    def ncclCommAbort(self, comm: Any) -> None:
        self._check(self.lib.ncclCommAbort(comm))

    def ncclCommDestroy(self, comm: Any) -> None:
        self._check(self.lib.ncclCommDestroy(comm))


def library() -> tuple[NcclLibrary, str]:
    """The library, and which binding it is."""
    try:
        return load_library(), "vLLM's NCCL binding"
    except P2pkvError:
        return StandIn(), "the check's stand-in binding (no vLLM on this machine)"
