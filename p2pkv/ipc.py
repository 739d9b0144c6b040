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

from p2pkv.device_copy import settle
from p2pkv.engine.device import Piece, RemoteCache, Run, pair_ranges
from p2pkv.errors import P2pkvError, TransferTimeout
from p2pkv.layout import LayerGeometry
from p2pkv.protocol import DeviceExport, DeviceHome
from p2pkv.staging import DeviceKv
from p2pkv.transport import cma
from p2pkv.transport.split_read import SplitReader

log = logging.getLogger(__name__)


def _check_bounds(ranges: Sequence[Run], size: int, whose: str = "the peer's exported") -> None:
    for offset, n in ranges:
        if offset < 0 or n < 0 or offset + n > size:
            raise P2pkvError(f"range {offset}+{n} lies outside {whose} storage of {size} bytes")


def _check_layers(theirs: int, their_count: int, ours: int, our_count: int) -> None:
    """A peer holding other layers (another pipeline-parallel size) exports another number of them: each copy
    names its layer on both sides, and both must exist."""
    if not (0 <= theirs < their_count and 0 <= ours < our_count):
        raise P2pkvError(f"layer {theirs} of the peer's {their_count} into layer {ours} of our {our_count}")


def _whole(kv: DeviceKv, remote: Sequence[Sequence[Run]], block_ids: Sequence[int]
           ) -> list[tuple[int, int, Sequence[Run], Sequence[Run]]]:
    """Whole blocks: layer i of the peer's ranges into our blocks `block_ids` of layer i. Layers that lie alike
    share one list of runs (a long transfer's list costs a fraction of a millisecond to make)."""
    runs: dict[LayerGeometry, list[Run]] = {}
    out: list[tuple[int, int, Sequence[Run], Sequence[Run]]] = []
    for layer, ranges in enumerate(remote):
        geometry = kv.geometry[layer] if 0 <= layer < kv.num_layers else None
        if geometry is None:
            out.append((layer, layer, ranges, []))  # copy_runs refuses the layer
            continue
        if geometry not in runs:
            runs[geometry] = geometry.ranges(block_ids)
        out.append((layer, layer, ranges, runs[geometry]))
    return out


def _visible_gpus() -> dict[str, int]:
    """This process's GPUs by UUID, with its own index of each."""
    return {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}


class _CudaRemote:
    transport = "cuda_ipc"

    def __init__(self, kv: DeviceKv, export: DeviceExport) -> None:
        self._kv = kv
        # The producer's device index means nothing here (each process numbers the GPUs it sees): find its GPU
        # by UUID among ours. It must be visible: CUDA_VISIBLE_DEVICES="own GPU first, then the others".
        index = _visible_gpus().get(export.device)
        if index is None:
            raise P2pkvError(f"the peer's GPU {export.device} is not visible to this process (CUDA_VISIBLE_DEVICES)")
        self._storages: list[torch.Tensor] = []
        try:
            for handle in export.handles:
                storage = torch.UntypedStorage._new_shared_cuda(index, *handle[1:])
                self._storages.append(torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage))
        except (RuntimeError, TypeError) as exc:
            raise P2pkvError(f"CUDA IPC open failed: {exc}") from None

    def copy_into(self, remote: Sequence[Sequence[Run]], block_ids: Sequence[int], deadline: float) -> int:
        return self.copy_runs(_whole(self._kv, remote, block_ids), deadline)

    def copy_runs(self, pairs: Sequence[tuple[int, int, Sequence[Run], Sequence[Run]]], deadline: float) -> int:
        moves, total = [], 0
        for theirs, ours, ranges, runs in pairs:
            _check_layers(theirs, len(self._storages), ours, self._kv.num_layers)
            src = self._storages[theirs]
            _check_bounds(ranges, src.numel())
            _check_bounds(runs, self._kv.storages[ours].numel(), "our")
            cut = pair_ranges(ranges, runs)
            moves.append((ours, src, cut))
            total += sum(n for _, _, n in cut)
        marker = self._kv.copy_pairs(moves)  # every layer's copies queued, checked first
        # On a miss the load is reported failed and vLLM may reuse these blocks: settle lets the copies finish first.
        if not settle([marker], deadline, self._kv.copy_timeout_s):
            raise TransferTimeout("copying from the peer's GPU missed the deadline")
        return total

    def close(self) -> None:
        self._storages.clear()


def _span(handle: Sequence[object]) -> tuple[int, int]:
    if len(handle) != 2 or not isinstance(handle[0], int) or not isinstance(handle[1], int):
        raise P2pkvError(f"a host export entry is (address, size), got {handle!r}")
    return handle[0], handle[1]


class _HostRemote:
    transport = "host_ipc"

    def __init__(self, kv: DeviceKv, export: DeviceExport) -> None:
        self._kv = kv
        self._pid = export.pid
        self._spans = [_span(h) for h in export.handles]
        self._local = [memoryview(s.numpy()) for s in kv.storages]
        self._reader = SplitReader(self._pid)  # large runs on two threads, as shm payloads
        if self._spans and self._spans[0][1]:
            probe = bytearray(1)
            cma.read_remote(self._pid, memoryview(probe), [(self._spans[0][0], 1)])  # TransferError if unreadable

    def copy_into(self, remote: Sequence[Sequence[Run]], block_ids: Sequence[int], deadline: float) -> int:
        return self.copy_runs(_whole(self._kv, remote, block_ids), deadline)

    def copy_runs(self, pairs: Sequence[tuple[int, int, Sequence[Run], Sequence[Run]]], deadline: float) -> int:
        total = 0
        for theirs, ours, ranges, runs in pairs:
            _check_layers(theirs, len(self._spans), ours, len(self._local))
            base, size = self._spans[theirs]
            _check_bounds(ranges, size)
            local = self._local[ours]
            _check_bounds(runs, local.nbytes, "our")
            views = [local[a : a + n] for a, n in runs]
            self._reader.read(views, [(base + a, n) for a, n in ranges])
            total += sum(n for _, n in ranges)
            if time.monotonic() > deadline:
                raise TransferTimeout("copying from the peer's memory missed the deadline")
        return total

    def close(self) -> None:
        self._reader.close()
        self._local.clear()


class CacheAccess:
    """This worker's cache as peers on this host open it, and their caches opened here."""

    def __init__(self, kv: DeviceKv) -> None:
        self.kv = kv
        self.kind = "cuda" if kv.on_gpu else "host"

    def export(self) -> DeviceExport:
        if self.kind == "cuda":
            handles = [tuple(s.untyped_storage()._share_cuda_()) for s in self.kv.storages]
            device = str(torch.cuda.get_device_properties(self.kv.storages[0].device).uuid)
        else:
            cma.allow_readers()
            handles = [(s.data_ptr(), s.numel()) for s in self.kv.storages]
            device = ""
        return DeviceExport(self.kind, cma.boot_id(), os.getpid(), device, handles)

    def runs(self, layer: int, block_ids: Sequence[int]) -> list[Run]:
        return self.kv.geometry[layer].ranges(block_ids)

    def bytes_digest(self, pieces: Sequence[Piece]) -> int | None:
        return self.kv.bytes_digest(pieces)

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
            return _CudaRemote(self.kv, export)
        try:
            return _HostRemote(self.kv, export)
        except P2pkvError as exc:
            raise P2pkvError(f"the peer's memory cannot be read: {exc}") from None


