"""Worker side of the connector: registers the KV cache with a transfer engine, hands each step's saves and loads
to `p2pkv.vllm.saves` and `p2pkv.vllm.loads`, and reports what finished."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import msgspec

from p2pkv.config import ConnectorConfig, Transport
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.kv.blocks import BlockAccess, InPlaceBlocks
from p2pkv.kv.buffers import TransferBuffers
from p2pkv.kv.device_copy import DeviceOps
from p2pkv.kv.ipc import CacheAccess
from p2pkv.kv.layers import prepare_layers
from p2pkv.kv.layout import KvBlocks
from p2pkv.kv.pipes import make_pipes
from p2pkv.kv.slices import HeadSlices
from p2pkv.kv.stages import StageLayers
from p2pkv.kv.staging import STAGE_ENV, DeviceKv
from p2pkv.memory.huge import HugePageFiller
from p2pkv.vllm.groups import CacheGroups
from p2pkv.vllm.loads import Loads, Placement
from p2pkv.vllm.metadata import P2pkvMetadata, Wanted
from p2pkv.vllm.refusals import RefusalNotes, RefusalReporter
from p2pkv.vllm.saves import Saves

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.005  # at most this long per empty step, at most 200 empty steps a second


def _kernel_tag(t: torch.Tensor) -> str:
    import torch

    if t.device.type == "cpu":
        return f"cpu:{torch.backends.cpu.get_cpu_capability()!s}"
    return str(t.device.type)


def _layer_number(name: str) -> int:
    """The model's index of a layer from vLLM's name for it ("model.layers.12.self_attn.attn" -> 12); 0 for a
    name without one."""
    return next((int(part) for part in name.split(".") if part.isdigit()), 0)


class WorkerSide:
    def __init__(self, config: ConnectorConfig, *, rank: int, block_size: int, tp_size: int = 1,
                 total_heads: int = 0, pp_rank: int = 0, pp_size: int = 1, total_layers: int = 0,
                 stage_layers: StageLayers | None = None, model: str = "",
                 weights: Callable[[], str] | None = None, num_blocks: int = 0,
                 device_ops: DeviceOps | None = None, groups: CacheGroups | None = None) -> None:
        """`rank`: the tensor-parallel rank; `pp_rank`: the pipeline stage, whose ranks come after the earlier
        stages' (the worker binds `kv_port + pp_rank * tp_size + rank`, as vLLM numbers its workers).
        `total_layers` and `stage_layers` (which layers a stage holds): how the model's layers split over stages,
        for prefill instances of another pipeline-parallel size (not known: such loads fail). `model`: what the
        KV's values depend on beyond its shape (`p2pkv.vllm.model_factors`), compared with each peer's; `weights`
        adds the weights' factor to it when the cache is registered (the model is loaded by then). `num_blocks`:
        vLLM's block count (`KVCacheConfig.num_blocks`), from which kernel blocks are regrouped into vLLM's;
        `device_ops`: what issues a device cache's copies (the tests' recording layers; by default torch's);
        `groups`: vLLM's KV cache groups, each moved by its own block ids (`p2pkv.vllm.groups`)."""
        self._groups = groups or CacheGroups()
        self._config = config
        self._at = Placement(rank, tp_size, pp_rank, pp_size, total_heads, range(0), total_layers, stage_layers)
        self._refusals = RefusalReporter(self._at.slot)
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._device_ops = device_ops
        self._model = model
        self._weights = weights
        self._engine: TransferEngine | None = None
        self._blocks: BlockAccess | None = None
        self._slices = HeadSlices()
        self._layer_index: dict[str, int] = {}
        self._meta = P2pkvMetadata()
        self._loading: Loads | None = None
        self._saving: Saves | None = None
        self._staged = False  # KV behind a device copy (a GPU's)
        self.huge_pages: HugePageFiller | None = None  # the KV cache's pages, made huge by register_kv_caches

    @property
    def engine(self) -> TransferEngine:
        assert self._engine is not None, "register_kv_caches has not run"
        return self._engine

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = prepare_layers(kv_caches, self._num_blocks, self._block_size, lambda n: (_layer_number(n), n),
                                self._groups.of_layer, self._groups.states)
        names, tensors = layers.names, layers.tensors
        extra = self._config.extra
        kernel = _kernel_tag(tensors[0])
        device, access, pipes = None, None, None
        if tensors[0].device.type != "cpu" or os.environ.get(STAGE_ENV) == "1":
            # KV the engine cannot address in place (a GPU's): through host buffers, and pulls by reference.
            device = DeviceKv(tensors, self._block_size, kernel, extra.transfer_timeout_s, self._at.total_heads,
                              self._device_ops)
            self._blocks, access = TransferBuffers(device), CacheAccess(device)
            self._staged = True
            pipes = make_pipes(device, extra.kv_host, extra.nccl_num_channels)
            if self._groups.grouped:  # device paths pull one list of blocks: a grouped cache is pushed
                access, pipes = None, None
        else:
            if extra.huge_pages and extra.transport in (Transport.AUTO, Transport.SHM):
                # Peers on this host copy from it with the kernel's cross-process copy, twice as fast out of 2 MiB
                # pages; vLLM has just zeroed it, and nothing writes to it before its first forward.
                self.huge_pages = HugePageFiller(
                    (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors)
                self.huge_pages.start()
            self._blocks = InPlaceBlocks(KvBlocks.from_tensors(tensors, self._block_size, kernel,
                                                               self._at.total_heads))
        self._slices = HeadSlices(tensors, self._block_size, kernel, self._blocks, device)
        self._layer_index = dict(layers.index)
        # Peers compare which layers they hold: a pipeline stage must talk to the same stage of the other side, or
        # (another pipeline-parallel size) pull only layers both hold. Layers that share a cache (KV sharing) are
        # moved once: such a model's layers are not matched across pipeline-parallel sizes.
        first = _layer_number(names[0])
        held = range(first, first + len(tensors))
        in_order = ([_layer_number(n) for n in names] == list(held) and held.stop <= self._at.total_layers
                    and not layers.aliases)
        self._at = replace(self._at, layers=held, total_layers=self._at.total_layers if in_order else 0)
        metrics_port = extra.metrics_port + self._at.slot if extra.metrics_port else 0
        settings = replace(EngineSettings.from_config(extra, self._config.worker_port(self._at.slot), metrics_port),
                           launch=self._config.launch, pinned_staging=device is not None and device.on_gpu)
        factors = ";".join(f for f in (self._model, self._weights() if self._weights else "") if f)
        digest = msgspec.structs.replace(self._blocks.digest, first_layer=first, total_layers=self._at.total_layers,
                                         model=factors, kv_groups=self._groups.factor)
        self._engine = TransferEngine(settings, digest, self._at.slot, access, pipes, intervals=True)
        if device is not None:
            device.pool, device.metrics = self._engine.pool, self._engine.metrics
            if device.on_gpu:
                self._engine.pin_pool()
        self._engine.start()
        grouped = tuple(layers.groups) if self._groups.grouped else None
        if grouped is not None:  # what peers compare (`kv_groups`), for a refusal to be read against
            log.info("KV cache groups (kind:layers): %s", self._groups.factor)
        self._loading = Loads(self._config, self._engine, self._blocks, self._slices, self._at, grouped)
        self._saving = Saves(self._config, self._engine, self._blocks, self._slices, self._at, self._staged, grouped)

    def bind(self, meta: P2pkvMetadata) -> None:
        self._meta = meta
        self.saving.bind(meta.saves)
        if meta.reset:
            dropped = self.engine.drop_staged("dropped by a cache reset (its KV predates it)")
            log.info("cache reset: dropped %d staged transfers", dropped)
        # vLLM binds after it queued the zeroing of newly allocated blocks: copies into this step's loads' blocks
        # come after this fence.
        self.loading.start(meta.loads, self.blocks.fence() if meta.loads else None)
        self.loading.discard(meta.discards)
        if meta.abandoned:
            self.saving.abandon(meta.abandoned)
        if meta.wanted:
            self._keep(meta.wanted)
        for reason in meta.computed_here:
            self.engine.count_computed_here(reason)

    def _keep(self, wanted: list[Wanted]) -> None:
        """Requests still wait for blocks: their staged pushes are kept on every rank, and rank 0 asks each rank of
        their prefill instances to keep holding the blocks of those held for a pull."""
        deadline = time.monotonic() + self._config.extra.transfer_timeout_s
        for keep in wanted:
            self.engine.keep_staged(keep.transfer_ids)
            if self._at.slot == 0:
                for rank in range(keep.prefill_ranks):
                    self.engine.renew_leases(keep.prefill.offset(rank), keep.transfer_ids, deadline)

    def save_layer(self, layer_name: str) -> None:
        """A layer of this step's forward is computed (`Saves.save_layer`)."""
        layer = self._layer_index.get(layer_name)
        if layer is not None and self._meta.saves:
            self.saving.save_layer(layer)

    @property
    def loading(self) -> Loads:
        assert self._loading is not None, "register_kv_caches has not run"
        return self._loading

    @property
    def saving(self) -> Saves:
        assert self._saving is not None, "register_kv_caches has not run"
        return self._saving

    @property
    def blocks(self) -> BlockAccess:
        assert self._blocks is not None, "register_kv_caches has not run"
        return self._blocks

    def wait_for_save(self) -> None:
        if self._meta.saves:
            self.saving.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._engine is None:
            return None, None
        self.saving.renew()
        self._engine.housekeeping()
        self.blocks.collect()
        self._slices.collect()
        sent, loaded = self.saving.finished(finished_req_ids), self.loading.finished(finished_req_ids)
        if self._meta.idle and not sent and not loaded and (self.saving.pending or self.loading.pending):
            # vLLM steps without pause while transfers are in flight, even with nothing to compute: on such an
            # empty step, wait a moment for a transfer to finish instead of returning at once. Each spinning step
            # costs every rank a core (and, with tensor parallelism, a collective), which the transfers' own
            # threads need. Blocks held for a pull or a push in flight: the peer's pace.
            if not self.loading.wait(IDLE_WAIT_S):
                time.sleep(IDLE_WAIT_S)
        return sent or None, loaded or None


    def transfers_of(self, req_ids: Iterable[str]) -> list[str]:
        """The transfers these requests are sending."""
        return self._saving.transfers_of(req_ids) if self._saving is not None else []

    def handle_preemptions(self, transfer_ids: Iterable[str]) -> None:
        """Requests whose blocks are being sent were preempted (`Saves.preempted`)."""
        if self._saving is not None:
            self._saving.preempted(transfer_ids)

    def take_stats(self) -> dict[str, Any] | None:
        """What the engine counted since the last step: transfers, bytes, transfer times."""
        return self._engine.take_interval() if self._engine is not None else None

    def refusals(self) -> RefusalNotes | None:
        """The peers this worker refused at their hello, when that changed since the last step (for the heartbeats
        that tell the proxy: `p2pkv.vllm.refusals`)."""
        return self._refusals.report(self._engine.refused) if self._engine is not None else None

    def take_load_errors(self) -> set[int]:
        return self._loading.take_errors() if self._loading is not None else set()

    def take_failed_loads(self) -> set[str]:
        """Requests whose loads failed, where the cache has several groups (block ids name no block there)."""
        return self._loading.take_failed() if self._loading is not None else set()

    def shutdown(self) -> None:
        if self.huge_pages is not None:
            self.huge_pages.close()
        if self._engine is not None:
            self._engine.close()
