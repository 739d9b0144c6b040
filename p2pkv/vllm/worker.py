"""Worker side of the connector: pushes saved layers through the engine and lands staged KV in the cache."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from p2pkv.blocks import BlockAccess, InPlaceBlocks
from p2pkv.config import ConnectorConfig
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.offers import OfferState
from p2pkv.engine.puller import PullState
from p2pkv.engine.sender import OutState
from p2pkv.engine.store import NO_SPACE, StageState
from p2pkv.errors import P2pkvError
from p2pkv.ipc import CacheAccess
from p2pkv.layout import KvBlocks
from p2pkv.params import Address
from p2pkv.pipes import make_pipes
from p2pkv.staging import STAGE_ENV, DeviceKv, TransferBuffers
from p2pkv.vllm.metadata import LoadSpec, P2pkvMetadata, SaveSpec

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass
class _Load:
    spec: LoadSpec
    deadline: float


def _kernel_tag(t: torch.Tensor) -> str:
    import torch

    if t.device.type == "cpu":
        return f"cpu:{torch.backends.cpu.get_cpu_capability()!s}"
    return str(t.device.type)


def _raiser(exc: Exception) -> Callable[[float], bool]:
    def ready(_deadline: float) -> bool:
        raise exc

    return ready


class WorkerSide:
    def __init__(self, config: ConnectorConfig, rank: int, block_size: int) -> None:
        self._config = config
        self._rank = rank
        self._block_size = block_size
        self._engine: TransferEngine | None = None
        self._blocks: BlockAccess | None = None
        self._layer_index: dict[str, int] = {}
        self._meta = P2pkvMetadata()
        self._pushed: dict[str, set[int]] = {}
        self._sending: dict[str, str] = {}
        self._specs: dict[str, SaveSpec] = {}
        self._finished: set[str] = set()
        self._loads: dict[str, _Load] = {}
        self._load_errors: set[int] = set()

    @property
    def engine(self) -> TransferEngine:
        assert self._engine is not None, "register_kv_caches has not run"
        return self._engine

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = list(kv_caches)
        tensors = [kv_caches[n] for n in names]
        extra = self._config.extra
        kernel = _kernel_tag(tensors[0])
        device, access, pipes = None, None, None
        if tensors[0].device.type != "cpu" or os.environ.get(STAGE_ENV) == "1":
            # KV the engine cannot address in place (a GPU's): through host buffers, and pulls by reference.
            device = DeviceKv(tensors, self._block_size, kernel, extra.transfer_timeout_s)
            self._blocks, access = TransferBuffers(device), CacheAccess(device)
            pipes = make_pipes(device, extra.kv_host, extra.nccl_num_channels)
        else:
            self._blocks = InPlaceBlocks(KvBlocks.from_tensors(tensors, self._block_size, kernel))
        self._layer_index = {n: i for i, n in enumerate(names)}
        metrics_port = extra.metrics_port + self._rank if extra.metrics_port else 0
        settings = EngineSettings.from_config(extra, self._config.worker_port(self._rank), metrics_port)
        self._engine = TransferEngine(settings, self._blocks.digest, self._rank, access, pipes)
        if device is not None:
            device.pool, device.metrics = self._engine.pool, self._engine.metrics
            if self._engine.pool is not None and device.on_gpu:
                self._engine.pool.prepare()  # pinning takes about 0.5 s per GiB: at start-up, not in a transfer
        self._engine.start()

    def bind(self, meta: P2pkvMetadata) -> None:
        self._meta = meta
        self._pushed = {s.transfer_id: set() for s in meta.saves}
        deadline = time.monotonic() + self._config.extra.transfer_timeout_s
        for spec in meta.loads:
            self._loads[spec.req_id] = _Load(spec, deadline)
            if spec.pull_from is not None and spec.block_ids:
                self._pull(spec, spec.pull_from, deadline)

    def save_layer(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None or not self._meta.saves:
            return
        for spec in self._meta.saves:
            self._push(spec, layer)

    @property
    def blocks(self) -> BlockAccess:
        assert self._blocks is not None, "register_kv_caches has not run"
        return self._blocks

    def _pull(self, spec: LoadSpec, peer: Address, deadline: float) -> None:
        self.engine.pull(spec.transfer_id, peer.offset(self._rank), spec.first_block, len(spec.block_ids),
                         self.blocks.sink(spec.transfer_id, spec.block_ids), deadline,
                         self.blocks.device_blocks(spec.block_ids))

    def _offer(self, spec: SaveSpec) -> None:
        """GET: hold the blocks for the decode side (and say where they lie, for cuda_ipc pulls)."""
        tid, ids = spec.transfer_id, spec.block_ids
        self.engine.offer(tid, len(ids), self.blocks.source(tid, ids), self._config.extra.lease_s,
                          self.blocks.ranges(tid, ids))

    def _push(self, spec: SaveSpec, layer: int) -> None:
        if spec.peer is None:
            return
        pushed = self._pushed[spec.transfer_id]
        if layer in pushed:
            return
        pushed.add(layer)
        self._sending[spec.req_id] = spec.transfer_id
        self._specs[spec.req_id] = spec
        deadline = time.monotonic() + self._config.extra.transfer_timeout_s
        try:
            views, ready = self.blocks.push_views(spec.transfer_id, layer, spec.block_ids)
        except Exception as exc:  # no host memory, a device error: this transfer fails, not the forward pass
            log.error("transfer %s: layer %d could not be copied from the device: %r", spec.transfer_id, layer, exc)
            views, ready = (), _raiser(exc)
        self.engine.push_layer(spec.transfer_id, spec.peer.offset(self._rank), layer, len(spec.block_ids), views,
                               deadline, ready)

    def wait_for_save(self) -> None:
        # Layers whose hook did not fire this step (none in normal runs) are pushed here so no transfer is short.
        for spec in self._meta.saves:
            if spec.peer is None:
                # GET: every layer is final now that the forward has run; hold the blocks for the pull.
                self._sending[spec.req_id] = spec.transfer_id
                self._offer(spec)
                continue
            for layer in range(len(self._layer_index)):
                self._push(spec, layer)
        if any(spec.inline and spec.peer is not None for spec in self._meta.saves):
            self.engine.wait_sent(time.monotonic() + self._config.extra.transfer_timeout_s)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._engine is None:
            return None, None
        self._engine.housekeeping()
        return self._finished_sending(finished_req_ids) or None, self._finished_loading() or None

    def _finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        self._finished |= finished_req_ids & self._sending.keys()
        for req_id, tid in self._sending.items():
            out = self.engine.outgoing(tid)
            if out is not None and out.state is OutState.REFUSED and self.engine.offer_state(tid) is None:
                # The decode side had no room to stage the push: hold the blocks for it to pull instead.
                spec = self._specs[req_id]
                log.info("transfer %s: push refused (%s); holding the blocks for a pull", tid, out.reason)
                self._offer(spec)
        done: set[str] = set()
        for req_id in self._finished:
            tid = self._sending[req_id]
            offered = self.engine.offer_state(tid)
            if offered is not None:
                if offered in (OfferState.SERVED, OfferState.EXPIRED):
                    done.add(req_id)
                continue
            out = self.engine.outgoing(tid)
            if out is None or out.state is not OutState.SENDING:
                done.add(req_id)
        for req_id in done:
            self._finished.discard(req_id)
            tid = self._sending.pop(req_id)
            self._specs.pop(req_id, None)
            self.engine.forget_outgoing(tid)
            self.engine.offers.forget(tid)
            self.blocks.release(tid)
        return done

    def _finished_loading(self) -> set[str]:
        done: set[str] = set()
        now = time.monotonic()
        for req_id, load in self._loads.items():
            if load.spec.pull_from is not None:
                if self._pull_finished(load):
                    done.add(req_id)
                continue
            state = self.engine.staged_state(load.spec.transfer_id)
            if state is StageState.FAILED and self._fall_back_to_pull(load):
                continue
            if state is StageState.COMPLETE:
                try:
                    self._land(load.spec)
                except P2pkvError as exc:  # device KV: the copy into the blocks did not finish in time
                    self._fail_load(load.spec, str(exc))
                done.add(req_id)
            elif state is StageState.FAILED or now > load.deadline:
                self._fail_load(load.spec, "transfer failed" if state is StageState.FAILED else "deadline passed")
                item = self.engine.take_staged(load.spec.transfer_id)
                if item is not None:
                    self.engine.release_staged(item)
                done.add(req_id)
        for req_id in done:
            del self._loads[req_id]
        return done

    def _fall_back_to_pull(self, load: _Load) -> bool:
        """This side refused the push for lack of space: pull the blocks straight into the cache instead."""
        spec = load.spec
        if self.engine.store.reason(spec.transfer_id) != NO_SPACE or spec.fallback_from is None or not spec.block_ids:
            return False
        item = self.engine.take_staged(spec.transfer_id)
        if item is not None:
            self.engine.release_staged(item)
        log.info("transfer %s: no staging space here; pulling from %s", spec.transfer_id, spec.fallback_from)
        load.spec = replace(spec, pull_from=spec.fallback_from)
        self._pull(spec, spec.fallback_from, load.deadline)
        return True

    def _pull_finished(self, load: _Load) -> bool:
        spec = load.spec
        if not spec.block_ids:
            return True
        result = self.engine.pull_result(spec.transfer_id)
        if result is not None and result.state is PullState.DONE:
            self.engine.forget_pull(spec.transfer_id)
            try:
                if not result.by_reference:  # copied device to device otherwise: nothing to land
                    self.blocks.land(spec.transfer_id)
            except P2pkvError as exc:
                self._fail_load(spec, str(exc))
                return True
            finally:
                self.blocks.release(spec.transfer_id)
            self.engine.metrics.bytes_loaded.inc(result.nbytes)
            self.engine.metrics.add("bytes_loaded", result.nbytes)
            self.engine.metrics.transfers.labels("load", "ok").inc()
            return True
        # Only a finished pull is reported: vLLM may free and reuse the blocks of a failed load, so the puller
        # (which honours the same deadline) must be done writing into them first.
        if result is None or result.state is PullState.FAILED:
            self._fail_load(spec, "pull failed: " + (result.reason if result is not None else "deadline passed"))
            self.engine.forget_pull(spec.transfer_id)
            self.blocks.release(spec.transfer_id)
            return True
        return False

    def _land(self, spec: LoadSpec) -> None:
        item = self.engine.take_staged(spec.transfer_id)
        assert item is not None
        try:
            if not spec.block_ids:
                return
            n = len(spec.block_ids)
            start = spec.first_block * item.block_bytes
            for layer in range(item.num_layers):
                src = item.layer_view(layer)[start : start + n * item.block_bytes]
                if spec.corrupt and self._config.extra.test_fault_injection:
                    src = memoryview(bytes(b ^ 0x5A for b in src[:4096]) + bytes(src[4096:]))
                self.blocks.write_blocks(layer, spec.block_ids, src)
            nbytes = n * item.block_bytes * item.num_layers
            self.engine.metrics.bytes_loaded.inc(nbytes)
            self.engine.metrics.add("bytes_loaded", nbytes)
            self.engine.metrics.transfers.labels("load", "ok").inc()
            log.info("transfer %s landed peer=%s blocks=%d bytes=%d ms=%.1f transport=%s", spec.transfer_id,
                     item.source.split("#")[0], n, nbytes, (time.monotonic() - item.created) * 1000, item.transport)
        finally:
            self.engine.release_staged(item)

    def _fail_load(self, spec: LoadSpec, reason: str) -> None:
        """Report the load's blocks to vLLM as load errors (it recomputes or fails the request)."""
        log.warning("transfer %s: load failed (%s); reporting %d blocks", spec.transfer_id, reason,
                    len(spec.block_ids))
        self._load_errors.update(spec.block_ids)
        self.engine.metrics.transfers.labels("load", "failed").inc()

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.close()
