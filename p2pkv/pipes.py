"""Pipes (the engine's `Pipe`): a communicator shared with one peer, moving pieces of one worker's cache straight
into the other's, with no host copy and no socket in the data path.

- `NcclPipes` makes them over NCCL (`p2pkv.nccl.NcclPipe`) for a cache on a GPU: the nccl transport.
- `GlooPipes` makes them over torch's gloo process group for a cache in host memory. It is the stand-in that lets
  the tests run the engine's pipe protocol (set-up off the request path, paired pieces, confirmation, teardown)
  between real processes on machines without a GPU; selected with `P2PKV_PIPE=gloo`. It is not meant for serving:
  shm or tcp move host memory faster, and its rendezvous store is not authenticated.
"""

from __future__ import annotations

import datetime
import importlib.util
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from p2pkv.device_copy import Marker, settle
from p2pkv.engine.device import Piece, Pipe, Run
from p2pkv.engine.threads import engine_thread
from p2pkv.errors import P2pkvError, TransferError, TransferTimeout
from p2pkv.staging import DeviceKv

log = logging.getLogger(__name__)
PIPE_ENV = "P2PKV_PIPE"
Pieces = Sequence[tuple[torch.Tensor, int]]  # contiguous uint8 tensors, each with the peer rank


class Channel(Protocol):
    def exchange(self, sends: Pieces, recvs: Pieces) -> Marker:
        """Post the sends and receives as one group; the marker says when all are done."""

    def close(self, abort: bool = False) -> None:
        """Free the communicator; `abort`: operations may still be pending (a transfer failed part-way)."""


class ChannelPipe:
    """Pieces of this worker's cache sent to or received from the one peer of a two-rank channel."""

    def __init__(self, kv: DeviceKv, channel: Channel, transport: str, peer_rank: int) -> None:
        self._kv = kv
        self._channel = channel
        self.transport = transport
        self._peer = peer_rank
        self._failed = False
        self._closed = False

    def _views(self, pieces: Sequence[Piece]) -> list[tuple[torch.Tensor, int]]:
        views = []
        for layer, offset, n in pieces:
            storage = self._kv.storages[layer]
            if offset < 0 or n <= 0 or offset + n > storage.numel():
                raise P2pkvError(f"piece {offset}+{n} lies outside layer {layer}'s {storage.numel()} bytes")
            views.append((storage[offset : offset + n], self._peer))
        return views

    def exchange(self, sends: Sequence[Piece], recvs: Sequence[Piece], deadline: float) -> None:
        """Both directions in one group (the GPU check's one-rank pipe sends to itself this way)."""
        if self._closed or self._failed:
            raise TransferError(f"the {self.transport} pipe is closed")
        try:
            marker = self._channel.exchange(self._views(sends), self._views(recvs))
            done = settle([marker], deadline, self._kv.copy_timeout_s)
        except P2pkvError:
            self._failed = True
            raise
        except Exception as exc:  # NCCL's or CUDA's own errors end here, as the transfer's
            self._failed = True
            raise TransferError(f"{self.transport}: {exc}") from exc
        if not done:
            self._failed = True
            raise TransferTimeout(f"the {self.transport} pipe missed the transfer's deadline")

    @property
    def closed(self) -> bool:
        return self._closed

    def send(self, pieces: Sequence[Piece], deadline: float) -> None:
        self.exchange(pieces, (), deadline)

    def recv(self, pieces: Sequence[Piece], deadline: float) -> None:
        self.exchange((), pieces, deadline)

    def close(self, abort: bool = False) -> None:
        if not self._closed:
            self._closed = True
            self._channel.close(abort=abort or self._failed)


class _Maker:
    """What both makers share: the cache's runs and the pipe around a channel."""

    kind = ""

    def __init__(self, kv: DeviceKv) -> None:
        self.kv = kv

    def runs(self, layer: int, block_ids: Sequence[int]) -> list[Run]:
        return self.kv.geometry[layer].ranges(block_ids)

    def bytes_digest(self, pieces: Sequence[Piece]) -> int | None:
        return self.kv.bytes_digest(pieces)

    def _pipe(self, channel: Channel, rank: int) -> ChannelPipe:
        return ChannelPipe(self.kv, channel, self.kind, 1 - rank)


class NcclPipes(_Maker):
    kind = "nccl"

    def __init__(self, kv: DeviceKv, channels: int) -> None:
        super().__init__(kv)
        self._channels = channels
        self._device = kv.storages[0].device

    def _open(self, uid: bytes, rank: int) -> Pipe:
        from p2pkv.nccl import NcclPipe  # CuPy is imported only where NCCL is used

        return self._pipe(NcclPipe(2, uid, rank, self._device, self._channels), rank)

    def create(self) -> tuple[bytes, Callable[[float], Pipe]]:
        from p2pkv.nccl import unique_id

        uid = unique_id()
        return uid, lambda _deadline: self._open(uid, 0)  # the slot holds the deadline: init cannot be bounded

    def join(self, token: bytes, deadline: float) -> Pipe:
        return self._open(token, 1)


def _remaining(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, deadline - time.monotonic()))


class GlooChannel:
    """Gloo's send and receive complete only inside `wait()`: each exchange is awaited on a thread of its own,
    bounded by the channel's timeout, and the marker reads its outcome."""

    def __init__(self, group: Any, store: Any, timeout_s: float) -> None:
        self._group = group
        self._store = store  # rank 0's store serves the rendezvous: kept for the channel's life
        self._timeout = datetime.timedelta(seconds=timeout_s)

    def exchange(self, sends: Pieces, recvs: Pieces) -> Marker:
        works = [self._group.send([t], peer, tag) for tag, (t, peer) in enumerate(sends)]
        works += [self._group.recv([t], peer, tag) for tag, (t, peer) in enumerate(recvs)]
        finished = threading.Event()
        errors: list[str] = []

        def wait_all() -> None:
            try:
                for w in works:
                    w.wait(self._timeout)
            except RuntimeError as exc:  # the peer went away, or the timeout passed
                errors.append(str(exc))
            finished.set()

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
        store = dist.TCPStore(self._host, 0, 2, True, wait_for_workers=False,
                                           timeout=datetime.timedelta(seconds=60))
        token = f"{self._host}|{store.port}".encode()

        def setup(deadline: float) -> ChannelPipe:
            group = dist.ProcessGroupGloo(store, 0, 2, _remaining(deadline))
            return self._pipe(GlooChannel(group, store, self.kv.copy_timeout_s), 0)

        return token, setup

    def join(self, token: bytes, deadline: float) -> ChannelPipe:
        host, _, port = token.decode().rpartition("|")
        if not host or not port.isdigit():
            raise P2pkvError(f"a gloo pipe token is host|port, got {token!r}")
        store = dist.TCPStore(host, int(port), 2, False, timeout=_remaining(deadline))
        group = dist.ProcessGroupGloo(store, 1, 2, _remaining(deadline))
        return self._pipe(GlooChannel(group, store, self.kv.copy_timeout_s), 1)


def make_pipes(kv: DeviceKv, host: str, channels: int) -> NcclPipes | GlooPipes | None:
    """The pipe maker this worker can use, if any: gloo when asked for (tests), NCCL for a GPU cache with CuPy."""
    if os.environ.get(PIPE_ENV) == "gloo":
        return GlooPipes(kv, host)
    if kv.on_gpu and importlib.util.find_spec("cupy") is not None:
        return NcclPipes(kv, channels)
    if kv.on_gpu:
        log.info("CuPy is not installed: GPU KV moves between hosts through host memory, not NCCL")
    return None
