"""The NCCL data plane's communicator, through vLLM's own binding of torch's libnccl
(`vllm.distributed.device_communicators.pynccl_wrapper.NCCLLibrary`): present wherever vLLM's CUDA build is, where
CuPy is not.

- The communicator is made without blocking where the library can (`ncclCommInitRankConfig` with `blocking` 0,
  NCCL 2.14+): its set-up is polled (`ncclCommGetAsyncError`) to a deadline and aborted past it, so a peer that
  never joins leaves no thread stuck in NCCL. `nccl_num_channels` goes to NCCL through the same config
  (`minCTAs`/`maxCTAs`), not through the process environment.
- Each send or receive is one group (`ncclGroupStart`, the call, `ncclGroupEnd`) on the caller's stream; with a
  non-blocking communicator the group's end is polled to the transfer's deadline too.
- `abort` (`ncclCommAbort`) stops the communicator's kernels at once: a transfer past its deadline, a peer gone.

`unique_id` and the ids' bytes travel over the control plane (`PipeOpen.token`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Any, Protocol

from p2pkv.errors import P2pkvError, TransferError, TransferTimeout

log = logging.getLogger(__name__)
UNIQUE_ID_BYTES = 128
SUCCESS, IN_PROGRESS = 0, 7  # ncclResult_t
UINT8 = 1  # ncclDataType_t ncclUint8
_CONFIG_MAGIC = 0xCAFEBEEF
_CONFIG_VERSION = 21700  # the fields below are NCCL 2.17's; later libraries read an older config by its version
_UNDEF_INT = -(2**31)  # NCCL_CONFIG_UNDEF_INT: NCCL's default
_SPIN_S = 0.002  # a group's enqueueing is polled without sleeping this long (chunks follow one another closely)
_POLL_S = 0.0005


class NcclConfig(ctypes.Structure):
    """ncclConfig_t's first fields (NCCL 2.18's; version 2.17.0 declared: NCCL reads the fields a version has and
    defaults the rest)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
    ]


def config(channels: int) -> NcclConfig:
    """A non-blocking communicator's config with `channels` channels (0: NCCL's choice)."""
    count = channels if channels > 0 else _UNDEF_INT
    return NcclConfig(ctypes.sizeof(NcclConfig), _CONFIG_MAGIC, _CONFIG_VERSION, 0, _UNDEF_INT, count, count, None,
                      _UNDEF_INT)


class NcclLibrary(Protocol):
    """What p2pkv calls of vLLM's `NCCLLibrary` (the same signatures); `lib` is the loaded ctypes library."""

    lib: Any

    def ncclGetErrorString(self, result: int) -> str: ...
    def ncclGetUniqueId(self) -> Any: ...
    def unique_id_from_bytes(self, data: bytes) -> Any: ...
    def ncclCommInitRank(self, world_size: int, unique_id: Any, rank: int) -> Any: ...
    def ncclSend(self, sendbuff: Any, count: int, datatype: int, dest: int, comm: Any, stream: Any) -> None: ...
    def ncclRecv(self, recvbuff: Any, count: int, datatype: int, src: int, comm: Any, stream: Any) -> None: ...
    def ncclGroupStart(self) -> None: ...
    def ncclGroupEnd(self) -> None: ...
    def ncclCommAbort(self, comm: Any) -> None: ...
    def ncclCommDestroy(self, comm: Any) -> None: ...


def load_library() -> NcclLibrary:
    """vLLM's binding of the NCCL library torch loads; P2pkvError where there is none (no CUDA build of vLLM)."""
    try:
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary
    except ImportError as exc:
        raise P2pkvError(f"the nccl transport needs vLLM's NCCL binding (a CUDA build of vLLM): {exc}") from None
    try:
        library: NcclLibrary = NCCLLibrary()
    except Exception as exc:  # no libnccl where vLLM looks for it
        raise P2pkvError(f"the NCCL library could not be loaded: {exc}") from None
    return library


def unique_id(lib: NcclLibrary) -> bytes:
    uid = lib.ncclGetUniqueId()  # kept while its bytes are read
    return bytes(ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES))


class Communicator:
    """One NCCL communicator of `nranks`, this process's rank `rank`. Made in the constructor, which returns once
    every rank has joined or raises at `deadline` (having aborted what it began)."""

    def __init__(self, lib: NcclLibrary, nranks: int, uid: bytes, rank: int, channels: int, deadline: float) -> None:
        if len(uid) != UNIQUE_ID_BYTES:
            raise P2pkvError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        self._lib = lib
        self._closed = False
        self._lock = threading.Lock()  # calls and close from different threads (a transfer, the link's teardown)
        init = getattr(lib.lib, "ncclCommInitRankConfig", None)
        self._poll = getattr(lib.lib, "ncclCommGetAsyncError", None)
        if init is None or self._poll is None:
            log.warning("this NCCL has no ncclCommInitRankConfig: nccl_num_channels is not applied, and making a "
                        "communicator waits for the peer without a deadline")
            self._poll = None
            self.comm = lib.ncclCommInitRank(nranks, lib.unique_id_from_bytes(uid), rank)
            return
        commid = lib.unique_id_from_bytes(uid)
        # vLLM's binding leaves these two out: declared here, on the same library.
        init.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, type(commid), ctypes.c_int,
                         ctypes.POINTER(NcclConfig)]
        init.restype = ctypes.c_int
        self._poll.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        self._poll.restype = ctypes.c_int
        self.comm = ctypes.c_void_p()
        settings = config(channels)
        result = init(ctypes.byref(self.comm), nranks, commid, rank, ctypes.byref(settings))
        self._settle(result, deadline, "making the communicator")

    def _state(self) -> int:
        """NCCL's state of the communicator (every call on it holds the lock: none runs on a freed one)."""
        with self._lock:
            if self._closed:
                raise TransferError("NCCL: the communicator was closed")
            state = ctypes.c_int(SUCCESS)
            assert self._poll is not None
            self._poll(self.comm, ctypes.byref(state))
            return int(state.value)

    def _settle(self, result: int, deadline: float, what: str) -> None:
        """A call's result; where it is still in progress (a non-blocking communicator), poll to the deadline (first
        without sleeping) and abort past it."""
        spin_until = time.monotonic() + _SPIN_S
        while result == IN_PROGRESS:
            now = time.monotonic()
            if now > deadline:
                self._abort_quietly()
                raise TransferTimeout(f"NCCL: {what} missed its deadline")
            if now < spin_until:
                os.sched_yield()
            else:
                time.sleep(_POLL_S)
            result = self._state()
        if result != SUCCESS:
            self._abort_quietly()
            raise TransferError(f"NCCL: {what} failed: {self._lib.ncclGetErrorString(result)}")

    def _abort_quietly(self) -> None:
        """Abort after a failure; an error from the abort itself is logged, not raised over the failure's."""
        try:
            self.close(abort=True)
        except Exception as exc:
            log.error("NCCL: aborting the communicator failed: %r", exc)

    def check(self) -> None:
        """TransferError if NCCL found the communicator broken (a peer gone); nothing without a way to ask."""
        if self._poll is None or self._closed:
            return
        result = self._state()
        if result not in (SUCCESS, IN_PROGRESS):
            raise TransferError(f"NCCL: {self._lib.ncclGetErrorString(result)}")

    def _group(self, post: Any, deadline: float, what: str) -> None:
        with self._lock:
            if self._closed:
                raise TransferError(f"NCCL: {what} on a closed communicator")
            self._lib.ncclGroupStart()
            try:
                post()
            finally:
                end = getattr(self._lib.lib, "ncclGroupEnd", None)
                if self._poll is not None and end is not None:
                    result = end()
                else:
                    self._lib.ncclGroupEnd()
                    result = SUCCESS
        self._settle(result, deadline, what)

    def send(self, address: int, nbytes: int, peer: int, stream: int, deadline: float) -> None:
        """Post a send of `nbytes` at `address` on `stream` (a CUDA stream's handle)."""
        self._group(lambda: self._lib.ncclSend(address, nbytes, UINT8, peer, self.comm, stream), deadline,
                    "a send")

    def recv(self, address: int, nbytes: int, peer: int, stream: int, deadline: float) -> None:
        self._group(lambda: self._lib.ncclRecv(address, nbytes, UINT8, peer, self.comm, stream), deadline,
                    "a receive")

    def exchange(self, send: int, recv: int, nbytes: int, peer: int, stream: int, deadline: float) -> None:
        """A send and a receive of `nbytes` in one group (the GPU check's one-rank communicator sends to itself)."""

        def post() -> None:
            self._lib.ncclSend(send, nbytes, UINT8, peer, self.comm, stream)
            self._lib.ncclRecv(recv, nbytes, UINT8, peer, self.comm, stream)

        self._group(post, deadline, "a send and a receive")

    def close(self, abort: bool = False) -> None:
        """Idempotent. `abort`: operations may be pending or the peer gone; the communicator's kernels stop at
        once (destroying would wait for them)."""
        with self._lock:  # the calls of a non-blocking communicator return at once: none holds it long
            if self._closed:
                return
            self._closed = True
            if abort:
                self._lib.ncclCommAbort(self.comm)
            else:
                self._lib.ncclCommDestroy(self.comm)
