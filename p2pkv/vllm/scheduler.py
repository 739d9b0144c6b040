"""Scheduler side of the connector (EngineCore process): decides what each worker saves and loads."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from p2pkv.config import ConnectorConfig, Role
from p2pkv.discovery.heartbeat import refused_in_beat
from p2pkv.engine.refused import Refusal
from p2pkv.errors import ConfigError
from p2pkv.params import (
    DecodeParams,
    DiscardParams,
    PrefillParams,
    ProbeAnswer,
    ProbeParams,
)
from p2pkv.vllm.consumers import Consumers
from p2pkv.vllm.groups import CacheGroups
from p2pkv.vllm.metadata import P2pkvMetadata
from p2pkv.vllm.producers import Producers
from p2pkv.vllm.request_params import RequestParams

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class SchedulerSide:
    """Routes vLLM's scheduler hooks by request: a prefill request's transfer to the producer ledger
    (`p2pkv.vllm.producers`), a decode request's to the consumer ledger (`p2pkv.vllm.consumers`), a probe to its
    answer; and tells the workers, once a step, what to save, load, discard and drop."""

    def __init__(self, config: ConnectorConfig, block_size: int, tp_size: int = 1, pp_size: int = 1,
                 engine_id: str = "", refused: Callable[[], Mapping[str, Refusal]] | None = None,
                 kv_events: str = "", groups: CacheGroups | None = None) -> None:
        """`engine_id`, `refused` (the workers' refusals now) and `kv_events` (where KV cache events are
        published): what a probe's answer says besides the KV address, as the instance's heartbeats do. `grouped`:
        the KV cache's groups, each moved by its own block ids (`p2pkv.vllm.groups`)."""
        groups = groups or CacheGroups()
        self._config = config
        self._kv_events = kv_events
        self._engine_id = engine_id
        self._refused = refused
        self._params = RequestParams(config)
        self._tp_size = tp_size
        self._pp_size = pp_size
        self._reset = False  # vLLM reset its caches: the workers drop what is staged at the next step
        self._own_address = config.extra.kv_address(config.kv_port)
        self.consumers = Consumers(config, block_size, tp_size, pp_size, groups.grouped, groups.states)
        self.producers = Producers(config, block_size, tp_size, pp_size, engine_id, self.consumers.claim_keep_s,
                                   groups.windows if groups.grouped else (), groups.states if groups.grouped else ())
        self._produces = config.role is not Role.CONSUMER
        self._consumes = config.role is not Role.PRODUCER

    def on_new_request(self, request: Request) -> None:
        """A decode request is queued: until it has blocks, what is held for its transfer is kept. One that is no
        transfer of ours is counted, and said once per reason and peer. A prefill request of a model with state
        computes its prompt but the last token (`Producers.arrived`)."""
        try:  # invalid parameters are logged once, when the request is scheduled
            params = self._params.parse(request)
        except ConfigError:
            return
        if isinstance(params, PrefillParams) and self._produces:
            self.producers.arrived(request)
        if isinstance(params, DecodeParams) and self._consumes:
            self.consumers.queued(request, params)
        if params is None:
            self.consumers.not_ours(request, self._produces)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = self._params.get(request)
        if isinstance(params, DiscardParams):
            if self._consumes:
                self.consumers.discard(params.transfer_id, params.prefill_kv, params.pull, params.prefill_tp,
                                       params.prefill_pp)
            if self._produces:
                self.producers.abandon(params.transfer_id)
            return 0, False  # the request itself (the proxy's, of one token) is computed as any other
        if not isinstance(params, DecodeParams) or not self._consumes:
            return 0, False
        return self.consumers.matched(request, params, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = self._params.get(request)
        if isinstance(params, PrefillParams) and self._produces:
            self.producers.allocated(request, params)
        elif isinstance(params, DecodeParams) and self._consumes:
            self.consumers.allocated(request, params, blocks, num_external_tokens)

    def reset(self) -> None:
        """vLLM resets its caches (its prefix cache with the connector's: after a weight update, on `/pause` with
        the cache cleared, or `/reset_prefix_cache?reset_external=true`). No KV computed before may be loaded after:
        the workers drop what is staged for this instance at the next step, before its loads, and blocks held here
        for a pull are no longer offered, so their requests compute their prompts where they decode. vLLM's own
        reset fails while those blocks are held; it succeeds once they are freed, a step later."""
        self._reset = True
        self.producers.reset()

    @property
    def reset_pending(self) -> bool:
        """A reset not yet told to the workers: vLLM must step once more (it may be idle, or paused)."""
        return self._reset

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2pkvMetadata:
        now = time.monotonic()
        meta = P2pkvMetadata(idle=not scheduler_output.total_num_scheduled_tokens, reset=self._reset)
        self._reset = False
        self.consumers.step(meta, now)
        self.producers.step(meta, scheduler_output, now)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = self._params.get(request)
        if isinstance(params, ProbeParams):
            host = self._config.extra.kv_host
            said = refused_in_beat(self._refused(), time.monotonic()) if self._refused is not None else ()
            return False, ProbeAnswer(self._config.kv_port, "" if host in ("0.0.0.0", "::") else host,
                                      self._tp_size, self._pp_size, self._config.takes_pulls, self._engine_id,
                                      str(self._own_address),
                                      tuple((p.address, p.reason, p.age_s, p.launch) for p in said),
                                      self._config.launch, self._kv_events).to_dict()
        self.consumers.finished(request, params if isinstance(params, DecodeParams) else None)
        return self.producers.finished(request)
