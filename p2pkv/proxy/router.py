"""The proxy's router: prefill with `max_tokens=1`, then decode with the `kv_transfer_params` it returned.

A prefill that fails (refused, 5xx, timeout) is retried on another prefill instance a bounded number of times;
with no prefill left, the request goes to a decode instance alone, which prefills locally. A decode instance that
fails before answering gets the request again as a new transfer (`transfer_retries`); other decode failures come
back as OpenAI-style error JSON, never as an empty 200 (`p2pkv.proxy.upstream`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from typing import Any, NamedTuple

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from p2pkv.discovery import Announcement
from p2pkv.params import Address, DecodeParams, DiscardParams, PrefillParams, ProbeParams
from p2pkv.proxy.admin import bearer_is, instance_headers
from p2pkv.proxy.batch import batch_prompts, merge, merge_streams, trace_headers
from p2pkv.proxy.discard import Discarder, discard_of
from p2pkv.proxy.instances import Instance, ProxyConfig
from p2pkv.proxy.limits import MAX_NESTING, too_deep
from p2pkv.proxy.metrics import ProxyMetrics
from p2pkv.proxy.pairs import Said, news, refusals, why_not_paired
from p2pkv.proxy.passthrough import forward_headers, holder
from p2pkv.proxy.poll import Probed
from p2pkv.proxy.prefill import RESPONSES, Prefiller, prefill_body, whole_prompt_on_decode
from p2pkv.proxy.prefixes import PrefixIndex
from p2pkv.proxy.registry import InstanceState, Policy, Pool, identity_change, static_pool
from p2pkv.proxy.resume import Progress, resumable, with_token_ids
from p2pkv.proxy.tokens import prompt_tokens
from p2pkv.proxy.trace import RequestTrace
from p2pkv.proxy.upstream import Decoder, Relay, RelayResponse, Resume, error_response

log = logging.getLogger(__name__)
_DETOKENIZE_S = 10.0  # for an instance to detokenize a broken-off stream's tokens (`Progress.settle`)
_TOKENIZE_S = 5.0  # for an instance to tokenize a prompt for the prefix policy; later, the request goes by load
_PREFILL_GRACE_S = 0.05  # for a prefill's answer once its decode request, sent alongside, has answered
REFUSAL_LOG_S = 60.0  # refused heartbeats of one kind are logged at most once in this long


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel `task` and wait until it has ended (a decode request's connection closed, say); the caller's own
    cancellation still goes through."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: whatever it was, the request goes on without it


_CLOSING: set[asyncio.Future[None]] = set()  # answers being closed in the background (referenced until done)


def _drop_answer(task: asyncio.Future[Response | None]) -> None:
    """A decode answer nobody will read: its stream's upstream request is closed (in the background: this runs as
    the request is cancelled)."""
    if not task.done() or task.cancelled() or task.exception() is not None:
        return
    answer = task.result()
    relay = answer.body_iterator if isinstance(answer, StreamingResponse) else None
    if isinstance(relay, Relay):
        closing = asyncio.ensure_future(relay.aclose())
        _CLOSING.add(closing)
        closing.add_done_callback(_CLOSING.discard)


def _held_for_pulls(answer: Any) -> str:
    """Why a prefill answer's KV waits for a pull rather than a push ("": it was pushed, or no such answer)."""
    if not isinstance(answer, dict):
        return ""
    if answer.get("send_type") == "GET":
        return "send_type GET"
    return ""


def _settle_later(task: asyncio.Future[Any]) -> None:
    """Let `task` end on its own (bounded by its own timeout), its outcome retrieved and not needed."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


class _Along(NamedTuple):
    """How a request sent to both sides at once went: its answer, or (None) the decode instance to go on with, the
    prefill instance chosen already, and what happened (`p2pkv_proxy_decode_alongside_total`'s outcome)."""

    answer: Response | None
    decode: InstanceState
    chosen: InstanceState | None = None
    outcome: str = "answered"


class KvTarget(NamedTuple):
    """Where a decode instance takes KV, its tensor- and pipeline-parallel sizes (0: not known), and whether it
    takes it by pulls (its `send_type` GET: every prefill instance holds the KV for it)."""

    address: Address | None
    tp: int
    pp: int
    pulls: bool = False


def _size(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


class Router:
    """Per-app state: the HTTP client, the instance pools, the learned KV addresses and the metrics."""

    def __init__(self, config: ProxyConfig, client: httpx.AsyncClient, metrics: ProxyMetrics) -> None:
        self.config = config
        self.client = client
        self.metrics = metrics
        self.prefill = static_pool("prefill", config.prefill, Policy(config.prefill_policy))
        self.decode = static_pool("decode", config.decode, Policy(config.decode_policy))
        self._kv: dict[Instance, KvTarget] = {}  # learned KV address and parallel sizes
        self._decoder = Decoder(client, metrics)
        # (tensor, pipeline) sizes and whether it pulls, as heartbeats gave them, by HTTP address
        self._sizes: dict[Address, tuple[int, int, bool]] = {}
        self._discarder = Discarder(client, metrics, config.connect_timeout_s + 10.0)
        self.index = PrefixIndex()  # fed by `p2pkv.proxy.kvevents` under the prefix policy
        self._prefiller = Prefiller(config, client, metrics, self.prefill, self._discarder, self.index)
        # Cleared while the cluster is paused through this proxy (p2pkv.proxy.control): new requests wait here for
        # the resume, rather than in a paused instance's queue, where their prefill would time out and be retried.
        self.running = asyncio.Event()
        self.running.set()
        # Prefill instances (name, start) whose answers said they hold the KV for pulls, which a decode request sent
        # alongside cannot take (their own send_type GET): their requests are prefilled first.
        self._holds_for_pulls: set[tuple[str, str]] = set()
        self._refused: dict[str, int] = {}  # heartbeats refused, by outcome
        self._refusal_logged: dict[str, float] = {}  # when each outcome was last logged (monotonic)
        for pool in (self.prefill, self.decode):
            metrics.instances.labels(pool.role).set_function(pool.count)
        metrics.unpaired.set_function(lambda: sum(len(self.unpaired(state)) for state in self.decode.states))

    def announce(self, a: Announcement) -> None:
        """A heartbeat arrived: add the instance to its role's pool, or renew it there. Refused: one that would
        change a live instance's role, KV address, engine or start (`identity_change`), and one of a new instance
        beyond `max_instances`."""
        instance = Instance(a.http, a.kv, a.dp_rank)
        now = time.monotonic()
        for pool in self.pools:
            pool.prune(now)  # an expired instance is gone before its restart's first heartbeat is read
        live = [s for pool in self.pools if (s := pool.find(instance)) is not None and s.discovered]
        change = identity_change(live, a.role, instance, a.engine_id, a.launch)
        if change is not None:
            self._refuse("rewrite", f"refused a heartbeat naming live {live[0].role} instance {instance.name}: it "
                         f"would change {change}; heartbeats may change it once it has expired (no heartbeat for "
                         f"{self.config.heartbeat_misses:g} of its intervals)")
            return
        known = {s.instance.name for pool in self.pools for s in pool.states}
        if instance.name not in known and len(known) >= self.config.max_instances:
            self._refuse("over_cap", f"refused the heartbeat of new instance {instance.name}: {len(known)} instances "
                         f"are known, --max-instances {self.config.max_instances}")
            return
        self.metrics.heartbeats.labels("accepted").inc()
        if a.tp_size:
            self._sizes[a.http] = a.tp_size, a.pp_size, a.pulls
            if len(self._sizes) > 2 * self.config.max_instances:  # those of instances long gone go
                alive = {s.instance.http for pool in self.pools for s in pool.states}
                self._sizes = {http: sizes for http, sizes in self._sizes.items() if http in alive}
        expires_at = now + self.config.heartbeat_misses * a.interval_s
        wanted = {"prefill": (self.prefill,), "decode": (self.decode,), "both": self.pools}[a.role]
        heard: list[InstanceState] = []
        for pool in self.pools:
            if pool in wanted:
                if pool.heard_from(instance, time.time(), expires_at):
                    log.info("discovered %s instance %s (KV %s)%s", pool.role, instance.name, a.kv,
                             " from an old-format heartbeat" if a.legacy else "")
                heard += [state] if (state := pool.find(instance)) is not None else []
            elif pool.remove(instance):
                log.info("instance %s is no longer a %s instance", instance.name, pool.role)
        for state in heard:
            state.kv_events = a.kv_events
        self._heard(heard, a.engine_id, max(1, a.tp_size * a.pp_size), a.refused, a.launch)

    def _refuse(self, outcome: str, line: str) -> None:
        """Count a refused heartbeat; log it at most once a minute per kind (a flood must not flood the log)."""
        self.metrics.heartbeats.labels(outcome).inc()
        self._refused[outcome] = self._refused.get(outcome, 0) + 1
        now = time.monotonic()
        if now - self._refusal_logged.get(outcome, -REFUSAL_LOG_S) >= REFUSAL_LOG_S:
            self._refusal_logged[outcome] = now
            log.warning("%s (%d refused so far)", line, self._refused[outcome])

    def probed(self, states: list[InstanceState], probed: Probed) -> None:
        """A static instance without heartbeats answered a probe (`p2pkv.proxy.poll`)."""
        for state in states:
            state.kv_named = probed.named or state.kv_named
            state.kv_events = probed.kv_events
            if probed.sizes[0]:
                self._sizes[state.instance.http] = probed.sizes
        self._heard(states, probed.engine_id, probed.ranks, probed.refused, probed.launch)

    def _heard(self, states: list[InstanceState], engine_id: str, ranks: int,
               said: tuple[Said, ...], launch: str) -> None:
        """What an instance said of its engine, its ranks, its refusals and its start, for each of its states (one
        per pool)."""
        now = time.monotonic()
        refused = refusals(said, now, states[0].kv_refused if states else ())
        for new in news(states[0].kv_refused, refused, now) if states else ():  # once, for a "both" instance too
            log.warning("%s instance %s refused the KV worker at %s: %s; prefill and decode instances of that pair "
                        "are not paired for %.0f s", states[0].role, states[0].instance.name, new.address,
                        new.reason, new.until - now)
        for state in states:
            state.heard(engine_id, ranks, refused, now, launch)

    def unpaired(self, decode: InstanceState) -> dict[Instance, str]:
        """The prefill instances that must not prefill for `decode` now, and why (`p2pkv.proxy.pairs`)."""
        now, side = time.monotonic(), decode.side()
        return {state.instance: why for state in self.prefill.states
                if (why := why_not_paired(side, state.side(), now)) is not None}

    @property
    def pools(self) -> tuple[Pool, Pool]:
        return self.prefill, self.decode

    async def kv_target(self, instance: Instance, headers: dict[str, str]) -> KvTarget:
        """The decode instance's KV address and parallel sizes (0: not known). All come with its heartbeats; what
        they do not say is asked of the instance itself, once."""
        known = self._kv.get(instance)
        if known is not None:
            return known
        heard = self._sizes.get(instance.http)
        if instance.kv is not None and heard is not None:
            return KvTarget(instance.kv, *heard)
        try:
            answer = await self._probe(instance, headers)
        except (httpx.HTTPError, RuntimeError, KeyError, IndexError, ValueError) as exc:
            if instance.kv is None:
                raise
            log.info("decode instance %s did not say its parallel sizes (%r); taken to equal the prefill's",
                     instance.name, exc)
            target = self._kv[instance] = KvTarget(instance.kv, 0, 0)
            return target
        address = instance.kv or Address(answer.get("kv_host") or instance.http.host, answer["kv_port"])
        tp, pp = (_size(answer.get(key)) for key in ("tp_size", "pp_size"))
        target = self._kv[instance] = KvTarget(address, tp, pp, answer.get("pulls") is True)
        log.info("decode instance %s has its KV port at %s (tensor-parallel size %s, pipeline-parallel size %s%s)",
                 instance.name, address, tp or "not said", pp or "not said", "; it pulls" if target.pulls else "")
        return target

    async def static_probe(self, instance: Instance) -> dict[str, Any]:
        """A probe of a static instance for what its heartbeats would say (`p2pkv.proxy.poll`, which bounds it),
        with the key the proxy passes on to instances."""
        return await self._probe(instance, instance_headers(self.config.api_key))

    async def _probe(self, instance: Instance, headers: dict[str, str]) -> dict[str, Any]:
        headers = instance.headers(headers)
        models = await self.client.get(f"{instance.url}/v1/models", headers=headers)
        models.raise_for_status()
        model = models.json()["data"][0]["id"]
        probe = {"model": model, "prompt": [0], "max_tokens": 1, "kv_transfer_params": ProbeParams().to_dict()}
        resp = await self.client.post(f"{instance.url}/v1/completions", json=probe, headers=headers)
        resp.raise_for_status()
        answer = resp.json().get("kv_transfer_params") or {}
        if not isinstance(answer.get("kv_port"), int):
            raise RuntimeError(f"{instance.name} did not report a KV port; is it running the p2pkv connector?")
        return dict(answer)

    def authorized(self, request: Request) -> bool:
        return not self.config.api_key or bearer_is(request, self.config.api_key)

    async def handle(self, request: Request, path: str) -> Response:
        started = time.monotonic()
        try:
            body: Any = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            self.metrics.requests.labels("bad_request").inc()
            return error_response(400, "request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            self.metrics.requests.labels("bad_request").inc()
            return error_response(400, "request body must be a JSON object", "invalid_request_error")
        if too_deep(body):
            self.metrics.requests.labels("bad_request").inc()
            return error_response(400, f"request body nests deeper than {MAX_NESTING} levels",
                                  "invalid_request_error")
        if not self.running.is_set():
            remaining = self.config.request_timeout_s - (time.monotonic() - started)
            try:
                await asyncio.wait_for(self.running.wait(), max(0.0, remaining))
            except TimeoutError:
                self.metrics.requests.labels("paused").inc()
                return error_response(503, "the cluster is paused (POST /resume to the proxy resumes it)")
        headers = forward_headers(request)
        prompts = batch_prompts(body, path)
        if prompts is not None and len(prompts) > self.config.max_prompts:
            self.metrics.requests.labels("bad_request").inc()
            return error_response(400, f"{len(prompts)} prompts in one request: at most {self.config.max_prompts} "
                                  "(--max-prompts)", "invalid_request_error")
        if prompts is not None:
            return await self._batch(body, prompts, path, headers, started)
        return await self._one(body, path, headers, started)

    async def _one(self, body: dict[str, Any], path: str, headers: dict[str, str], started: float) -> Response:
        # A Responses API request that continues a stored response goes where that response is stored.
        decode = await holder(self, body.get("previous_response_id"), headers) if path == RESPONSES else None
        decode = decode or self.decode.pick()
        if decode is None:
            self.metrics.requests.labels("no_instance").inc()
            return error_response(503, "no decode instance is available")
        trace = RequestTrace(uuid.uuid4().hex, decode.instance.name, started)
        try:
            return await self._route(body, path, headers, decode, trace)
        except asyncio.CancelledError:  # the client went away (or the server is stopping)
            trace.finish(499, "client_gone")
            raise

    async def _batch(self, body: dict[str, Any], prompts: list[Any], path: str, headers: dict[str, str],
                     started: float) -> Response:
        """Each prompt of a batch as a request of its own (p2pkv.proxy.batch); the first failure is the answer."""
        answers = await asyncio.gather(*(self._one({**body, "prompt": p}, path, headers, started) for p in prompts))
        relays = [a.body_iterator for a in answers
                  if isinstance(a, StreamingResponse) and isinstance(a.body_iterator, Relay)]
        failed = next((a for a in answers if a.status_code != 200), None)
        if failed is None and body.get("stream") and len(relays) != len(answers):
            failed = error_response(502, "an answer to a prompt of the batch is not a stream")
        if failed is not None:
            for relay in relays:  # the other prompts' streams are not needed
                await relay.aclose()
            return failed
        headers = trace_headers([dict(a.headers) for a in answers])
        if body.get("stream"):
            n = body.get("n")
            samples = n if isinstance(n, int) and n > 0 else 1
            events = merge_streams(relays, samples)
            return RelayResponse(events, [events.aclose, *(r.aclose for r in relays)], headers)
        try:
            merged = merge([bytes(a.body) for a in answers])
        except (ValueError, TypeError, AttributeError, RecursionError) as exc:
            return error_response(502, f"an answer to a prompt of the batch is not a completion: {exc!r}")
        return Response(merged, media_type="application/json", headers=headers)

    async def _target(self, decode: InstanceState, headers: dict[str, str]) -> KvTarget:
        try:
            return await self.kv_target(decode.instance, headers)
        except (httpx.HTTPError, RuntimeError, KeyError, IndexError, ValueError) as exc:
            # Without the decode side's KV address the prefill side cannot push; it holds the KV for a pull.
            log.warning("decode instance %s did not report its KV address (%s); using GET", decode.instance.name, exc)
            return KvTarget(None, 0, 0)

    async def _route(self, body: dict[str, Any], path: str, headers: dict[str, str], decode: InstanceState,
                     trace: RequestTrace, resumes: int | None = None) -> Response:
        """Prefill, then decode. A decode instance that fails before any of its answer went to the client (a
        5xx, which is how vLLM ends a request whose KV could not be loaded under kv_load_failure_policy=fail; a
        broken connection; an empty answer) gets the request again as a new transfer, up to `transfer_retries`
        times: prefilled on a prefill instance not tried yet (or, with none left, by the decode instance alone)
        and decoded on another decode instance where there is one. A completion stream that breaks off after its
        answer began is resumed from the tokens it streamed, up to `resumes` times (`p2pkv.proxy.resume`)."""
        resumes = self.config.stream_resumes if resumes is None else resumes
        tried: set[Instance] = set()  # prefill instances, over every attempt
        failed: set[Instance] = set()  # decode instances that failed this request
        if whole_prompt_on_decode(body, path):
            # A prefill elsewhere would be wasted: the decode instance computes the prompt whatever it is sent.
            log.debug("transfer %s: prompt logprobs asked for; decode instance %s computes the prompt",
                      trace.transfer_id, decode.instance.name)
            self.metrics.decode_only.inc()
            to_decode = {k: v for k, v in body.items() if k != "kv_transfer_params"}
            answer = await self._decoder.answer(decode, f"{decode.instance.url}{path}", to_decode,
                                                decode.instance.headers(headers), trace)
            assert answer is not None  # the last attempt always answers
            return answer
        tokens = await self._prompt_tokens(body, path, headers, decode)
        if self._decode_only(body, tokens, decode, trace):
            to_decode = {k: v for k, v in body.items() if k != "kv_transfer_params"}
            answer = await self._decoder.answer(decode, f"{decode.instance.url}{path}", to_decode,
                                                decode.instance.headers(headers), trace)
            assert answer is not None  # the last attempt always answers
            return answer
        if body.get("cache_salt"):
            tokens = None  # its blocks match no other prompt's: the prefill instance is chosen by load
        chosen = None  # the prefill instance chosen for the first attempt, where that is done already
        attempts, spent = self.config.transfer_retries + 1, 0  # spent: prefill attempts the first one has used
        if self.config.decode_alongside:
            along = await self._alongside(body, path, headers, decode, trace, tokens, tried, failed, resumes)
            if along.answer is not None:
                return along.answer
            decode, chosen = along.decode, along.chosen
            # A failure there used a prefill attempt, or (at least one attempt left) a transfer's.
            spent = int(along.outcome == "prefill_failed")
            attempts = max(1, attempts - int(along.outcome == "decode_failed"))
        for attempt in range(attempts):
            target = await self._target(decode, headers)
            params = PrefillParams(trace.transfer_id, target.address, pull=target.pulls, decode_tp=target.tp,
                                   decode_pp=target.pp, decode_launch=decode.launch)
            unpaired = self.unpaired(decode)
            if unpaired:
                self.metrics.passed_over.inc(len(unpaired))
            try:
                outcome = await self._prefiller.prefill(prefill_body(body, params, path), path, headers, trace, tried,
                                                        frozenset(unpaired), tokens, chosen if attempt == 0 else None,
                                                        spent if attempt == 0 else 0)
            except asyncio.CancelledError:  # the client went away; the prefill may have pushed already
                if target.address is not None:
                    self._discarder.discard(decode.instance, DiscardParams(trace.transfer_id), body, headers)
                raise
            if isinstance(outcome, Response):
                self.metrics.requests.labels("prefill_rejected").inc()
                trace.finish(outcome.status_code, "prefill_rejected")
                outcome.headers.update(trace.headers())
                return outcome
            to_decode = dict(body)
            if outcome is None:
                self.metrics.fallbacks.inc()
                if unpaired and not tried:  # each pair's refusal was logged once, when a heartbeat first said it
                    log.debug("transfer %s: decode instance %s prefills locally: no prefill instance whose KV it can "
                              "take (%s)", trace.transfer_id, decode.instance.name, "; ".join(unpaired.values()))
                else:
                    log.warning("transfer %s: no prefill instance succeeded; decode instance %s prefills locally",
                                trace.transfer_id, decode.instance.name)
                to_decode.pop("kv_transfer_params", None)
            else:
                to_decode["kv_transfer_params"] = outcome
            last = attempt == attempts - 1
            resume = self._resume_of(body, path, headers, decode, resumes)
            if resume is not None:
                to_decode = with_token_ids(to_decode)
            try:
                answer = await self._decoder.answer(decode, f"{decode.instance.url}{path}", to_decode,
                                                    decode.instance.headers(headers), trace, last, resume)
            except asyncio.CancelledError:  # the client went away, perhaps before the decode instance had the request
                if outcome is not None:
                    self._discarder.discard(decode.instance, discard_of(outcome, trace.transfer_id), body, headers)
                raise
            if answer is not None:
                return answer
            failed.add(decode.instance)
            decode = self.decode.pick(frozenset(failed)) or self.decode.pick() or decode
            self.metrics.reroutes.inc()
            transfer_id = uuid.uuid4().hex
            log.warning("transfer %s: the decode instance failed before answering; the request goes again as "
                        "transfer %s (decode instance %s)", trace.transfer_id, transfer_id, decode.instance.name)
            trace.reroute(transfer_id, decode.instance.name)
        raise AssertionError("the last attempt always answers")

    def _resume_of(self, body: dict[str, Any], path: str, headers: dict[str, str], decode: InstanceState,
                   resumes: int) -> Resume | None:
        """How a stream that breaks off after its answer began goes on (`p2pkv.proxy.resume`); None where it cannot."""
        if resumes <= 0 or not resumable(body, path):
            return None
        return Resume(Progress(body, path),
                      functools.partial(self._resume, headers=headers, failed=decode.instance, resumes=resumes - 1),
                      functools.partial(self._detokenize, model=body.get("model"), headers=headers,
                                        failed=decode.instance))

    async def _alongside(self, body: dict[str, Any], path: str, headers: dict[str, str], decode: InstanceState,
                         trace: RequestTrace, tokens: list[int] | None, tried: set[Instance], failed: set[Instance],
                         resumes: int) -> _Along:
        """Prefill and decode at once: the decode request goes with the prefill request, naming the transfer and the
        prefill instance, so that its intake and block allocation overlap the prefill; it loads the push once the
        push says the prompt it was computed for, and it is this request's (`DecodeParams.alongside_s`). The answer,
        or None and the decode instance for the request to go the other way (prefill, then decode) as a new
        transfer: the pair's KV does not go as a push (`unsuited`; then also the prefill instance chosen, for the first
        attempt), or one side failed and the other was cancelled."""
        target = await self._target(decode, headers)
        unpaired = self.unpaired(decode)
        state = None
        if target.address is not None and not target.pulls:
            state = self._prefiller.choose(tried, frozenset(unpaired), tokens)
        sizes = self._sizes.get(state.instance.http) if state is not None else None
        if (state is None or sizes is None or state.instance.kv is None or target.address is None
                or (sizes[0], sizes[1] or 1) != (target.tp, target.pp or 1)
                or (state.instance.name, state.launch) in self._holds_for_pulls):
            # Pulled KV says nothing of its prompt, and a push needs both KV addresses and the same sizes on both
            # sides (known from heartbeats or probes): prefill first, then decode.
            self.metrics.alongside.labels("unsuited").inc()
            return _Along(None, decode, state, "unsuited")
        prefill_tp, prefill_pp = sizes[0], sizes[1]
        if unpaired:
            self.metrics.passed_over.inc(len(unpaired))
        tid = trace.transfer_id
        to_prefill = prefill_body(body, PrefillParams(tid, target.address, decode_tp=target.tp, decode_pp=target.pp,
                                                      decode_launch=decode.launch), path)
        along = DecodeParams(tid, 0, state.instance.kv, prefill_tp=prefill_tp, prefill_pp=prefill_pp,
                             prefill_launch=state.launch, alongside_s=min(self.config.prefill_timeout_s, 3600.0))
        to_decode = {**body, "kv_transfer_params": along.to_dict()}
        resume = self._resume_of(body, path, headers, decode, resumes)
        if resume is not None:
            to_decode = with_token_ids(to_decode)
        trace.prefill = state.instance.name  # its time comes with its answer, which may come after the decode's
        decoding = asyncio.ensure_future(self._decoder.answer(decode, f"{decode.instance.url}{path}", to_decode,
                                                              decode.instance.headers(headers), trace, False, resume))
        prefilling = asyncio.ensure_future(self._prefiller.prefill_on(state, to_prefill, path, headers, trace, tried,
                                                                      tokens))
        try:
            done, _ = await asyncio.wait({decoding, prefilling}, return_when=asyncio.FIRST_COMPLETED)
            if decoding in done and decoding.result() is not None:
                # Answered: the KV landed (the prefill's answer is on its way, as slow as its instance's output path
                # may be), or the decode instance held the prompt. The prefill's answer is waited for a moment, for
                # the trace (a failure there: the decode instance computed the prompt); then it ends on its own.
                await asyncio.wait({prefilling}, timeout=_PREFILL_GRACE_S)
                if prefilling.done() and (prefilling.cancelled() or prefilling.exception()
                                          or not isinstance(prefilling.result(), dict)):
                    trace.prefill = ""
                _settle_later(prefilling)
                answer = decoding.result()
                assert answer is not None
                answer.headers.update(trace.headers())  # made before the prefill answered
                self.metrics.alongside.labels("answered").inc()
                return _Along(answer, decode)
            if decoding in done:  # failed before answering: the prefill is cancelled, and the KV goes nowhere
                await _cancel(prefilling)
                outcome = "decode_failed"
            else:
                prefilled = prefilling.result()
                held = _held_for_pulls(prefilled)
                if held:  # no push will come: the decode request is sent again, prefilled first
                    if len(self._holds_for_pulls) >= 4 * self.config.max_instances:  # of instances long gone
                        self._holds_for_pulls.clear()
                    self._holds_for_pulls.add((state.instance.name, state.launch))
                    log.warning("transfer %s: prefill instance %s holds its KV for pulls (%s), which a decode request "
                                "sent alongside cannot take: its requests are prefilled first from now on", tid,
                                state.instance.name, held)
                    await _cancel(decoding)
                    self._discarder.discard(decode.instance, DiscardParams(tid), body, headers)
                    self._discarder.discard(state.instance, DiscardParams(tid), body, headers)
                    tried.discard(state.instance)  # it did not fail: it prefills the new transfer
                    outcome = "unsuited"
                elif isinstance(prefilled, dict):
                    answer = await decoding
                    if answer is not None:
                        self.metrics.alongside.labels("answered").inc()
                        return _Along(answer, decode)
                    outcome = "decode_failed"
                else:  # the decode request is cancelled: vLLM aborts it, and what was pushed for it is dropped
                    await _cancel(decoding)
                    self._discarder.discard(decode.instance, DiscardParams(tid), body, headers)
                    if isinstance(prefilled, Response):  # rejected (4xx): the client's answer
                        self.metrics.alongside.labels("answered").inc()
                        self.metrics.requests.labels("prefill_rejected").inc()
                        trace.finish(prefilled.status_code, "prefill_rejected")
                        prefilled.headers.update(trace.headers())
                        return _Along(prefilled, decode)
                    outcome = "prefill_failed"
        except BaseException:  # the client went away (or a side failed as no request should): neither goes on
            for task in (decoding, prefilling):
                task.cancel()
            _drop_answer(decoding)
            self._discarder.discard(decode.instance, DiscardParams(tid), body, headers)
            raise
        self.metrics.alongside.labels(outcome).inc()
        if outcome == "decode_failed":
            failed.add(decode.instance)
            decode = self.decode.pick(frozenset(failed)) or self.decode.pick() or decode
            self.metrics.reroutes.inc()
        new_tid = uuid.uuid4().hex
        if outcome != "unsuited":
            log.warning("transfer %s: the %s instance failed while the decode request went alongside the prefill; "
                        "the request goes again as transfer %s, prefilled first (decode instance %s)", tid,
                        "decode" if outcome == "decode_failed" else "prefill", new_tid, decode.instance.name)
        trace.reroute(new_tid, decode.instance.name)
        return _Along(None, decode, state if outcome == "unsuited" else None, outcome)

    async def _prompt_tokens(self, body: dict[str, Any], path: str, headers: dict[str, str],
                             decode: InstanceState) -> list[int] | None:
        """The prompt's tokens where the proxy will use them (the prefix policy, with some prefill instance's blocks
        known; `decode_only_below`), tokenized by the decode instance's API server; None otherwise (by load then)."""
        # With one prefill instance there is no choice to make; a salted prompt's blocks match no one else's.
        prefix = (self.prefill.policy is Policy.PREFIX and len(self.prefill.states) > 1
                  and not body.get("cache_salt"))
        indexed = prefix and self.index.knows(s.instance.name for s in self.prefill.states)
        if prefix and not indexed:
            self.metrics.prefix_choices.labels("no_events").inc()
        if not indexed and not self.config.decode_only_below:
            return None
        tokens = await prompt_tokens(self.client, decode.instance, body, path, headers,
                                     self.config.connect_timeout_s + _TOKENIZE_S)
        if indexed:
            self.metrics.prefix_choices.labels("no_tokens" if tokens is None else "indexed").inc()
        return tokens

    def _decode_only(self, body: dict[str, Any], tokens: list[int] | None, decode: InstanceState,
                     trace: RequestTrace) -> bool:
        """Whether the decode instance computes the prompt sooner alone: fewer than `decode_only_below` tokens left
        to compute there (noted in the trace and counted)."""
        below = self.config.decode_only_below
        if tokens is None or not below:
            return False
        held = 0 if body.get("cache_salt") else min(len(tokens) - 1, self.index.hits(
            [decode.instance.name], tokens)[decode.instance.name])
        left = len(tokens) - max(0, held)
        if left >= below:
            return False
        self.metrics.decode_only_cheaper.labels("cached" if held > 0 else "short").inc()
        trace.route = (f"decode-only: {left} of {len(tokens)} prompt tokens to compute there, under "
                       f"--decode-only-below {below}")
        return True

    async def _detokenize(self, tokens: list[int], model: Any, headers: dict[str, str], failed: Instance
                          ) -> str | None:
        """`tokens` as the model's tokenizer decodes them (vLLM's `/detokenize`), asked of an instance other than
        `failed`; None if none answered."""
        state = self.decode.pick(frozenset({failed})) or self.prefill.pick()
        if state is None:
            return None
        body = {"tokens": tokens} if model is None else {"model": model, "tokens": tokens}
        try:
            answer = await self.client.post(f"{state.instance.url}/detokenize", json=body,
                                            headers=state.instance.headers(headers),
                                            timeout=self.config.connect_timeout_s + _DETOKENIZE_S)
        except httpx.HTTPError as exc:
            log.warning("%s did not detokenize a stream's last tokens: %r", state.instance.name, exc)
            return None
        try:
            text = answer.json().get("prompt") if answer.status_code == 200 else None
        except (ValueError, AttributeError):
            text = None
        if not isinstance(text, str):
            log.warning("%s did not detokenize a stream's last tokens: %d", state.instance.name, answer.status_code)
            return None
        return text

    async def _resume(self, path: str, body: dict[str, Any], headers: dict[str, str], failed: Instance,
                      resumes: int) -> Relay | None:
        """The rest of a stream that broke off: `body` (its prompt's tokens and those it streamed) prefilled and
        decoded as a new transfer, on another decode instance where there is one; None if that did not give a
        stream (counted as its outcome)."""
        decode = self.decode.pick(frozenset({failed})) or self.decode.pick()
        if decode is None:
            self.metrics.requests.labels("no_instance").inc()
            return None
        self.metrics.stream_resumes.inc()
        trace = RequestTrace(uuid.uuid4().hex, decode.instance.name, time.monotonic())
        log.warning("stream resumed from token %d of its prompt and output as transfer %s (decode instance %s)",
                    len(body["prompt"]), trace.transfer_id, decode.instance.name)
        answer = await self._route(body, path, headers, decode, trace, resumes)
        rest = answer.body_iterator if isinstance(answer, StreamingResponse) else None
        if isinstance(rest, Relay):
            return rest
        log.warning("transfer %s: the resumed stream was answered %d", trace.transfer_id, answer.status_code)
        return None
