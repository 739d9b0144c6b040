"""Pipes (the engine's `Pipe`): a communicator shared with one peer, moving blocks of one worker's cache straight
into the other's, with no host copy and no socket in the data path.

A pull by pipe moves the blocks in payload order, in chunks of at most `CHUNK_BYTES`: the sender gathers a chunk's
rows into device scratch (one gather per storage it spans) and sends it; the receiver receives a chunk into
scratch and scatters its rows. Both sides cut the payload at the same byte offsets (whole blocks of one layer), so
their chunks match whatever the two caches' layouts; the number of operations grows with the bytes (one gather and
one send per chunk), not with the blocks.

- `NcclPipes` makes them over NCCL (`p2pkv.kv.nccl`, vLLM's binding of torch's libnccl) for a cache on a GPU: the
  nccl transport. The gathers, sends, receives and scatters of a pipe run on the pipe's own stream, after the fence
  the caller names.
- `GlooPipes` makes them over torch's gloo process group for a cache in host memory. It is the stand-in that lets
  the tests run the engine's pipe protocol (set-up off the request path, chunks, confirmation, teardown) between
  real processes on machines without a GPU; selected with `P2PKV_PIPE=gloo`. It is not meant for serving: shm or
  tcp move host memory faster, and its rendezvous store is not authenticated.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from p2pkv.engine.device import Fence, Pipe, Placed
from p2pkv.errors import P2pkvError, TransferError, TransferTimeout
from p2pkv.kv.device_copy import WORDS, Marker, all_done, as_rows, event_marker, wait_marker, word_bytes
from p2pkv.kv.staging import DeviceKv, RowPiece
from p2pkv.transport.threads import engine_thread

log = logging.getLogger(__name__)
PIPE_ENV = "P2PKV_PIPE"
CHUNK_BYTES = 64 << 20  # device scratch per chunk (at most 256 MiB, NCCL's comfortable message size)


class Channel(Protocol):
    """Contiguous bytes to and from the one peer of a two-rank communicator."""

    def on_stream(self) -> contextlib.AbstractContextManager[object | None]:
        """The stream (None: the host) that the channel's operations, and the copies around them, are issued on."""

    def send(self, t: torch.Tensor, deadline: float) -> None:
        """Post a send of `t`, after what was issued before it on the channel's stream."""

    def recv(self, t: torch.Tensor, deadline: float) -> None:
        """Post a receive into `t`: what is issued after it on the channel's stream sees the bytes (a host
        channel returns once they are there)."""

    def mark(self) -> Marker:
        """A marker for every operation posted so far."""

    def close(self, abort: bool = False) -> None:
        """Free the communicator; `abort`: operations may still be pending (a transfer failed part-way)."""


def _settled(marker: Marker) -> bool:
    """A marker asked after an abort: an error it raises means its work is over too."""
    try:
        return marker()
    except Exception:
        return True


def _chunks(pieces: list[RowPiece], chunk: int) -> Iterator[list[tuple[RowPiece, int, int]]]:
    """The payload cut at every `chunk` bytes: per chunk, the (piece, first row, end row) spans it is made of."""
    spans: list[tuple[RowPiece, int, int]] = []
    room = chunk
    for piece in pieces:
        at = 0
        while at < len(piece.rows):
            n = min(len(piece.rows) - at, room // piece.row)
            spans.append((piece, at, at + n))
            at += n
            room -= n * piece.row
            if room == 0:
                yield spans
                spans, room = [], chunk
    if spans:
        yield spans


class ChannelPipe:
    """Blocks of this worker's cache sent to or received from the one peer of a two-rank channel."""

    def __init__(self, kv: DeviceKv, channel: Channel, transport: str) -> None:
        self._kv = kv
        self._channel = channel
        self.transport = transport
        self._failed = False
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def send(self, placed: Placed, deadline: float) -> None:
        self._move(placed, deadline, None, sending=True)

    def recv(self, placed: Placed, deadline: float, after: Fence | None = None) -> None:
        self._move(placed, deadline, after, sending=False)

    def _move(self, placed: Placed, deadline: float, after: Fence | None, sending: bool) -> None:
        """Gather and send, or receive and scatter, chunk by chunk on the channel's stream. At the deadline (or a
        failure) the channel is aborted first, its kernels stop, and what was issued behind them is waited for
        before the failure is told: no scatter writes into the blocks after the load is reported failed."""
        if self._closed or self._failed:
            raise TransferError(f"the {self.transport} pipe is closed")
        unit = placed.nbytes // max(1, placed.num_blocks * len(placed.layers))  # one layer of one block
        chunk = max(unit, CHUNK_BYTES // max(1, unit) * unit)
        ops = self._kv.ops
        marker: Marker | None = None
        failure: BaseException | None = None
        try:
            pieces = self._kv.pieces(placed)
            with self._channel.on_stream() as stream, ops.issue([], stream):
                try:
                    self._chunks(pieces, chunk, deadline, after, sending)
                finally:
                    marker = all_done([ops.mark(), self._channel.mark()])
            if not wait_marker(marker, deadline):
                failure = TransferTimeout(f"the {self.transport} pipe missed the transfer's deadline")
        except P2pkvError as exc:
            failure = exc
        except Exception as exc:  # NCCL's or CUDA's own errors end here, as the transfer's
            failure = TransferError(f"{self.transport}: {exc}")
        if failure is None:
            return
        self._failed = True
        self._channel.close(abort=True)
        if marker is not None and not wait_marker(lambda: _settled(marker), time.monotonic() + self._kv.copy_timeout_s):
            log.error("%s pipe: copies still running %.0f s after the abort", self.transport, self._kv.copy_timeout_s)
        raise failure

    def _chunks(self, pieces: list[RowPiece], chunk: int, deadline: float, after: Fence | None,
                sending: bool) -> None:
        ops = self._kv.ops
        waited = after is None
        for spans in _chunks(pieces, chunk):
            nbytes = sum((end - first) * piece.row for piece, first, end in spans)
            scratch = ops.empty(nbytes)
            if not sending:
                self._channel.recv(scratch, deadline)
                if not waited:  # the receive need not wait for vLLM's zeroing; the first scatter does
                    ops.wait(after)  # type: ignore[arg-type]
                    waited = True
            at = 0
            for piece, first, end in spans:
                cache = self._kv.flat[piece.storage]
                part = scratch[at : at + (end - first) * piece.row]
                word = word_bytes(piece.row, cache.data_ptr(), part.data_ptr())
                rows, mine = as_rows(cache, piece.row, word), part.view(-1, piece.row).view(WORDS[word])
                index = ops.index(piece.rows[first:end])
                ops.gather(mine, rows, index) if sending else ops.scatter(rows, index, mine)
                at += part.numel()
            if sending:
                self._channel.send(scratch, deadline)

    def close(self, abort: bool = False) -> None:
        if not self._closed:
            self._closed = True
            self._channel.close(abort=abort or self._failed)


class _Maker:
    """What both makers share: where blocks lie in the cache, and the pipe around a channel."""

    kind = ""

    def __init__(self, kv: DeviceKv) -> None:
        self.kv = kv

    def places(self, block_ids: Sequence[int]) -> Placed:
        return self.kv.places(range(self.kv.num_layers), block_ids)

    def bytes_digest(self, placed: Placed) -> int | None:
        return self.kv.bytes_digest(placed)

    def _pipe(self, channel: Channel) -> ChannelPipe:
        return ChannelPipe(self.kv, channel, self.kind)


class NcclChannel:
    """An NCCL communicator of two ranks and the stream its operations run on."""

    def __init__(self, comm: Any, peer: int, device: torch.device) -> None:
        from p2pkv.kv.nccl import Communicator

        self._comm: Communicator = comm
        self._peer = peer
        self._device = device
        with torch.cuda.device(device):
            self._stream = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[object | None]:
        with torch.cuda.device(self._device):  # engine threads' current device is GPU 0 until it is set
            yield self._stream

    def send(self, t: torch.Tensor, deadline: float) -> None:
        self._comm.send(t.data_ptr(), t.numel(), self._peer, self._stream.cuda_stream, deadline)

    def recv(self, t: torch.Tensor, deadline: float) -> None:
        self._comm.recv(t.data_ptr(), t.numel(), self._peer, self._stream.cuda_stream, deadline)

    def mark(self) -> Marker:
        """The stream's progress, and NCCL's own account of the communicator (an error NCCL detected, such as a
        peer gone, fails the transfer at once rather than at its deadline)."""
        with torch.cuda.device(self._device):
            event = torch.cuda.Event()
            event.record(self._stream)
        progress = event_marker(event, self._device)

        def marker() -> bool:
            self._comm.check()
            return progress()

        return marker

    def close(self, abort: bool = False) -> None:
        self._comm.close(abort=abort)


class NcclPipes(_Maker):
    kind = "nccl"

    def __init__(self, kv: DeviceKv, channels: int, lib: Any) -> None:
        """`lib`: vLLM's NCCL binding (`p2pkv.kv.nccl.load_library`)."""
        super().__init__(kv)
        self._channels = channels
        self._lib = lib
        self._device = kv.flat[0].device

    def _open(self, uid: bytes, rank: int, deadline: float) -> Pipe:
        from p2pkv.kv.nccl import Communicator

        with torch.cuda.device(self._device):
            comm = Communicator(self._lib, 2, uid, rank, self._channels, deadline)
        return self._pipe(NcclChannel(comm, 1 - rank, self._device))

    def create(self) -> tuple[bytes, Callable[[float], Pipe]]:
        from p2pkv.kv.nccl import unique_id

        uid = unique_id(self._lib)
        return uid, lambda deadline: self._open(uid, 0, deadline)

    def join(self, token: bytes, deadline: float) -> Pipe:
        return self._open(token, 1, deadline)


def _remaining(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, deadline - time.monotonic()))


class GlooChannel:
    """Gloo's sends complete only inside `wait()`: they are awaited on a thread, and the marker reads the outcome.
    A receive is waited for where it is posted (a host channel: the scatter after it reads the bytes at once)."""

    def __init__(self, group: Any, store: Any, peer: int, timeout_s: float) -> None:
        self._group = group
        self._store = store  # rank 0's store serves the rendezvous: kept for the channel's life
        self._peer = peer
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._tag = 0
        self._sent: list[tuple[Any, torch.Tensor]] = []

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[object | None]:
        yield None

    def send(self, t: torch.Tensor, deadline: float) -> None:
        self._sent.append((self._group.send([t], self._peer, self._tag), t))
        self._tag += 1

    def recv(self, t: torch.Tensor, deadline: float) -> None:
        work = self._group.recv([t], self._peer, self._tag)
        self._tag += 1
        try:
            work.wait(_remaining(deadline))
        except RuntimeError as exc:  # the peer went away, or the deadline passed
            raise TransferError(f"gloo: {exc}") from None

    def mark(self) -> Marker:
        sent, self._sent = self._sent, []
        finished = threading.Event()
        errors: list[str] = []

        def wait_all() -> None:
            try:
                for work, _ in sent:
                    work.wait(self._timeout)
            except RuntimeError as exc:  # the peer went away, or the timeout passed
                errors.append(str(exc))
            finished.set()

        if not sent:
            return lambda: True
        engine_thread(wait_all, "p2pkv-gloo-wait").start()

        def done() -> bool:
            if errors:
                raise TransferError(f"gloo: {errors[0]}")
            return finished.is_set()

        return done

    def close(self, abort: bool = False) -> None:
        self._group = self._store = None


class GlooPipes(_Maker):
    kind = "gloo"

    def __init__(self, kv: DeviceKv, host: str) -> None:
        super().__init__(kv)
        self._host = host

    def create(self) -> tuple[bytes, Callable[[float], ChannelPipe]]:
        store = dist.TCPStore(self._host, 0, 2, True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
        token = f"{self._host}|{store.port}".encode()

        def setup(deadline: float) -> ChannelPipe:
            group = dist.ProcessGroupGloo(store, 0, 2, _remaining(deadline))
            return self._pipe(GlooChannel(group, store, 1, self.kv.copy_timeout_s))

        return token, setup

    def join(self, token: bytes, deadline: float) -> ChannelPipe:
        host, _, port = token.decode().rpartition("|")
        if not host or not port.isdigit():
            raise P2pkvError(f"a gloo pipe token is host|port, got {token!r}")
        store = dist.TCPStore(host, int(port), 2, False, timeout=_remaining(deadline))
        group = dist.ProcessGroupGloo(store, 1, 2, _remaining(deadline))
        return self._pipe(GlooChannel(group, store, 0, self.kv.copy_timeout_s))


def make_pipes(kv: DeviceKv, host: str, channels: int) -> NcclPipes | GlooPipes | None:
    """The pipe maker this worker can use, if any: gloo when asked for (tests), NCCL for a GPU cache where vLLM's
    NCCL binding loads."""
    if os.environ.get(PIPE_ENV) == "gloo":
        return GlooPipes(kv, host)
    if not kv.on_gpu:
        return None
    from p2pkv.kv.nccl import load_library

    try:
        return NcclPipes(kv, channels, load_library())
    except P2pkvError as exc:
        log.warning("%s: GPU KV moves between hosts through host memory, not NCCL", exc)
        return None
