"""Scheduler side of the connector (EngineCore process): decides what each worker saves and loads."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from p2pkv.config import ConnectorConfig, Role, SendType
from p2pkv.discovery.heartbeat import refused_in_beat
from p2pkv.engine.refused import Refusal
from p2pkv.errors import ConfigError
from p2pkv.params import (
    Address,
    DecodeParams,
    DiscardParams,
    PrefillParams,
    ProbeAnswer,
    ProbeParams,
    foreign_params,
    prompt_digest,
    standard_answer,
)
from p2pkv.vllm.metadata import Discard, LoadSpec, P2pkvMetadata, SaveSpec
from p2pkv.vllm.request_params import RequestParams
from p2pkv.vllm.waiting import WaitingRequests

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
# How vLLM ends a request whose answer never reaches the client: aborted (the client went away), or failed.
_UNANSWERED = ("FINISHED_ABORTED", "FINISHED_ERROR")


@dataclass
class _Producer:
    transfer_id: str
    peer: Address | None  # None: GET mode, the decode side pulls
    num_prompt_tokens: int
    inline: bool
    prompt: str  # its prompt_digest
    block_ids: list[int] = field(default_factory=list)
    saved: bool = False
    abandoned: bool = False  # nobody will get its answer (aborted, or the proxy said so): nothing to hold for a pull
    preempted: bool = False  # preempted after a save: its next save holds the transfer again, in its new blocks
    pulled_by: Address | None = None  # GET: the decode instance that will pull (rank 0), when the proxy said
    pullers: int = 0  # its ranks
    puller_launch: str = ""  # GET: which start of that instance will pull, when the proxy said
    standard: bool = False  # asked in vLLM's standard protocol: the answer carries its fields too


@dataclass
class _Claim:
    """Which request of this instance loads a transfer. vLLM's parallel sampling (`n` > 1) turns a request into
    one per sample, each with the same `kv_transfer_params`: only the first loads the KV; the others wait until
    it has landed and find the prompt's blocks in the prefix cache."""

    request: Request | None  # None: no load in flight for it (it was not needed, or it has finished)
    since: float

    def loading(self, now: float, limit_s: float) -> bool:
        """The claiming request still waits for its KV (bounded: its load settles by the transfer's deadline)."""
        status = getattr(getattr(self.request, "status", None), "name", "")
        return status == "WAITING_FOR_REMOTE_KVS" and now - self.since < limit_s


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, block_size: int, tp_size: int = 1, pp_size: int = 1,
                 engine_id: str = "", refused: Callable[[], Mapping[str, Refusal]] | None = None) -> None:
        """`engine_id` and `refused` (the workers' refusals now): what a probe's answer says besides the KV
        address, as the instance's heartbeats do."""
        self._config = config
        self._engine_id = engine_id
        self._refused = refused
        self._params = RequestParams(config)
        self._block_size = block_size
        self._tp_size = tp_size
        self._pp_size = pp_size
        self._producers: dict[str, _Producer] = {}
        # transfer id -> its producer and when it began, kept as long as claims are (a late sample must not send
        # the transfer again)
        self._producing: dict[str, tuple[_Producer, float]] = {}
        self._siblings: dict[str, _Producer] = {}  # request id -> the producer of the same transfer
        self._consumed: set[str] = set()
        self._prompts: dict[str, bool] = {}  # request id -> whether its transfer holds its prompt's KV
        self._claims: dict[str, _Claim] = {}  # transfer id -> its claim, in the order they were made
        self._loads: list[LoadSpec] = []
        self._discards: list[Discard] = []
        self._abandoned: list[str] = []
        self._reset = False  # vLLM reset its caches: the workers drop what is staged at the next step
        self._computed_here: list[str] = []  # reasons of requests queued since the last step that load nothing
        self._warned: set[tuple[str, str]] = set()  # (reason, peer) said once each
        # Decode requests waiting for blocks: what is held for their transfers is kept while they wait.
        self._waiting = WaitingRequests(min(config.extra.lease_s, config.extra.staging_expiry_s), tp_size, pp_size)
        # A claim is kept a while after its load, so that late samples of the same request do not wait for KV
        # that was already taken; a sample waits for a claim's load at most this long.
        self._claim_wait_s = config.extra.transfer_timeout_s + 10.0
        self._claim_keep_s = 2 * self._claim_wait_s + 60.0
        self._own_address = config.extra.kv_address(config.kv_port)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def on_new_request(self, request: Request) -> None:
        """A decode request is queued: until it has blocks, what is held for its transfer is kept. One that is no
        transfer of ours is counted, and said once per reason and peer."""
        try:  # invalid parameters are logged once, when the request is scheduled
            params = self._params.parse(request)
        except ConfigError:
            return
        if isinstance(params, DecodeParams) and self._config.role is not Role.PRODUCER:
            self._waiting.add(request.request_id, params)
        if params is None:
            self._not_ours(request)

    def _not_ours(self, request: Request) -> None:
        found = foreign_params(request.kv_transfer_params, self._config.role is not Role.CONSUMER)
        if found is None:
            return
        reason, peer = found
        self._computed_here.append(reason)
        if (reason, peer) in self._warned or len(self._warned) > 1000:
            return
        self._warned.add((reason, peer))
        if reason == "foreign":
            keys = sorted(request.kv_transfer_params) if isinstance(request.kv_transfer_params, dict) else []
            log.warning("request %s: kv_transfer_params from another connector (keys %s; from %s), not p2pkv's: "
                        "this instance computes the prompt itself. Run p2pkv's connector on the prefill instances "
                        "too, and pass their answers' kv_transfer_params on verbatim (said once per peer)",
                        request.request_id, ", ".join(keys) or "none", peer or "an unnamed peer")
        elif reason == "prefill":
            log.warning("request %s: prefill params (do_remote_decode) sent to a decode instance: it computes the "
                        "request itself; send prefill requests to kv_producer instances (said once)",
                        request.request_id)
        else:
            log.warning("request %s came without kv_transfer_params: this decode instance computes its prompt "
                        "itself. A router must pass the prefill answer's kv_transfer_params to the decode request "
                        "(said once; p2pkv_requests_computed_here_total counts them)", request.request_id)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = self._params.get(request)
        if isinstance(params, DiscardParams):
            if self._config.role is not Role.PRODUCER:
                self._discard(params.transfer_id, params.prefill_kv, params.pull, params.prefill_tp,
                              params.prefill_pp)
            if self._config.role is not Role.CONSUMER:
                producing = self._producing.get(params.transfer_id)
                if producing is not None:
                    self._abandon(producing[0])
            return 0, False  # the request itself (the proxy's, of one token) is computed as any other
        if not isinstance(params, DecodeParams) or request.request_id in self._consumed:
            return 0, False
        if self._config.role is Role.PRODUCER:
            return 0, False
        if not self._same_prompt(request, params):
            self._waiting.drop(request.request_id)  # it will load nothing
            return 0, False
        claim = self._claims.get(params.transfer_id)
        if claim is not None and claim.request is not request:
            # Another sample of the same request took this transfer: wait (None: vLLM asks again next step) until
            # its KV has landed, then compute the rest here, the landed blocks coming from the prefix cache.
            return (None, False) if claim.loading(time.monotonic(), self._claim_wait_s) else (0, False)
        # The last prompt token is always computed here, so its logits exist to sample from.
        external = len(request.prompt_token_ids or ()) - 1 - num_computed_tokens
        return (external, True) if external > 0 else (0, False)

    def _same_prompt(self, request: Request, params: DecodeParams) -> bool:
        """Whether the transfer's KV was computed for this request's prompt: its length, and its digest where the
        prefill instance gave one. Not so for the other prompts of a batch (one request, one transfer: the first
        prompt's), or for params sent with the wrong request: those are computed here, and the transfer is left to
        the request it belongs to."""
        known = self._prompts.get(request.request_id)
        if known is not None:
            return known
        prompt = request.prompt_token_ids or ()
        same = len(prompt) == params.num_prompt_tokens and (not params.prompt or prompt_digest(prompt) == params.prompt)
        if not same:
            log.info("transfer %s holds the KV of another prompt (%d tokens; this one has %d, %s); computing "
                     "request %s here", params.transfer_id, params.num_prompt_tokens, len(prompt),
                     "same length" if len(prompt) == params.num_prompt_tokens else "another length",
                     request.request_id)
        self._prompts[request.request_id] = same
        return same

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = self._params.get(request)
        req_id = request.request_id
        if isinstance(params, PrefillParams) and self._config.role is not Role.CONSUMER:
            if req_id in self._producers or req_id in self._siblings:
                return
            producing = self._producing.get(params.transfer_id)
            if producing is not None:
                # Parallel sampling (`n` > 1) on the prefill side: one request per sample, one transfer. The first
                # sample's blocks are sent; the others answer with the same parameters.
                self._siblings[req_id] = producing[0]
                return
            # A decode instance of another tensor- or pipeline-parallel size pulls the heads and layers each
            # of its ranks needs.
            other_size = params.decode_tp not in (0, self._tp_size) or params.decode_pp not in (0, self._pp_size)
            pull = (params.pull or params.decode_kv is None or self._config.extra.send_type is SendType.GET
                    or other_size)
            num_prompt = len(request.prompt_token_ids or ())
            inline = params.inline or self._config.extra.send_type is SendType.PUT
            producer = _Producer(params.transfer_id, None if pull else params.decode_kv, num_prompt, inline,
                                 prompt_digest(request.prompt_token_ids or ()),
                                 pulled_by=params.decode_kv if pull else None,
                                 pullers=(params.decode_tp or self._tp_size) * (params.decode_pp or self._pp_size),
                                 puller_launch=params.decode_launch if pull else "", standard=params.standard)
            self._producers[req_id] = producer
            self._producing[params.transfer_id] = (producer, time.monotonic())
            return
        if not isinstance(params, DecodeParams) or req_id in self._consumed or self._config.role is Role.PRODUCER:
            return
        self._waiting.drop(req_id)  # it has its blocks: its load, if any, starts this step
        self._consumed.add(req_id)
        if not self._same_prompt(request, params):
            return  # nothing of the transfer is this request's to load or to free
        if num_external_tokens <= 0:
            # Nothing to load (the prompt was in the local cache). No load is reported for it: vLLM does not wait
            # for one.
            self._discard(params.transfer_id, params.prefill_kv, params.pull, params.prefill_tp, params.prefill_pp)
            return
        self._claims[params.transfer_id] = _Claim(request, time.monotonic())
        num_prompt = len(request.prompt_token_ids or ())
        first = (num_prompt - 1 - num_external_tokens) // self._block_size
        last = (num_prompt - 2) // self._block_size
        block_ids = blocks.get_block_ids()[0]
        # From a prefill instance of another tensor- or pipeline-parallel size every rank pulls its heads of its
        # layers, whatever the mode: whole blocks pushed rank to rank would hold the wrong heads or layers (the
        # receiving ranks refuse them).
        prefill_tp = params.prefill_tp if params.prefill_tp not in (0, self._tp_size) else 0
        prefill_pp = params.prefill_pp if params.prefill_pp not in (0, self._pp_size) else 0
        pulled = params.pull or bool(prefill_tp or prefill_pp)
        self._loads.append(LoadSpec(req_id, params.transfer_id, first, tuple(block_ids[first : last + 1]),
                                    params.test_corrupt, params.prefill_kv if pulled else None,
                                    params.prefill_kv, prefill_tp, prefill_pp, params.prefill_launch))

    def _abandon(self, producer: _Producer) -> None:
        """Nobody will get this transfer's answer (its request was aborted, or its client went away and the proxy
        said so): no decode instance will pull its blocks. Saved, the workers stop offering them (a push in flight
        still reads them: they go when it is done); not saved yet, it will not be."""
        if producer.abandoned:
            return
        producer.abandoned = True
        if producer.saved:
            self._abandoned.append(producer.transfer_id)

    def _discard(self, transfer_id: str, prefill_kv: Address | None, pull: bool, prefill_tp: int,
                 prefill_pp: int) -> None:
        """No request here loads this transfer: its staged bytes are freed when they arrive, instead of at expiry,
        and blocks a prefill instance holds for our pull (GET, or another size; or a push this side refuses) are
        released, each rank releasing what it would have pulled. Once per transfer; none for a transfer a request
        here has claimed (its load frees what it took)."""
        if transfer_id in self._claims:
            return
        self._claims[transfer_id] = _Claim(None, time.monotonic())
        prefill_tp = prefill_tp if prefill_tp not in (0, self._tp_size) else 0
        prefill_pp = prefill_pp if prefill_pp not in (0, self._pp_size) else 0
        pulled = pull or bool(prefill_tp or prefill_pp)
        self._discards.append(Discard(transfer_id, prefill_kv if pulled else None, prefill_tp, prefill_pp,
                                      None if pulled else prefill_kv))

    def reset(self) -> None:
        """vLLM resets its caches (its prefix cache with the connector's: after a weight update, on `/pause` with
        the cache cleared, or `/reset_prefix_cache?reset_external=true`). No KV computed before may be loaded after:
        the workers drop what is staged for this instance at the next step, before its loads, and blocks held here
        for a pull are no longer offered, so their requests compute their prompts where they decode. vLLM's own
        reset fails while those blocks are held; it succeeds once they are freed, a step later."""
        self._reset = True
        for producer, _ in self._producing.values():
            if producer.saved or producer.preempted:
                self._abandon(producer)

    @property
    def reset_pending(self) -> bool:
        """A reset not yet told to the workers: vLLM must step once more (it may be idle, or paused)."""
        return self._reset

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2pkvMetadata:
        now = time.monotonic()
        meta = P2pkvMetadata(loads=self._loads, discards=self._discards, abandoned=self._abandoned,
                             wanted=self._waiting.due(now), idle=not scheduler_output.total_num_scheduled_tokens,
                             reset=self._reset, computed_here=self._computed_here)
        self._loads, self._discards, self._abandoned, self._reset = [], [], [], False
        self._computed_here = []
        self._forget_claims(now)
        if not self._producers:
            return meta
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            producer = self._producers.get(req_id)
            if producer is not None and producer.saved:
                meta.preempted.append(producer.transfer_id)
                # vLLM computes its prompt again when it resumes (a prefill request that goes on decoding): the
                # transfer is then held again, in the blocks it has by then.
                producer.saved, producer.preempted, producer.block_ids = False, True, []
        progress: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            producer = self._producers.get(new.req_id)
            if producer is not None:
                producer.block_ids = list(new.block_ids[0])
                progress[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            producer = self._producers.get(req_id)
            if producer is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                producer.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                producer.block_ids.extend(new_ids[0])
            progress[req_id] = cached.num_computed_tokens[i]
        for req_id, computed in progress.items():
            producer = self._producers[req_id]
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if producer.saved or producer.abandoned or done < producer.num_prompt_tokens:
                continue
            # The prompt completes in this step: every block of it holds final KV once the forward has run.
            producer.saved = True
            blocks = tuple(producer.block_ids[: self._blocks_for(producer.num_prompt_tokens)])
            if producer.preempted:
                meta.saves.append(SaveSpec(req_id, producer.transfer_id, None, blocks, again=True))
            else:
                meta.saves.append(SaveSpec(req_id, producer.transfer_id, producer.peer, blocks, producer.inline,
                                           pulled_by=producer.pulled_by, pullers=producer.pullers,
                                           puller_launch=producer.puller_launch))
        return meta

    def _forget_claims(self, now: float) -> None:
        """Drop claims and producers older than their keep (the oldest come first), unless still in use."""
        while self._claims:
            tid, claim = next(iter(self._claims.items()))
            if now - claim.since < self._claim_keep_s or claim.loading(now, self._claim_wait_s):
                break
            del self._claims[tid]
        while self._producing:
            tid, (_, since) = next(iter(self._producing.items()))
            if now - since < self._claim_keep_s:
                break
            del self._producing[tid]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        params = self._params.get(request)
        if isinstance(params, ProbeParams):
            host = self._config.extra.kv_host
            said = refused_in_beat(self._refused(), time.monotonic()) if self._refused is not None else ()
            return False, ProbeAnswer(self._config.kv_port, "" if host in ("0.0.0.0", "::") else host,
                                      self._tp_size, self._pp_size, self._config.takes_pulls, self._engine_id,
                                      str(self._own_address),
                                      tuple((p.address, p.reason, p.age_s, p.launch) for p in said),
                                      self._config.launch).to_dict()
        self._consumed.discard(req_id)
        self._prompts.pop(req_id, None)
        self._waiting.drop(req_id)
        if isinstance(params, DecodeParams) and (claim := self._claims.get(params.transfer_id)) is not None:
            if claim.request is request:
                claim.request = None
        sibling_of = self._siblings.pop(req_id, None)
        if sibling_of is not None:
            # Its blocks go at once: the first sample's blocks are the ones sent or held for the pull.
            return False, self._answer(sibling_of) if sibling_of.saved or sibling_of.preempted else None
        producer = self._producers.pop(req_id, None)
        # Preempted after a save and not saved again yet: the workers still track the transfer (a push in flight,
        # or the withdrawn offer), and report when they let go of it; vLLM must keep the request until then.
        if producer is None or not (producer.saved or producer.preempted):
            return False, None
        if getattr(request.status, "name", "") in _UNANSWERED:
            self._abandon(producer)
        # Keep the blocks until the workers report the push finished or the pull served (finished_sending).
        return True, self._answer(producer)

    def _answer(self, producer: _Producer) -> dict[str, Any]:
        """The decode side's parameters for a saved prompt. The prefill address goes along in push mode too: a
        decode side without staging space pulls instead."""
        answer = DecodeParams(producer.transfer_id, producer.num_prompt_tokens, self._own_address,
                              pull=producer.peer is None, prefill_tp=self._tp_size, prefill_pp=self._pp_size,
                              prompt=producer.prompt, lease_s=self._config.extra.lease_s,
                              prefill_launch=self._config.launch).to_dict()
        return standard_answer(answer, self._engine_id, self._own_address) if producer.standard else answer
