"""The class vLLM loads. It only forwards to the scheduler side or the worker side, chosen once by role."""

from __future__ import annotations

import functools
import logging
import uuid
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from p2pkv.config import ConnectorConfig, SendType, parse_connector_config
from p2pkv.discovery.events import announced_endpoint
from p2pkv.discovery.heartbeat import HeartbeatSender, sender_for
from p2pkv.engine.metrics import StepStats
from p2pkv.errors import UnsupportedCacheError
from p2pkv.kv.stages import StageLayers
from p2pkv.vllm.groups import CacheGroups, cache_groups
from p2pkv.vllm.metadata import P2pkvMetadata
from p2pkv.vllm.model_factors import kv_cache_dtype, model_factors, weights_factor
from p2pkv.vllm.refusals import InstanceRefusals, RefusalNotes
from p2pkv.vllm.scheduler import SchedulerSide
from p2pkv.vllm.stats import P2pkvPromMetrics, P2pkvStats
from p2pkv.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


try:  # newer vLLM counts prompt tokens served from a cache by where they came from
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _P2P_SOURCE: Any = CacheHitSource.P2P
except ImportError:  # older ones do not
    _P2P_SOURCE = None


def _route_logs() -> None:
    """vLLM only configures its own loggers; give p2pkv's one handler so per-transfer lines are seen."""
    logger = logging.getLogger("p2pkv")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _ranks() -> tuple[int, int]:
    """This worker's (tensor-parallel rank, pipeline-parallel rank)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)


def _events_of(vllm_config: VllmConfig, config: Any) -> str:
    """Where this engine's KV cache events can be subscribed to ("": nowhere), for its heartbeats."""
    events = getattr(vllm_config, "kv_events_config", None)
    if events is None:
        return ""
    index = int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)
    host = config.extra.kv_address(config.worker_port(0)).host
    return announced_endpoint(str(events.endpoint or ""), bool(events.enable_kv_cache_events),
                              str(events.publisher or ""), index, host)


def _stage_layers(vllm_config: VllmConfig) -> tuple[int, StageLayers]:
    """The model's layers, and which of them pipeline stage s of size n holds, as vLLM splits them."""
    from vllm.distributed.utils import get_pp_indices

    total = int(vllm_config.model_config.get_total_num_hidden_layers())

    def layers(stage: int, pp_size: int) -> range:
        return range(*get_pp_indices(total, stage, pp_size))

    return total, layers


def _data_parallel(vllm_config: VllmConfig) -> tuple[int, int | None]:
    """This engine's data-parallel rank on this host (its ports' offset), and the rank the proxy names to the
    instance's API server to reach it (`X-data-parallel-rank`), or None where the API server fronts no other
    engine: no data parallelism, or external load balancing (one API server per rank)."""
    pc = vllm_config.parallel_config
    index = int(getattr(pc, "data_parallel_index", pc.data_parallel_rank))
    # vLLM treats the engines of a dense model as independent: each of size 1 and rank 0, the rank kept in
    # `data_parallel_index`. Engine 0 is then told from a lone engine by the suffix vLLM gives the engine id of
    # each engine of a data-parallel instance. (The local rank says nothing: it is 0 without data parallelism.)
    engine_id = str(getattr(vllm_config.kv_transfer_config, "engine_id", "") or "")
    parallel = pc.data_parallel_size > 1 or index > 0 or engine_id.endswith(f"_dp{index}")
    if pc.data_parallel_external_lb or not parallel:
        return 0, None
    local = index if pc.data_parallel_rank_local is None else int(pc.data_parallel_rank_local)
    # An API server fronts its engines in rank order from its first: all of them (internal load balancing), or
    # those of its host (hybrid).
    return local, local if pc.data_parallel_hybrid_lb else index


def _start_of(vllm_config: VllmConfig) -> str:
    """What tells this start of the instance from its others, the same in its scheduler and its workers: the engine
    id of its KV transfer (drawn afresh at every start unless set) and the instance id (vLLM sets it from the clock
    whenever it builds its config, so it differs at each start even where given)."""
    engine_id = str(getattr(vllm_config.kv_transfer_config, "engine_id", "") or "")
    instance_id = str(getattr(vllm_config, "instance_id", "") or "")
    return f"{engine_id}/{instance_id}" if engine_id or instance_id else ""


def check_grouped(groups: CacheGroups, config: ConnectorConfig, vllm_config: VllmConfig) -> None:
    """Refuse, at start-up, what p2pkv does not move per KV cache group yet: pulls (`send_type` GET) of a hybrid or
    sliding-window cache. Pushes to instances of another parallel size, and pulls after a refused push, fall back
    to computing the prompt on the decode side."""
    if groups.grouped and config.extra.send_type is SendType.GET:
        raise UnsupportedCacheError(
            f"send_type GET with a KV cache of {len(groups.kinds)} groups ({', '.join(groups.kinds)}): p2pkv pulls "
            "one full-attention group only; use PUT_ASYNC or PUT, or --disable-hybrid-kv-cache-manager")


def check_batching(vllm_config: VllmConfig) -> None:
    """Refuse micro-batching at start-up: micro-batches run the layers' hooks from threads of their own, each on its
    own stream, so a layer's copy would follow one micro-batch's writes and not the other's."""
    if getattr(vllm_config.parallel_config, "use_ubatching", False):
        raise UnsupportedCacheError("micro-batching (--enable-dbo, or --ubatch-size above 1) is not supported by "
                                    "p2pkv: run the instances without it")


def check_context_parallel(vllm_config: VllmConfig) -> None:
    """Refuse context parallelism at start-up: a block of its instance holds `block_size` x CP tokens, interleaved
    across the ranks, while p2pkv counts a prompt's blocks by `block_size`: it would load the first tokens into
    blocks meant for more and never send the rest."""
    pc = vllm_config.parallel_config
    sizes = {"--decode-context-parallel-size": int(getattr(pc, "decode_context_parallel_size", 1) or 1),
             "--prefill-context-parallel-size": int(getattr(pc, "prefill_context_parallel_size", 1) or 1)}
    used = [f"{flag} {size}" for flag, size in sizes.items() if size > 1]
    if used:
        raise UnsupportedCacheError(f"context parallelism ({', '.join(used)}) is not supported by p2pkv: its blocks "
                                    "interleave tokens across ranks; run the instances without it")


def check_kv_scales(vllm_config: VllmConfig) -> None:
    """Refuse KV scales computed at run time (`calculate_kv_scales`, in vLLM versions that have it): each instance
    takes its quantized KV's scales from its own first batch, so a decode instance would read the prefill
    instance's bytes with other scales."""
    cache = vllm_config.cache_config
    if getattr(cache, "calculate_kv_scales", False) and kv_cache_dtype(vllm_config):
        raise UnsupportedCacheError(f"--calculate-kv-scales with --kv-cache-dtype {cache.cache_dtype} is not "
                                    "supported by p2pkv: each instance computes its own scales, so KV moved "
                                    "between instances would be read with the wrong ones; use the checkpoint's "
                                    "scales")


def _total_kv_heads(vllm_config: VllmConfig) -> int:
    """KV heads over all tensor-parallel ranks; MLA's latent is one head that every rank holds."""
    model = vllm_config.model_config
    return 1 if model.use_mla else int(model.get_total_num_kv_heads())


class P2pNcclConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Drop-in for vLLM's removed P2pNcclConnector: `kv_connector_module_path="p2pkv.vllm"`. With vLLM's hybrid KV
    cache manager (`SupportsHMA`), each KV cache group moves by its own block ids (`p2pkv.vllm.groups`)."""

    # The prompt tokens it loads came from another instance (vllm:prompt_tokens_cached_by_source{source="p2p"}).
    _cache_hit_source = _P2P_SOURCE

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _route_logs()
        self.groups = cache_groups(kv_cache_config)
        check_batching(vllm_config)
        check_context_parallel(vllm_config)
        check_kv_scales(vllm_config)
        tc = vllm_config.kv_transfer_config
        config = parse_connector_config(tc.kv_role, tc.kv_port, getattr(tc, "kv_load_failure_policy", "fail"),
                                        tc.kv_connector_extra_config, _start_of(vllm_config))
        # With a state group, vLLM's own block size may be the state's (the model's length, where that is shorter)
        block_size = (self.groups.block_size if self.groups.has_state else 0) or vllm_config.cache_config.block_size
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        pp_size = int(vllm_config.parallel_config.pipeline_parallel_size)
        local_dp, self.dp_rank = _data_parallel(vllm_config)
        self.config = config.for_data_parallel_rank(local_dp, tp_size * pp_size)
        check_grouped(self.groups, self.config, vllm_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._heartbeat: HeartbeatSender | None = None
        self._refusals: InstanceRefusals | None = None
        if role == KVConnectorRole.SCHEDULER:
            # One announcer per instance, whatever its parallel sizes: the scheduler side is unique.
            events = _events_of(vllm_config, self.config)
            self._heartbeat = sender_for(self.config, tp_size, pp_size, self.dp_rank, events)
            if self._heartbeat is not None:
                self._heartbeat.start()
            self._refusals = InstanceRefusals(self._heartbeat.note_refusals if self._heartbeat is not None
                                              else lambda notes: None)
            # A probe's answer says what the heartbeats say (for a proxy that lists this instance statically).
            engine_id = self._heartbeat.message.engine_id if self._heartbeat is not None else uuid.uuid4().hex
            self._scheduler = SchedulerSide(self.config, block_size, tp_size, pp_size, engine_id,
                                            self._refusals.latest, events, self.groups)
        else:
            tp_rank, pp_rank = _ranks()
            total_layers, stage_layers = _stage_layers(vllm_config)
            self._worker = WorkerSide(
                self.config, rank=tp_rank, block_size=block_size, tp_size=tp_size,
                total_heads=_total_kv_heads(vllm_config), pp_rank=pp_rank, pp_size=pp_size, total_layers=total_layers,
                stage_layers=stage_layers, model=model_factors(vllm_config), groups=self.groups,
                weights=functools.partial(weights_factor, vllm_config) if self.config.extra.weights_check else None,
                num_blocks=int(getattr(kv_cache_config, "num_blocks", 0) or 0))

    @property
    def scheduler(self) -> SchedulerSide:
        assert self._scheduler is not None, "scheduler-side call on a worker connector"
        return self._scheduler

    @property
    def worker(self) -> WorkerSide:
        assert self._worker is not None, "worker-side call on a scheduler connector"
        return self._worker

    # Worker side.
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, P2pkvMetadata):
            self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # Loads are asynchronous: staged blocks land in get_finished, between forwards.
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Before the forward of a step that may reuse preempted requests' blocks (vLLM 0.19+ passes the step's
        metadata; 0.14 to 0.18 passed the preempted request ids)."""
        if isinstance(kv_connector_metadata, P2pkvMetadata):
            self.worker.handle_preemptions(kv_connector_metadata.preempted)
        elif isinstance(kv_connector_metadata, set):
            self.worker.handle_preemptions(self.worker.transfers_of(kv_connector_metadata))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`, and the requests whose loads failed: a cache of several groups, whose block ids are only
        unique within a group, reports its failures by request (vLLM refuses block ids there)."""
        sent, loaded = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sent or ()), finished_recving=set(loaded or ()),
                                          failed_recving=self.worker.take_failed_loads())

    def get_kv_connector_stats(self) -> P2pkvStats | None:
        """The worker's transfers since the last step (vLLM sums the workers'); none from the scheduler side."""
        data = self._worker.take_stats() if self._worker is not None else None
        return P2pkvStats(data=data) if data is not None else None

    def build_connector_worker_meta(self) -> RefusalNotes | None:
        """The peers this worker refused at their hello, when that changed (vLLM merges the workers')."""
        return self._worker.refusals() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> P2pkvStats:
        return P2pkvStats(data=data) if data is not None else P2pkvStats(data=StepStats().data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> P2pkvPromMetrics:
        return P2pkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._heartbeat is not None:
            self._heartbeat.close()

    # Scheduler side.
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2pkvMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV cache manager: one call for every group. The blocks saved are those each group had when
        the prompt completed (`p2pkv.vllm.producers`); vLLM keeps them all while the transfer runs."""
        return self.scheduler.request_finished(request, list(block_ids[0]) if block_ids else [])

    def update_connector_output(self, connector_output: Any) -> None:
        """Every step, the workers' output: what they refused goes into the heartbeats."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if meta is not None and self._refusals is not None:
            self._refusals.update(meta)

    def reset_cache(self) -> bool:
        """vLLM resets its caches: KV staged or held before is not loaded after (see SchedulerSide.reset)."""
        self.scheduler.reset()
        return True

    def has_pending_push_work(self) -> bool:
        """Keeps vLLM stepping (idle or paused) until the workers have been told of a reset. A vLLM that does not
        ask tells them with the next request's step, still before its loads."""
        return self.scheduler.reset_pending

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Heads outside tokens (LBHNC) where there are several heads: a slice of heads, what moves between
        instances of different tensor-parallel sizes, is then one run per block rather than one per token. MLA's
        one latent head has nothing to slice: vLLM's own choice stands. vLLM drops the request, with a warning,
        where the attention backend does not support that layout."""
        model = getattr(vllm_config, "model_config", None)
        if model is None or model.use_mla:
            return None
        return "LBHNC"
