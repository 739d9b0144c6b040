"""Scheduler side, producing (a prefill instance): each prefill request's transfer, its blocks as vLLM gives them,
when its prompt is saved (pushed or held for a pull), and the parameters its answer gives the decode side."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from p2pkv.config import ConnectorConfig, SendType
from p2pkv.params import Address, DecodeParams, PrefillParams, prompt_digest, standard_answer
from p2pkv.vllm.groups import NULL_BLOCK, frees_soon, state_only, window_start
from p2pkv.vllm.metadata import P2pkvMetadata, SaveSpec
from p2pkv.way import push_or_pull

if TYPE_CHECKING:
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
    answer_tokens: int = 0  # the prompt's tokens the answer names: one more than computed where a state is moved
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    saved: bool = False
    abandoned: bool = False  # nobody will get its answer (aborted, or the proxy said so): nothing to hold for a pull
    preempted: bool = False  # preempted after a save: its next save holds the transfer again, in its new blocks
    pulled_by: Address | None = None  # GET: the decode instance that will pull (rank 0), when the proxy said
    pullers: int = 0  # its ranks
    puller_launch: str = ""  # GET: which start of that instance will pull, when the proxy said
    standard: bool = False  # asked in vLLM's standard protocol: the answer carries its fields too
    decodes: bool = False  # generates more than one token: it goes on after its prompt's step


class Producers:
    def __init__(self, config: ConnectorConfig, block_size: int, tp_size: int, pp_size: int, engine_id: str,
                 keep_s: float, windows: tuple[int, ...] = (), states: tuple[bool, ...] = ()) -> None:
        """`keep_s`: how long a transfer is remembered after it began (a late sample must not send it again);
        `windows`: each KV cache group's sliding window (0: full attention), where every group's block ids go to
        the workers (`p2pkv.vllm.groups`); `states`: which groups hold a state (Mamba)."""
        self._config = config
        self._windows = windows
        self._states = states if any(states) else ()
        self._cut: dict[str, tuple[int, str]] = {}  # request id -> its whole prompt's length and digest
        self._uncut_said = False
        self._block_size = block_size
        self._tp_size = tp_size
        self._pp_size = pp_size
        self._engine_id = engine_id
        self._keep_s = keep_s
        self._own_address = config.extra.kv_address(config.kv_port)
        self._producers: dict[str, _Producer] = {}  # request id -> its transfer
        # transfer id -> its producer and when it began
        self._producing: dict[str, tuple[_Producer, float]] = {}
        self._siblings: dict[str, _Producer] = {}  # request id -> the producer of the same transfer
        self._abandoned: list[str] = []

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def arrived(self, request: Request) -> None:
        """A prefill request of a model with state (Mamba) computes its prompt but its last token: the decode side
        computes that token from the state after the others, as it does the last token of any prompt (a state
        after the whole prompt would take that token in twice). vLLM's own NIXL connector cuts it so too."""
        prompt, tokens = request.prompt_token_ids, getattr(request, "_all_token_ids", None)
        if not self._states or request.request_id in self._cut or not isinstance(prompt, list) or len(prompt) < 2:
            return
        skips_cache = getattr(request, "get_skip_reading_prefix_cache", None)
        if (getattr(request, "prompt_embeds", None) is not None or getattr(request, "resumable", False)
                or (skips_cache is not None and skips_cache())):
            # Embeddings beside the ids, a session whose next input follows the prompt, prompt logprobs: the cut
            # would lose a token, so nothing is saved (`allocated`) and the decode side computes the prompt
            return
        if not isinstance(tokens, list) or len(tokens) != len(prompt) or getattr(request, "num_prompt_tokens",
                                                                                  len(prompt)) != len(prompt):
            return  # not a request this code knows how to cut: nothing is saved (`allocated`)
        self._cut[request.request_id] = (len(prompt), prompt_digest(prompt))
        del prompt[-1:]
        del tokens[-1:]
        request.num_prompt_tokens = len(prompt)
        request.max_tokens = 1  # its one answer token is the proxy's to drop; a second step would move the state on

    def allocated(self, request: Request, params: PrefillParams) -> None:
        """vLLM gave a prefill request its blocks (`update_state_after_alloc`): its transfer begins, pushed or held
        for a pull as `push_or_pull` decides."""
        req_id = request.request_id
        whole = self._cut.pop(req_id, None)
        if req_id in self._producers or req_id in self._siblings:
            return
        producing = self._producing.get(params.transfer_id)
        if producing is not None:
            # Parallel sampling (`n` > 1) on the prefill side: one request per sample, one transfer. The first
            # sample's blocks are sent; the others answer with the same parameters.
            self._siblings[req_id] = producing[0]
            return
        pull = push_or_pull(
            sizes_differ=params.decode_tp not in (0, self._tp_size) or params.decode_pp not in (0, self._pp_size),
            decode_pulls=params.pull or self._config.extra.send_type is SendType.GET,
            decode_kv_known=params.decode_kv is not None).pulled
        num_prompt = len(request.prompt_token_ids or ())
        if self._states and whole is None and num_prompt != 1:  # one token: the decode side computes it all
            if not self._uncut_said:
                self._uncut_said = True
                log.warning("request %s: a prompt p2pkv cannot cut by its last token (embeddings, a streaming-input "
                            "session, prompt logprobs): the state after its whole prompt would be wrong on the "
                            "decode side, so nothing is saved and the decode side computes it (said once)", req_id)
            return
        inline = params.inline or self._config.extra.send_type is SendType.PUT
        producer = _Producer(params.transfer_id, None if pull else params.decode_kv, num_prompt, inline,
                             whole[1] if whole else prompt_digest(request.prompt_token_ids or ()),
                             whole[0] if whole else num_prompt,
                             pulled_by=params.decode_kv if pull else None,
                             pullers=(params.decode_tp or self._tp_size) * (params.decode_pp or self._pp_size),
                             puller_launch=params.decode_launch if pull else "", standard=params.standard,
                             decodes=(getattr(request, "max_tokens", 1) or 1) > 1)
        self._producers[req_id] = producer
        self._producing[params.transfer_id] = (producer, time.monotonic())

    def abandon(self, transfer_id: str) -> None:
        """The proxy says nobody will get this transfer's answer (its client went away)."""
        producing = self._producing.get(transfer_id)
        if producing is not None:
            self._abandon(producing[0])

    def _abandon(self, producer: _Producer) -> None:
        """Nobody will get this transfer's answer (its request was aborted, or its client went away and the proxy
        said so): no decode instance will pull its blocks. Saved, the workers stop offering them (a push in flight
        still reads them: they go when it is done); not saved yet, it will not be."""
        if producer.abandoned:
            return
        producer.abandoned = True
        if producer.saved:
            self._abandoned.append(producer.transfer_id)

    def reset(self) -> None:
        """vLLM reset its caches: blocks held here for a pull are no longer offered (`SchedulerSide.reset`)."""
        for producer, _ in self._producing.values():
            if producer.saved or producer.preempted:
                self._abandon(producer)

    def step(self, meta: P2pkvMetadata, scheduler_output: SchedulerOutput, now: float) -> None:
        """This step's saves (prompts that complete in it), preempted and abandoned transfers go into `meta`;
        transfers older than their keep are forgotten."""
        meta.abandoned, self._abandoned = self._abandoned, []
        while self._producing:
            tid, (_, since) = next(iter(self._producing.items()))
            if now - since < self._keep_s:
                break
            del self._producing[tid]
        if not self._producers:
            return
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
                producer.block_ids = [list(ids) for ids in new.block_ids]
                progress[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            producer = self._producers.get(req_id)
            if producer is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                producer.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                if not producer.block_ids:
                    producer.block_ids = [[] for _ in new_ids]
                for held, more in zip(producer.block_ids, new_ids, strict=True):
                    held.extend(more)
            progress[req_id] = cached.num_computed_tokens[i]
        for req_id, computed in progress.items():
            producer = self._producers[req_id]
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if producer.saved or producer.abandoned or done < producer.num_prompt_tokens:
                continue
            # The prompt completes in this step: every block of it holds final KV once the forward has run.
            producer.saved = True
            n = self._blocks_for(producer.num_prompt_tokens)
            groups = tuple(tuple(ids[:n]) for ids in producer.block_ids) or ((),)
            grouped = tuple(self._group_only(group, ids, n, producer.num_prompt_tokens)
                            for group, ids in enumerate(groups)) if self._windows else ()
            # Every group's ids stand in the places of an attention group's blocks (a state group's: its own)
            blocks = next((ids for ids, state in zip(grouped, self._states, strict=True) if not state),
                          grouped[0]) if self._states else groups[0]
            # vLLM frees a sliding window's blocks as the window moves, whether or not a push still reads them; a
            # state is rewritten in place by the request's next step
            settle = any(window and (producer.decodes or frees_soon(producer.num_prompt_tokens, window,
                                                                    self._block_size)) for window in self._windows)
            settle = settle or bool(self._states and producer.decodes)
            if producer.preempted:
                meta.saves.append(SaveSpec(req_id=req_id, transfer_id=producer.transfer_id, peer=None,
                                           block_ids=blocks, again=True, groups=grouped))
            else:
                meta.saves.append(SaveSpec(req_id=req_id, transfer_id=producer.transfer_id, peer=producer.peer,
                                           block_ids=blocks, inline=producer.inline,
                                           pulled_by=producer.pulled_by, pullers=producer.pullers,
                                           puller_launch=producer.puller_launch, prompt=producer.prompt,
                                           groups=grouped, settle=settle))

    def _group_only(self, group: int, ids: tuple[int, ...], n: int, num_prompt_tokens: int) -> tuple[int, ...]:
        """What of a group's blocks the decode side reads, in the places of the prompt's `n` blocks."""
        if self._states and self._states[group]:
            return state_only(ids, n)
        return self._window_only(ids, self._windows[group], num_prompt_tokens)

    def _window_only(self, ids: tuple[int, ...], window: int, num_prompt_tokens: int) -> tuple[int, ...]:
        """A sliding-window group's blocks the decode side reads, the others null (not sent): vLLM has freed those
        behind the window as the prompt's chunks were computed (new block ids do not say so), or frees them when
        the request finishes."""
        start = window_start(num_prompt_tokens, window, self._block_size)
        return (NULL_BLOCK,) * min(start, len(ids)) + ids[start:]

    def finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished` for a prefill request: whether vLLM keeps its blocks, and its answer's parameters."""
        req_id = request.request_id
        self._cut.pop(req_id, None)
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
        answer = DecodeParams(producer.transfer_id, producer.answer_tokens or producer.num_prompt_tokens,
                              self._own_address,
                              pull=producer.peer is None, prefill_tp=self._tp_size, prefill_pp=self._pp_size,
                              prompt=producer.prompt, lease_s=self._config.extra.lease_s,
                              prefill_launch=self._config.launch).to_dict()
        return standard_answer(answer, self._engine_id, self._own_address) if producer.standard else answer
