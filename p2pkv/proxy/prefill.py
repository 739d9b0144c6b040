"""The prefill request: the client's request cut to one token, sent to a prefill instance, retried on another
a bounded number of times; its answer's `kv_transfer_params` say where the KV is."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx
from fastapi.responses import Response

from p2pkv.params import DiscardParams, PrefillParams
from p2pkv.proxy.discard import Discarder
from p2pkv.proxy.instances import Instance, ProxyConfig
from p2pkv.proxy.metrics import ProxyMetrics
from p2pkv.proxy.prefixes import PrefixIndex
from p2pkv.proxy.registry import InstanceState, Pool
from p2pkv.proxy.trace import RequestTrace

log = logging.getLogger(__name__)
_DROP_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")
RESPONSES = "/v1/responses"  # OpenAI's Responses API
MESSAGES = "/v1/messages"  # Anthropic's Messages API, which vLLM serves too


def prefill_body(body: dict[str, Any], params: PrefillParams, path: str = "/v1/completions") -> dict[str, Any]:
    """The prefill request: one token, not streamed, one sample, carrying the transfer's params. The Responses API
    caps the answer with `max_output_tokens`, and its prefill answer is not stored (nobody will continue it)."""
    pre = dict(body)
    pre.update(stream=False, kv_transfer_params=params.to_dict())
    if path == RESPONSES:
        pre.update(max_output_tokens=1, store=False, background=False)
    else:
        pre["max_tokens"] = 1
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    if "n" in pre:
        pre["n"] = 1  # one pass computes the prompt's KV; the decode instance samples `n` times from it
    for key in _DROP_FOR_PREFILL:
        pre.pop(key, None)
    return pre


def whole_prompt_on_decode(body: dict[str, Any], path: str) -> bool:
    """Whether the decode instance gets the request alone. vLLM computes the prompt itself there for prompt
    logprobs (asked for directly, or by `echo` with logprobs, as vLLM derives them), reading no cached or
    transferred KV for them. A Responses API request that continues a stored response (`previous_response_id`)
    or is to be stored for polling (`background`) needs the instance's response store, which a prefill instance
    does not share."""
    if path == RESPONSES:
        return bool(body.get("previous_response_id") or body.get("background"))
    if body.get("prompt_logprobs") is not None:
        return True
    if not body.get("echo"):
        return False
    return body.get("top_logprobs", 0) is not None if path.endswith("chat/completions") else (
        body.get("logprobs") is not None)


@contextmanager
def _pending(state: InstanceState, tokens: int) -> Iterator[None]:
    """`tokens` count as queued on `state` (added before) until the prefill there ends."""
    try:
        yield
    finally:
        state.pending_tokens -= tokens


class Prefiller:
    def _not_there(self, state: InstanceState, tokens: Sequence[int] | None) -> None:
        """The prompt was not prefilled on `state` after all: it is no longer expected there."""
        if tokens is not None:
            self.index.unexpect(state.instance.name, tokens)

    def __init__(self, config: ProxyConfig, client: httpx.AsyncClient, metrics: ProxyMetrics, pool: Pool,
                 discarder: Discarder, index: PrefixIndex) -> None:
        self.index = index
        self.config = config
        self.client = client
        self.metrics = metrics
        self.pool = pool
        self.discarder = discarder

    async def prefill(self, body: dict[str, Any], path: str, headers: dict[str, str], trace: RequestTrace,
                      tried: set[Instance], skip: frozenset[Instance] = frozenset(),
                      tokens: Sequence[int] | None = None, first: InstanceState | None = None, spent: int = 0
                      ) -> dict[str, Any] | Response | None:
        """The prefill's kv_transfer_params; a Response to pass on for a request the instance rejected (4xx);
        None when every attempt failed, or every instance was `tried` (to which this adds the ones it tries) or is
        to be skipped. `tokens`: the prompt's, for the prefix policy (`p2pkv.proxy.prefixes`). `first`: the
        instance already chosen for the first attempt; `spent`: attempts made already (their failures)."""
        for attempt in range(spent, self.config.prefill_retries + 1):
            state = first if attempt == spent and first is not None else self.choose(tried, skip, tokens)
            if state is None:
                return None
            if attempt:
                self.metrics.retries.inc()
            outcome = await self.prefill_on(state, body, path, headers, trace, tried, tokens)
            if outcome is not None:
                return outcome
        return None

    def choose(self, tried: set[Instance], skip: frozenset[Instance] = frozenset(),
               tokens: Sequence[int] | None = None) -> InstanceState | None:
        """The prefill instance for a prompt: by the policy, among those not `tried` nor to be skipped."""
        hits: dict[str, int] = {}
        if tokens is not None:
            hits = self.index.hits([s.instance.name for s in self.pool.states], tokens)
        cost = spare = None
        if tokens is not None:
            prompt = tokens

            # Uncached tokens count twice: once for this prompt's wait, once for the capacity (and the cached
            # prefixes it evicts) they take from the requests after it. Queued tokens count once.
            def cost(s: InstanceState) -> int:
                return s.pending_tokens + 2 * (len(prompt) - hits.get(s.instance.name, 0))

            def spare(s: InstanceState) -> int:
                return self.index.prefixes(s.instance.name)

        # A prompt no instance holds any of: those within half of it of the cheapest are as good, and of those
        # the one holding the fewest prefixes takes it, so that new prefixes spread over the caches rather than
        # evict each other. Otherwise the cheapest.
        unheld = tokens is not None and not any(hits.values())
        slack = len(tokens) // 2 if tokens is not None and unheld else 0
        return self.pool.pick(frozenset(tried) | skip, cost=cost, slack=slack, spare=spare if unheld else None)

    async def prefill_on(self, state: InstanceState, body: dict[str, Any], path: str, headers: dict[str, str],
                         trace: RequestTrace, tried: set[Instance], tokens: Sequence[int] | None = None
                         ) -> dict[str, Any] | Response | None:
        """One attempt on `state` (added to `tried`): its kv_transfer_params, a Response to pass on (4xx), or None
        when it failed."""
        new = 0
        if tokens is not None:
            cached = self.index.hits([state.instance.name], tokens).get(state.instance.name, 0)
            new = len(tokens) - cached
            self.metrics.prefill_tokens.labels(state.instance.name).inc(len(tokens))
            self.metrics.expected_cached.labels(state.instance.name).inc(cached)
            self.index.expect(state.instance.name, tokens)
        tried.add(state.instance)
        trace.prefill_tries += 1
        started = time.monotonic()
        state.pending_tokens += new
        with self.pool.busy(state), _pending(state, new):
            try:
                answer = await self.client.post(f"{state.instance.url}{path}", json=body,
                                                headers=state.instance.headers(headers),
                                                timeout=self.config.prefill_timeout_s)
            except asyncio.CancelledError:
                # The client went away. vLLM aborts the prefill if it is still running; if it had finished, its
                # answer goes to nobody, and blocks it holds for a pull would wait for their lease: the prefill
                # instance is told to stop holding them.
                self.discarder.discard(state.instance, DiscardParams(trace.transfer_id), body, headers)
                self._not_there(state, tokens)  # its events say whether it computed the prompt after all
                raise
            except httpx.HTTPError as exc:
                state.failures += 1
                log.warning("prefill instance %s failed: %r", state.instance.name, exc)
                if isinstance(exc, httpx.ConnectError):
                    state.refused()
                self._not_there(state, tokens)
                return None
        self.metrics.prefill_seconds.observe(time.monotonic() - started)
        if 400 <= answer.status_code < 500:
            self._not_there(state, tokens)
            return Response(answer.content, status_code=answer.status_code, media_type="application/json")
        params = answer.json().get("kv_transfer_params") if answer.status_code == 200 else None
        if isinstance(params, dict):
            trace.prefilled(state.instance.name, started)
            return params
        self._not_there(state, tokens)
        state.failures += 1
        log.warning("prefill instance %s answered %d without kv_transfer_params", state.instance.name,
                    answer.status_code)
        return None
