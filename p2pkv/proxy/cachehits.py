"""The prefix-cache hits each instance reports: its vLLM's `vllm:prefix_cache_hits_total` and
`vllm:prefix_cache_queries_total` (prompt tokens found in its cache, and looked up), read from its `/metrics` every
`SCRAPE_S` and kept as the proxy's gauges, beside the tokens the proxy routed there and expected to be cached.

A data-parallel engine's own series are the lines labelled with its rank (`engine="N"`). An instance that does not
answer, answers too much or answers something else keeps its last figures; one that is gone loses them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable

import httpx

from p2pkv.proxy.metrics import ProxyMetrics
from p2pkv.proxy.registry import InstanceState

log = logging.getLogger(__name__)
SCRAPE_S = 15.0
TIMEOUT_S = 5.0  # per instance; a scrape round never takes longer
MAX_BYTES = 8 << 20  # vLLM's /metrics is about 100 KiB; a larger answer is not read further
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
FAILED_LOG_S = 300.0
_ENGINE = re.compile(r'[{,]engine="(\d+)"')


def cache_counts(text: str, dp_rank: int | None = None) -> tuple[float, float] | None:
    """Hits and queries in Prometheus text, summed over label sets (only engine `dp_rank`'s, where given); None if
    the text has neither series."""
    found = False
    hits = queries = 0.0
    for line in text.splitlines():
        name = HITS if line.startswith(HITS) else QUERIES if line.startswith(QUERIES) else ""
        if not name or line[len(name):len(name) + 1] not in ("{", " "):
            continue
        if dp_rank is not None:
            engine = _ENGINE.search(line)
            if engine is None or int(engine.group(1)) != dp_rank:
                continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        found = True
        if name == HITS:
            hits += value
        else:
            queries += value
    return (hits, queries) if found else None


class CacheHits:
    def __init__(self, client: httpx.AsyncClient, metrics: ProxyMetrics, states: Callable[[], list[InstanceState]],
                 interval_s: float = SCRAPE_S) -> None:
        self.client = client
        self.metrics = metrics
        self._states = states
        self.interval_s = interval_s
        self._shown: set[str] = set()
        self._failed_logged = -FAILED_LOG_S

    async def _text(self, state: InstanceState) -> str:
        async with self.client.stream("GET", f"{state.instance.url}/metrics", headers=state.instance.headers({}),
                                      timeout=TIMEOUT_S) as reply:
            reply.raise_for_status()
            body = bytearray()
            async for chunk in reply.aiter_bytes():
                body += chunk
                if len(body) > MAX_BYTES:
                    raise ValueError(f"/metrics answered more than {MAX_BYTES} bytes")
            return body.decode(errors="replace")

    async def _scrape(self, state: InstanceState) -> None:
        name = state.instance.name
        try:
            text = await asyncio.wait_for(self._text(state), TIMEOUT_S)
        except (httpx.HTTPError, ValueError, TimeoutError) as exc:
            now = time.monotonic()
            if now - self._failed_logged >= FAILED_LOG_S:
                self._failed_logged = now
                log.info("prefix-cache figures of %s not read: %r (said once every %.0f s)", name, exc, FAILED_LOG_S)
            return
        counts = cache_counts(text, state.instance.dp_rank)
        if counts is None:
            return
        self.metrics.instance_cache_hits.labels(name).set(counts[0])
        self.metrics.instance_cache_queries.labels(name).set(counts[1])
        self._shown.add(name)

    async def scrape(self) -> None:
        """One round: every instance at once; the figures of instances no longer known removed."""
        states = self._states()
        await asyncio.gather(*(self._scrape(s) for s in states))
        known = {s.instance.name for s in states}
        for name in self._shown - known:
            for gauge in (self.metrics.instance_cache_hits, self.metrics.instance_cache_queries):
                with contextlib.suppress(KeyError):
                    gauge.remove(name)
        self._shown &= known

    async def run(self) -> None:
        while True:
            try:
                await self.scrape()
            except asyncio.CancelledError:
                raise
            except Exception:  # the figures are for operators: a failure costs a round, never the proxy
                log.exception("prefix-cache figures: a round failed; going on")
            await asyncio.sleep(self.interval_s)
