"""Worker side of the connector: pushes saved layers through the engine and lands staged KV in the cache."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import msgspec

from p2pkv.blocks import BlockAccess, InPlaceBlocks
from p2pkv.config import ConnectorConfig
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.offers import OfferState, ViewSource
from p2pkv.engine.puller import HeadSlice, PullState
from p2pkv.engine.sender import OutState
from p2pkv.engine.store import HEADS_DIFFER, NO_SPACE, StageState
from p2pkv.errors import ConfigError, IncompatiblePeerError, P2pkvError
from p2pkv.ipc import CacheAccess
from p2pkv.layout import KvBlocks
from p2pkv.params import Address
from p2pkv.pipes import make_pipes
from p2pkv.slices import HeadSlices
from p2pkv.stages import StageLayers, StagePart, plan_stages, stage_split
from p2pkv.staging import STAGE_ENV, DeviceKv, TransferBuffers
from p2pkv.tp import plan_pulls
from p2pkv.vllm.metadata import LoadSpec, P2pkvMetadata, SaveSpec

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.005  # at most this long per empty step, at most 200 empty steps a second


@dataclass
class _Load:
    spec: LoadSpec
    deadline: float
    # From a prefill instance of another tensor- or pipeline-parallel size: one pull per prefill rank, each into
    # a slice of the blocks (some heads of some layers; None for a pull that only releases that rank's blocks).
    parts: list[tuple[str, BlockAccess | None]] = field(default_factory=list)


def _kernel_tag(t: torch.Tensor) -> str:
    import torch

    if t.device.type == "cpu":
        return f"cpu:{torch.backends.cpu.get_cpu_capability()!s}"
    return str(t.device.type)


def _layer_number(name: str) -> int:
    """The model's index of a layer from vLLM's name for it ("model.layers.12.self_attn.attn" -> 12); 0 for a
    name without one."""
    return next((int(part) for part in name.split(".") if part.isdigit()), 0)


def _no_sink(layer: int, first: int, count: int) -> tuple[memoryview, ...]:
    return ()


def _raiser(exc: Exception) -> Callable[[float], bool]:
    def ready(_deadline: float) -> bool:
        raise exc

    return ready


class WorkerSide:
    def __init__(self, config: ConnectorConfig, rank: int, block_size: int, tp_size: int = 1,
                 total_heads: int = 0, pp_rank: int = 0, pp_size: int = 1, total_layers: int = 0,
                 stage_layers: StageLayers | None = None) -> None:
        """`rank`: the tensor-parallel rank; `pp_rank`: the pipeline stage, whose ranks come after the earlier
        stages' (the worker binds `kv_port + pp_rank * tp_size + rank`, as vLLM numbers its workers).
        `total_layers` and `stage_layers` (which layers a stage holds): how the model's layers split over stages,
        for prefill instances of another pipeline-parallel size (not known: such loads fail)."""
        self._config = config
        self._rank = rank
        self._pp_rank = pp_rank
        self._pp_size = pp_size
        self._slot = pp_rank * tp_size + rank
        self._total_layers = total_layers
        self._stage_layers = stage_layers
        self._layers = range(0)  # the model's layers held here
        self._block_size = block_size
        self._tp_size = tp_size
        self._total_heads = total_heads
        self._engine: TransferEngine | None = None
        self._blocks: BlockAccess | None = None
        self._slices = HeadSlices()
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
        names = sorted(kv_caches, key=lambda n: (_layer_number(n), n))
        tensors = [kv_caches[n] for n in names]
        extra = self._config.extra
        kernel = _kernel_tag(tensors[0])
        device, access, pipes = None, None, None
        if tensors[0].device.type != "cpu" or os.environ.get(STAGE_ENV) == "1":
            # KV the engine cannot address in place (a GPU's): through host buffers, and pulls by reference.
            device = DeviceKv(tensors, self._block_size, kernel, extra.transfer_timeout_s, self._total_heads)
            self._blocks, access = TransferBuffers(device), CacheAccess(device)
            pipes = make_pipes(device, extra.kv_host, extra.nccl_num_channels)
        else:
            self._blocks = InPlaceBlocks(KvBlocks.from_tensors(tensors, self._block_size, kernel, self._total_heads))
        self._slices = HeadSlices(tensors, self._block_size, kernel, self._blocks, device)
        self._layer_index = {n: i for i, n in enumerate(names)}
        metrics_port = extra.metrics_port + self._slot if extra.metrics_port else 0
        settings = EngineSettings.from_config(extra, self._config.worker_port(self._slot), metrics_port)
        # Peers compare which layers they hold: a pipeline stage must talk to the same stage of the other side, or
        # (another pipeline-parallel size) pull only layers both hold.
        first = _layer_number(names[0])
        self._layers = range(first, first + len(names))
        consecutive = [_layer_number(n) for n in names] == list(self._layers)
        total = self._total_layers if consecutive and self._layers.stop <= self._total_layers else 0
        digest = msgspec.structs.replace(self._blocks.digest, first_layer=first, total_layers=total)
        self._engine = TransferEngine(settings, digest, self._slot, access, pipes)
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
            load = self._loads[spec.req_id] = _Load(spec, deadline)
            if spec.pull_from is not None and spec.block_ids:
                try:
                    self._pull(load, spec.pull_from)
                except P2pkvError as exc:  # e.g. heads that cannot be split: this load fails, not the step
                    self._fail_load(spec, str(exc))
                    load.parts.clear()
                    load.spec = replace(spec, block_ids=())

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

    def _pull(self, load: _Load, peer: Address) -> None:
        spec = load.spec
        if spec.prefill_tp or spec.prefill_pp:
            self._pull_parts(load, peer)
            return
        self.engine.pull(spec.transfer_id, peer.offset(self._slot), spec.first_block, len(spec.block_ids),
                         self.blocks.sink(spec.transfer_id, spec.block_ids), load.deadline,
                         self.blocks.device_blocks(spec.block_ids))

    def _stages(self, prefill_pp: int) -> list[StagePart]:
        """The prefill stages this stage pulls its layers from."""
        if prefill_pp == self._pp_size:
            return [StagePart(self._pp_rank, (self._layers.start, self._layers.stop), 1)]
        if self._stage_layers is None or not self._total_layers:
            raise ConfigError(f"the prefill instance runs pipeline-parallel size {prefill_pp}, this one "
                              f"{self._pp_size}, and this model's layers cannot be matched across stages")
        decode = stage_split(self._stage_layers, self._pp_size)
        if decode[self._pp_rank] != self._layers:
            raise ConfigError(f"this stage holds layers {self._layers.start}..{self._layers.stop}, not the "
                              f"{decode[self._pp_rank].start}..{decode[self._pp_rank].stop} of vLLM's split")
        return plan_stages(self._pp_rank, decode, stage_split(self._stage_layers, prefill_pp), self._total_layers)

    def _pull_parts(self, load: _Load, peer: Address) -> None:
        """From a prefill instance of another tensor- or pipeline-parallel size: this rank's heads of this stage's
        layers, from the prefill ranks that hold them, each into its slice of the blocks."""
        spec, tid = load.spec, load.spec.transfer_id
        prefill_tp = spec.prefill_tp or self._tp_size
        jobs = []
        try:
            for stage in self._stages(spec.prefill_pp or self._pp_size):
                local = (stage.layers[0] - self._layers.start, stage.layers[1] - self._layers.start)
                for part in plan_pulls(self._rank, self._tp_size, prefill_tp, self._total_heads):
                    # Prefill stage s's ranks follow its earlier stages' ranks.
                    slot = stage.prefill_stage * prefill_tp + part.prefill_rank
                    key = f"{tid}@{slot}"
                    access = None if part.release_only else self._slices.get(part.decode_heads, local)
                    block_bytes = access.digest.block_bytes if access is not None else 0
                    sink = access.sink(key, spec.block_ids) if access is not None else _no_sink
                    jobs.append((slot, sink, HeadSlice(part.prefill_heads, block_bytes, part.pullers * stage.pullers,
                                                       self._slot, key, stage.layers), access))
        except P2pkvError:
            for _, _, head_slice, access in jobs:
                if access is not None:
                    access.release(head_slice.key)
            raise
        # Submitted only once every part could be prepared: a load that fails here has nothing writing its blocks.
        for slot, sink, head_slice, access in jobs:
            load.parts.append((head_slice.key, access))
            self.engine.pull(tid, peer.offset(slot), spec.first_block, len(spec.block_ids), sink,
                             load.deadline, None, head_slice)

    def _offer(self, spec: SaveSpec) -> None:
        """GET: hold the blocks for the decode side (and say where they lie, for cuda_ipc pulls; and which bytes
        hold which heads of which layers, for decode ranks of another tensor- or pipeline-parallel size)."""
        tid, ids = spec.transfer_id, spec.block_ids

        def heads(wanted: tuple[int, int], layers: tuple[int, int] | None) -> ViewSource:
            if layers is None:
                return self._slices.get(wanted).source(tid, ids)
            if not (self._layers.start <= layers[0] < layers[1] <= self._layers.stop):
                raise IncompatiblePeerError(f"layers {layers[0]}..{layers[1]} asked for; this stage holds "
                                            f"{self._layers.start}..{self._layers.stop}")
            local = (layers[0] - self._layers.start, layers[1] - self._layers.start)
            return self._slices.get(wanted, local).source(tid, ids)

        self.engine.offer(tid, len(ids), self.blocks.source(tid, ids), self._config.extra.lease_s,
                          self.blocks.ranges(tid, ids), heads)

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
        self.engine.push_layer(spec.transfer_id, spec.peer.offset(self._slot), layer, len(spec.block_ids), views,
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
        sent, loaded = self._finished_sending(finished_req_ids), self._finished_loading()
        if self._meta.idle and not sent and not loaded and (self._sending or self._loads):
            self._idle_wait()
        return sent or None, loaded or None

    def _idle_wait(self) -> None:
        """vLLM steps without pause while transfers are in flight, even with nothing to compute: on such an empty
        step, wait a moment for a transfer to finish instead of returning at once. Each spinning step costs every
        rank a core (and, with tensor parallelism, a collective), which the transfers' own threads need."""
        for load in self._loads.values():
            keys = [key for key, _ in load.parts] or [load.spec.transfer_id]
            if load.spec.pull_from is not None:
                pending = [k for k in keys if (r := self.engine.pull_result(k)) is not None
                           and r.state is PullState.PENDING]
                self.engine.wait_pull((pending or keys)[0], IDLE_WAIT_S)  # returns once that pull settles
            else:
                self.engine.wait_staged(load.spec.transfer_id, IDLE_WAIT_S)
            return
        time.sleep(IDLE_WAIT_S)  # blocks held for a pull or a push in flight: the peer's pace

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
            self._slices.release(tid)
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
        reason = self.engine.store.reason(spec.transfer_id)
        if reason not in (NO_SPACE, HEADS_DIFFER) or spec.fallback_from is None or not spec.block_ids:
            return False
        item = self.engine.take_staged(spec.transfer_id)
        if item is not None:
            self.engine.release_staged(item)
        log.info("transfer %s: no staging space here; pulling from %s", spec.transfer_id, spec.fallback_from)
        load.spec = replace(spec, pull_from=spec.fallback_from)
        self._pull(load, spec.fallback_from)
        return True

    def _parts_finished(self, load: _Load) -> bool:
        """A load pulled in head slices: done once every part has settled; it failed if any part did."""
        spec = load.spec
        results = [self.engine.pull_result(key) for key, _ in load.parts]
        if any(r is not None and r.state is PullState.PENDING for r in results):
            return False
        failed = next((r.reason if r is not None else "deadline passed" for r in results
                       if r is None or r.state is not PullState.DONE), None)
        try:
            if failed is None:
                for key, access in load.parts:
                    if access is not None:
                        access.land(key)
                self._loaded(spec, sum(r.nbytes for r in results if r is not None))
        except P2pkvError as exc:
            failed = str(exc)
        finally:
            for key, access in load.parts:
                self.engine.forget_pull(key)
                if access is not None:
                    access.release(key)
        if failed is not None:
            self._fail_load(spec, "pull failed: " + failed)
        return True

    def _pull_finished(self, load: _Load) -> bool:
        spec = load.spec
        if not spec.block_ids:
            return True
        if load.parts:
            return self._parts_finished(load)
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
            self._loaded(spec, result.nbytes)
            return True
        # Only a finished pull is reported: vLLM may free and reuse the blocks of a failed load, so the puller
        # (which honours the same deadline) must be done writing into them first.
        if result is None or result.state is PullState.FAILED:
            self._fail_load(spec, "pull failed: " + (result.reason if result is not None else "deadline passed"))
            self.engine.forget_pull(spec.transfer_id)
            self.blocks.release(spec.transfer_id)
            return True
        return False

    def _loaded(self, spec: LoadSpec, nbytes: int) -> None:
        """A pulled load is in the blocks. With fault injection, a load marked `test_corrupt` is then damaged (the
        integration tests' negative control: the output must change)."""
        if spec.corrupt and self._config.extra.test_fault_injection:
            key, first = f"{spec.transfer_id}#corrupt", spec.block_ids[:1]
            try:
                data = bytearray(b"".join(bytes(v) for v in self.blocks.source(key, first)(0, 0, 1)))
                data[:4096] = bytes(b ^ 0x5A for b in data[:4096])
                self.blocks.write_blocks(0, first, memoryview(data))
            finally:
                self.blocks.release(key)
        self.engine.metrics.bytes_loaded.inc(nbytes)
        self.engine.metrics.add("bytes_loaded", nbytes)
        self.engine.metrics.transfers.labels("load", "ok").inc()

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
