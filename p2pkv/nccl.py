"""The NCCL data plane's pipe: one communicator per peer pair, grouped sends and receives on a stream of its own.

Bound through `cupy.cuda.nccl`: a maintained binding of the NCCL library, used by the old connector's users' stacks
already (vLLM's own pynccl wraps the same library with ctypes); PyTorch's `torch.cuda.nccl` has no point-to-point
calls. The engine uses it through `p2pkv.pipes.NcclPipes` (GET pulls between GPU workers that cannot open each
other's memory); `scripts/gpu_check.sh` checks it with a one-rank send to itself (NCCL refuses two ranks on one
GPU), and the tests run the same engine protocol over gloo.

- the unique id travels as 128 bytes (`unique_id`), over the control plane; CuPy takes it back as bytes from version
  14 on, as a tuple of signed chars before (`communicator` passes whichever form the installed CuPy accepts);
- `exchange` issues every send and receive of a request in one `groupStart`/`groupEnd`, on the pipe's stream after
  the work queued on the compute stream, and returns a marker (a CUDA event): no host-side stream synchronize;
- `nccl_num_channels` goes to NCCL as NCCL_MIN_NCHANNELS/NCCL_MAX_NCHANNELS before the communicator is made;
- `close` destroys the communicator (when the peer leaves or restarts), or aborts it after a failed transfer.
- `ncclCommInitRank` blocks until the peer joins: the engine runs it on a thread of its own, to a deadline
  (`p2pkv.engine.pipes.PipeSlot`), and frees a communicator made after it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from p2pkv.device_copy import Marker, event_marker
from p2pkv.errors import P2pkvError

UNIQUE_ID_BYTES = 128


def _nccl() -> Any:
    try:
        from cupy.cuda import nccl  # type: ignore[import-not-found]
    except ImportError as exc:
        raise P2pkvError(f"the nccl transport needs CuPy with NCCL (cupy-cuda12x or cupy-cuda13x): {exc}") from None
    return nccl


def to_bytes(uid: Sequence[int]) -> bytes:
    """NCCL's unique id (cupy gives it as 128 signed chars) as bytes for the control plane."""
    if len(uid) != UNIQUE_ID_BYTES:
        raise P2pkvError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
    return bytes(c & 0xFF for c in uid)


def from_bytes(raw: bytes) -> tuple[int, ...]:
    """The id back in cupy's form (signed chars)."""
    if len(raw) != UNIQUE_ID_BYTES:
        raise P2pkvError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    return tuple(b - 256 if b > 127 else b for b in raw)


def unique_id() -> bytes:
    return to_bytes(_nccl().get_unique_id())


def communicator(nccl: Any, nranks: int, uid: bytes, rank: int) -> Any:
    """`ncclCommInitRank` through CuPy, which takes the id as bytes from CuPy 14 on (and `get_unique_id` returns
    bytes), as a tuple of signed chars before. A wrong form is refused with TypeError before NCCL is called."""
    try:
        return nccl.NcclCommunicator(nranks, uid, rank)
    except TypeError:
        return nccl.NcclCommunicator(nranks, from_bytes(uid), rank)


class NcclPipe:
    def __init__(self, nranks: int, uid: bytes, rank: int, device: torch.device, channels: int) -> None:
        nccl = _nccl()
        for key in ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"):
            os.environ[key] = str(channels)  # read by NCCL when the communicator is made
        self._device = device
        with torch.cuda.device(device):
            self._comm = communicator(nccl, nranks, uid, rank)
            self._stream = torch.cuda.Stream(device)
        self._closed = False

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> Marker:
        """Send and receive contiguous byte tensors (each with its peer rank) in one grouped call."""
        nccl = _nccl()
        for t, _ in (*sends, *recvs):
            if t.dtype != torch.uint8 or not t.is_contiguous() or t.device != self._device:
                raise P2pkvError("NCCL pieces must be contiguous uint8 tensors on the pipe's device")
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        stream = self._stream.cuda_stream
        # The engine's threads call this, and a thread's current device is GPU 0 until it is set: the calls are
        # made on the communicator's device, as its creation was.
        with torch.cuda.device(self._device):
            nccl.groupStart()
            try:
                for t, peer in sends:
                    self._comm.send(t.data_ptr(), t.numel(), nccl.NCCL_UINT8, peer, stream)
                for t, peer in recvs:
                    self._comm.recv(t.data_ptr(), t.numel(), nccl.NCCL_UINT8, peer, stream)
            finally:
                nccl.groupEnd()
        for t, _ in (*sends, *recvs):
            t.record_stream(self._stream)  # the caching allocator keeps their memory until the stream is past
        event = torch.cuda.Event()
        event.record(self._stream)
        return event_marker(event, self._device)

    def close(self, abort: bool = False) -> None:
        """`abort` where operations may still be pending (a transfer failed part-way): destroy would wait for them."""
        if not self._closed:
            self._closed = True
            if abort:
                self._comm.abort()
            else:
                self._comm.destroy()
