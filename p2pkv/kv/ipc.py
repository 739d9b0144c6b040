"""cuda_ipc: a worker's KV cache opened by a peer on the same host, which copies the blocks it pulls straight
from the sender's cache into its own, device to device, with no host copy.

Each worker exports its layers once (`CacheAccess.export`, sent in the handshake reply); a peer opens them once per
link (`CacheAccess.open`). A GPU cache is exported with CUDA IPC through torch (`UntypedStorage._share_cuda_`, the
call torch.multiprocessing uses; opened with `_new_shared_cuda`, which maps each allocation once per process).
A CPU cache (`P2PKV_STAGE_KV=1`) is exported as addresses that the peer reads with process_vm_readv: the same
protocol and bookkeeping, run by the tests on machines without a GPU.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import torch

from p2pkv.engine.device import Fence, Placed, RemoteCache
from p2pkv.errors import P2pkvError, TransferTimeout
from p2pkv.kv.device_copy import Marker, PartialCopy, done, settle, wait_marker
from p2pkv.kv.layout import ids_array, placed_ranges
from p2pkv.kv.staging import DeviceKv
from p2pkv.protocol import DeviceExport, DeviceHome
from p2pkv.transport import cma
from p2pkv.transport.split_read import SplitReader

log = logging.getLogger(__name__)


def _check_storages(placed: Placed, sizes: Sequence[int], whose: str) -> None:
    """Every place names a storage that exists and every block lies inside it."""
    ids = ids_array(placed.block_ids)
    low, high = (int(ids.min()), int(ids.max())) if len(ids) else (0, 0)
    for p in placed.layers:
        if not 0 <= p.storage < len(sizes):
            raise P2pkvError(f"storage {p.storage} of {whose} {len(sizes)}")
        for b in (low, high):
            for offset, n in p.inner:
                at = p.base + b * p.block_stride + offset
                if at < 0 or n < 0 or at + n > sizes[p.storage]:
                    raise P2pkvError(f"block {b} lies outside {whose} storage {p.storage} of {sizes[p.storage]} "
                                     "bytes")


def _visible_gpus() -> dict[str, int]:
    """This process's GPUs by UUID, with its own index of each."""
    return {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}


class CudaRemote:
    transport = "cuda_ipc"

    def __init__(self, kv: DeviceKv, export: DeviceExport, kept: list[torch.Tensor]) -> None:
        """`kept`: where storages a copy may still read are kept mapped (for the worker's life)."""
        self._kv = kv
        self._kept = kept
        # The peer's device index means nothing here (each process numbers the GPUs it sees): its GPU is found by
        # UUID among ours, and must be visible. The export opens on this worker's own device (peer access where the
        # two differ): copies then run as device copies on our stream, and no context is made on the peer's GPU.
        if _visible_gpus().get(export.device) is None:
            raise P2pkvError(f"the peer's GPU {export.device} is not visible to this process (CUDA_VISIBLE_DEVICES)")
        own = kv.flat[0].device
        self._storages: list[torch.Tensor] = []
        self._last: Marker = done  # the latest copy out of the opened storages
        try:
            with torch.cuda.device(own):
                for handle in export.handles:
                    storage = torch.UntypedStorage._new_shared_cuda(own.index, *handle[1:])
                    self._storages.append(torch.empty(0, dtype=torch.uint8, device=own).set_(storage))
        except (RuntimeError, TypeError) as exc:
            raise P2pkvError(f"CUDA IPC open failed: {exc}") from None

    def issue(self, theirs: Placed, ours: Placed, after: Fence | None = None) -> Marker:
        """Issue the copy: one gather from the peer's storage and one scatter into ours per pair of storages (per
        chunk of scratch), after `after`; the number of device operations does not grow with the blocks'."""
        _check_storages(theirs, [s.numel() for s in self._storages], "the peer's")
        _check_storages(ours, [s.numel() for s in self._kv.flat], "our")
        if theirs.nbytes != ours.nbytes:
            raise P2pkvError(f"the peer's blocks hold {theirs.nbytes} bytes, ours {ours.nbytes}")
        try:
            self._last = self._kv.copy_from(self._storages, theirs, ours, [after] if after is not None else [])
        except PartialCopy as exc:  # what was issued reads the peer's memory and writes ours: let it finish
            self._last = exc.pending
            settle([exc.pending], time.monotonic() + self._kv.copy_timeout_s, self._kv.copy_timeout_s)
            raise
        return self._last

    def copy(self, theirs: Placed, ours: Placed, deadline: float, after: Fence | None = None) -> int:
        marker = self.issue(theirs, ours, after)
        # On a miss the load is reported failed and vLLM may reuse these blocks: settle lets the copies finish first.
        if not settle([marker], deadline, self._kv.copy_timeout_s):
            raise TransferTimeout("copying from the peer's GPU missed the deadline")
        return theirs.nbytes

    def close(self) -> None:
        """Unmaps the peer's storages once no copy reads them; one still running past a grace is left mapped (an
        unmapped read is a fault that ends the worker)."""
        if not wait_marker(self._last, time.monotonic() + self._kv.copy_timeout_s):
            log.error("a copy out of a peer's cache outlived its deadline; its mapping is kept")
            self._kept.extend(self._storages)
        self._storages.clear()


def _span(handle: Sequence[object]) -> tuple[int, int]:
    if len(handle) != 2 or not isinstance(handle[0], int) or not isinstance(handle[1], int):
        raise P2pkvError(f"a host export entry is (address, size), got {handle!r}")
    return handle[0], handle[1]


class HostRemote:
    """cuda_ipc's stand-in for caches in host memory: the peer's storages read with process_vm_readv."""

    transport = "host_ipc"

    def __init__(self, kv: DeviceKv, export: DeviceExport) -> None:
        self._kv = kv
        self._pid = export.pid
        self._spans = [_span(h) for h in export.handles]
        self._local = [memoryview(s.numpy()) for s in kv.flat]
        self._reader = SplitReader(self._pid)  # large runs on two threads, as shm payloads
        if self._spans and self._spans[0][1]:
            probe = bytearray(1)
            cma.read_remote(self._pid, memoryview(probe), [(self._spans[0][0], 1)])  # TransferError if unreadable

    def copy(self, theirs: Placed, ours: Placed, deadline: float, after: Fence | None = None) -> int:
        _check_storages(theirs, [n for _, n in self._spans], "the peer's")
        _check_storages(ours, [v.nbytes for v in self._local], "our")
        if theirs.nbytes != ours.nbytes:
            raise P2pkvError(f"the peer's blocks hold {theirs.nbytes} bytes, ours {ours.nbytes}")
        remote = [(self._spans[s][0] + a, n) for s, a, n in placed_ranges(theirs.block_ids, theirs.layers)]
        views = [self._local[s][a : a + n] for s, a, n in placed_ranges(ours.block_ids, ours.layers)]
        self._reader.read(views, remote)
        if time.monotonic() > deadline:
            raise TransferTimeout("copying from the peer's memory missed the deadline")
        return theirs.nbytes

    def close(self) -> None:
        self._reader.close()
        self._local.clear()


class CacheAccess:
    """This worker's cache as peers on this host open it, and their caches opened here."""

    def __init__(self, kv: DeviceKv) -> None:
        self.kv = kv
        self.kind = "cuda" if kv.on_gpu else "host"
        self._kept: list[torch.Tensor] = []  # peers' storages whose copies outlived their deadline

    def export(self) -> DeviceExport:
        """Each storage once (vLLM allocates one for every layer)."""
        if self.kind == "cuda":
            handles = [tuple(s.untyped_storage()._share_cuda_()) for s in self.kv.flat]
            device = str(torch.cuda.get_device_properties(self.kv.flat[0].device).uuid)
        else:
            cma.allow_readers()
            handles = [(s.data_ptr(), s.numel()) for s in self.kv.flat]
            device = ""
        return DeviceExport(self.kind, cma.boot_id(), os.getpid(), device, handles)

    def places(self, block_ids: Sequence[int]) -> Placed:
        return self.kv.places(range(self.kv.num_layers), block_ids)

    def bytes_digest(self, placed: Placed) -> int | None:
        return self.kv.bytes_digest(placed)

    def reaches(self, home: DeviceHome) -> bool:
        if home.kind != self.kind or home.boot_id != cma.boot_id():
            return False
        return self.kind == "host" or home.device in _visible_gpus()

    def open(self, export: DeviceExport) -> RemoteCache:
        if export.kind != self.kind:
            raise P2pkvError(f"the peer exports a {export.kind} cache, this worker's is {self.kind}")
        if export.boot_id != cma.boot_id():
            raise P2pkvError("the peer is on another host")
        if not export.handles:
            raise P2pkvError("the peer exports no layers")
        if self.kind == "cuda":
            return CudaRemote(self.kv, export, self._kept)
        try:
            return HostRemote(self.kv, export)
        except P2pkvError as exc:
            raise P2pkvError(f"the peer's memory cannot be read: {exc}") from None


