"""Scheduler side, consuming (a decode instance): which request loads which transfer into which blocks, which
transfers nothing here loads, and which requests wait for blocks meanwhile."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from p2pkv.config import ConnectorConfig
from p2pkv.params import Address, DecodeParams, foreign_params, prompt_digest
from p2pkv.vllm.groups import state_only
from p2pkv.vllm.metadata import Discard, LoadSpec, P2pkvMetadata
from p2pkv.vllm.waiting import WaitingRequests
from p2pkv.way import push_or_pull

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class _Claim:
    """Which request of this instance loads a transfer. vLLM's parallel sampling (`n` > 1) turns a request into
    one per sample, each with the same `kv_transfer_params`: only the first loads the KV; the others wait until
    it has landed and find the prompt's blocks in the prefix cache."""

    request: Request | None  # None: no load in flight for it (it was not needed, or it has finished)
    since: float
    wait_s: float = 0.0  # sent alongside its prefill: its KV may begin to come this much later

    def loading(self, now: float, limit_s: float) -> bool:
        """The claiming request still waits for its KV (bounded: its load settles by the transfer's deadline)."""
        status = getattr(getattr(self.request, "status", None), "name", "")
        return status == "WAITING_FOR_REMOTE_KVS" and now - self.since < limit_s + self.wait_s


class Consumers:
    def __init__(self, config: ConnectorConfig, block_size: int, tp_size: int, pp_size: int,
                 grouped: bool = False, states: tuple[bool, ...] = ()) -> None:
        """`grouped`: every KV cache group's block ids go to the workers (`p2pkv.vllm.groups`), and KV that would
        be pulled is not taken; `states`: which groups hold a state (Mamba)."""
        self._grouped = grouped
        self._states = states if any(states) else ()
        self._block_size = block_size
        self._tp_size = tp_size
        self._pp_size = pp_size
        self._consumed: set[str] = set()
        self._prompts: dict[str, bool] = {}  # request id -> whether its transfer holds its prompt's KV
        self._claims: dict[str, _Claim] = {}  # transfer id -> its claim, in the order they were made
        self._loads: list[LoadSpec] = []
        self._discards: list[Discard] = []
        self._computed_here: list[str] = []  # reasons of requests queued since the last step that load nothing
        self._warned: set[tuple[str, str]] = set()  # (reason, peer) said once each
        # Decode requests waiting for blocks: what is held for their transfers is kept while they wait.
        self._waiting = WaitingRequests(min(config.extra.lease_s, config.extra.staging_expiry_s), tp_size, pp_size)
        # A claim is kept a while after its load, so that late samples of the same request do not wait for KV
        # that was already taken; a sample waits for a claim's load at most this long.
        self.claim_wait_s = config.extra.transfer_timeout_s + 10.0
        self.claim_keep_s = 2 * self.claim_wait_s + 60.0

    def claimed(self, transfer_id: str) -> bool:
        return transfer_id in self._claims

    @property
    def claims(self) -> int:
        return len(self._claims)

    def queued(self, request: Request, params: DecodeParams) -> None:
        """A decode request is queued: until it has blocks, what is held for its transfer is kept."""
        self._waiting.add(request.request_id, params)

    def not_ours(self, request: Request, takes_prefill: bool) -> None:
        """A request with no transfer of ours (`takes_prefill`: this instance prefills for others): counted, and
        said once per reason and peer."""
        found = foreign_params(request.kv_transfer_params, takes_prefill)
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

    def matched(self, request: Request, params: DecodeParams, num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many prompt tokens this request loads (`get_num_new_matched_tokens`)."""
        if request.request_id in self._consumed:
            return 0, False
        if not self._same_prompt(request, params):
            self._waiting.drop(request.request_id)  # it will load nothing
            return 0, False
        claim = self._claims.get(params.transfer_id)
        if claim is not None and claim.request is not request:
            # Another sample of the same request took this transfer: wait (None: vLLM asks again next step) until
            # its KV has landed, then compute the rest here, the landed blocks coming from the prefix cache.
            return (None, False) if claim.loading(time.monotonic(), self.claim_wait_s) else (0, False)
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
        if self._grouped and self._pulled(params.pull, params.prefill_tp, params.prefill_pp)[2]:
            self._computed_here.append("grouped_pull")
            peer = str(params.prefill_kv)
            if ("grouped_pull", peer) not in self._warned and len(self._warned) <= 1000:
                self._warned.add(("grouped_pull", peer))
                log.warning("transfer %s would be pulled from %s (another parallel size, or send_type GET), which "
                            "p2pkv does not do for a KV cache of several groups or a sliding window yet: its requests "
                            "compute their prompts here (said once per peer; p2pkv_requests_computed_here_total "
                            "counts them)", params.transfer_id, peer)
            self._prompts[request.request_id] = False
            return False
        if params.alongside_s and not params.num_prompt_tokens:
            # Sent before the prefill answered: the push says its prompt, checked before any of it lands. A pull
            # says nothing of it, so KV that would be pulled (another parallel size) is not taken.
            same = not self._pulled(params.pull, params.prefill_tp, params.prefill_pp)[2]
            if not same:
                log.warning("transfer %s was sent alongside its prefill, whose instance has other parallel sizes (its "
                            "KV would be pulled): request %s computes its prompt here", params.transfer_id,
                            request.request_id)
            self._prompts[request.request_id] = same
            return same
        same = len(prompt) == params.num_prompt_tokens and (not params.prompt or prompt_digest(prompt) == params.prompt)
        if not same:
            log.info("transfer %s holds the KV of another prompt (%d tokens; this one has %d, %s); computing "
                     "request %s here", params.transfer_id, params.num_prompt_tokens, len(prompt),
                     "same length" if len(prompt) == params.num_prompt_tokens else "another length",
                     request.request_id)
        self._prompts[request.request_id] = same
        return same

    def allocated(self, request: Request, params: DecodeParams, blocks: KVCacheBlocks,
                  num_external_tokens: int) -> None:
        """vLLM gave the request its blocks (`update_state_after_alloc`): its load, if any, starts this step."""
        req_id = request.request_id
        if req_id in self._consumed:
            return
        self._waiting.drop(req_id)
        self._consumed.add(req_id)
        if not self._same_prompt(request, params):
            return  # nothing of the transfer is this request's to load or to free
        if num_external_tokens <= 0:
            # Nothing to load (the prompt was in the local cache). No load is reported for it: vLLM does not wait
            # for one.
            self.discard(params.transfer_id, params.prefill_kv, params.pull, params.prefill_tp, params.prefill_pp,
                         params.alongside_s)
            return
        self._claims[params.transfer_id] = _Claim(request, time.monotonic(), params.alongside_s)
        num_prompt = len(request.prompt_token_ids or ())
        first = (num_prompt - 1 - num_external_tokens) // self._block_size
        last = (num_prompt - 2) // self._block_size
        # A state group's one block stands in the last place: the state after the prompt's tokens loaded here
        groups = tuple(state_only(tuple(ids), last + 1 - first) if self._states and self._states[group]
                       else tuple(ids[first : last + 1]) for group, ids in enumerate(blocks.get_block_ids()))
        block_ids = next((ids for ids, state in zip(groups, self._states, strict=True) if not state),
                         groups[0]) if self._states else groups[0]
        prefill_tp, prefill_pp, pulled = self._pulled(params.pull, params.prefill_tp, params.prefill_pp)
        self._loads.append(LoadSpec(req_id=req_id, transfer_id=params.transfer_id, first_block=first,
                                    block_ids=block_ids, corrupt=params.test_corrupt,
                                    groups=groups if self._grouped else (),
                                    pull_from=params.prefill_kv if pulled else None, fallback_from=params.prefill_kv,
                                    prefill_tp=prefill_tp, prefill_pp=prefill_pp,
                                    prefill_launch=params.prefill_launch,
                                    prompt=prompt_digest(request.prompt_token_ids or ()) if params.alongside_s else "",
                                    wait_s=params.alongside_s))

    def _pulled(self, pull: bool, prefill_tp: int, prefill_pp: int) -> tuple[int, int, bool]:
        """A decode request's transfer: the prefill sizes that differ from ours (0: the same, or not said), and
        whether this side pulls. From a prefill instance of another size every rank pulls its heads of its layers,
        whatever the mode: whole blocks pushed rank to rank would hold the wrong heads or layers."""
        prefill_tp = prefill_tp if prefill_tp not in (0, self._tp_size) else 0
        prefill_pp = prefill_pp if prefill_pp not in (0, self._pp_size) else 0
        decision = push_or_pull(sizes_differ=bool(prefill_tp or prefill_pp), decode_pulls=pull)
        return prefill_tp, prefill_pp, decision.pulled

    def discard(self, transfer_id: str, prefill_kv: Address | None, pull: bool, prefill_tp: int,
                prefill_pp: int, wait_s: float = 0.0) -> None:
        """No request here loads this transfer: its staged bytes are freed when they arrive, instead of at expiry,
        and blocks a prefill instance holds for our pull (GET, or another size; or a push this side refuses) are
        released, each rank releasing what it would have pulled. Once per transfer; none for a transfer a request
        here has claimed (its load frees what it took). `wait_s`: the push may begin this much later (its decode
        request went alongside the prefill)."""
        if transfer_id in self._claims:
            return
        self._claims[transfer_id] = _Claim(None, time.monotonic(), wait_s)
        prefill_tp, prefill_pp, pulled = self._pulled(pull, prefill_tp, prefill_pp)
        self._discards.append(Discard(transfer_id, prefill_kv if pulled else None, prefill_tp, prefill_pp,
                                      None if pulled else prefill_kv, wait_s))

    def finished(self, request: Request, params: DecodeParams | None) -> None:
        req_id = request.request_id
        self._consumed.discard(req_id)
        self._prompts.pop(req_id, None)
        self._waiting.drop(req_id)
        if params is not None and (claim := self._claims.get(params.transfer_id)) is not None:
            if claim.request is request:
                claim.request = None

    def step(self, meta: P2pkvMetadata, now: float) -> None:
        """This step's loads, discards, kept transfers and requests computed here go into `meta`; claims older than
        their keep (the oldest come first) are dropped, unless still in use."""
        meta.loads, meta.discards, meta.computed_here = self._loads, self._discards, self._computed_here
        meta.wanted = self._waiting.due(now)
        self._loads, self._discards, self._computed_here = [], [], []
        while self._claims:
            tid, claim = next(iter(self._claims.items()))
            if now - claim.since < self.claim_keep_s + claim.wait_s or claim.loading(now, self.claim_wait_s):
                break
            del self._claims[tid]
