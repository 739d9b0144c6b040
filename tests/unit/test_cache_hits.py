"""The prefix-cache hits each instance reports, read by the proxy from its `/metrics` and shown as its own gauges."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack

import httpx
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from p2pkv.bench.cluster import free_port
from p2pkv.proxy.cachehits import MAX_BYTES, CacheHits, cache_counts
from p2pkv.proxy.instances import Instance
from p2pkv.proxy.metrics import ProxyMetrics
from p2pkv.proxy.registry import InstanceState
from tests.helpers.servers import serve
from tests.helpers.stubs import stub_decode, stub_prefill
from tests.helpers.unit import proxy_with, wait_for

# As vLLM's /metrics has them: one line per engine, a `_created` line beside each counter.
TEXT = """# HELP vllm:prefix_cache_queries_total Prefix cache queries
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 300.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 128.0
vllm:prefix_cache_hits_totally_else{engine="0"} 5.0
vllm:num_requests_running{engine="0",model_name="m"} 2.0
"""


def test_hits_and_queries_are_summed_over_engines_or_taken_from_one() -> None:
    assert cache_counts(TEXT) == (768.0, 1300.0)
    assert cache_counts(TEXT, dp_rank=1) == (128.0, 300.0)
    assert cache_counts(TEXT, dp_rank=2) is None
    assert cache_counts("vllm:num_requests_running 1\n") is None
    assert cache_counts("vllm:prefix_cache_hits_total{engine=\"0\"} nan-ish\n") is None


def metrics_app(text: str, status: int = 200) -> FastAPI:
    app = FastAPI()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(text, status_code=status)

    return app


def gauges(metrics: ProxyMetrics) -> dict[str, tuple[float, float]]:
    hits = {s.labels["instance"]: s.value for m in metrics.instance_cache_hits.collect() for s in m.samples}
    queries = {s.labels["instance"]: s.value for m in metrics.instance_cache_queries.collect() for s in m.samples}
    return {name: (hits[name], queries[name]) for name in hits}


def test_each_instance_shows_its_own_figures_and_a_bad_answer_or_a_gone_instance_costs_nothing_else() -> None:
    with ExitStack() as stack:
        dp = stack.enter_context(serve(metrics_app(TEXT)))
        huge = stack.enter_context(serve(metrics_app("x" * (MAX_BYTES + 1))))
        missing = stack.enter_context(serve(metrics_app("not found", 404)))
        states = [InstanceState(Instance.parse(f"{dp}#0"), "prefill"),
                  InstanceState(Instance.parse(f"{dp}#1"), "prefill"),
                  InstanceState(Instance.parse(huge), "prefill"),
                  InstanceState(Instance.parse(missing), "decode"),
                  InstanceState(Instance.parse(f"127.0.0.1:{free_port()}"), "decode")]  # nothing listens
        metrics = ProxyMetrics()

        async def rounds() -> None:
            async with httpx.AsyncClient() as client:
                hits = CacheHits(client, metrics, lambda: states)
                await hits.scrape()
                assert gauges(metrics) == {f"{dp}#0": (640.0, 1000.0), f"{dp}#1": (128.0, 300.0)}
                del states[1]
                await hits.scrape()
                assert gauges(metrics) == {f"{dp}#0": (640.0, 1000.0)}

        asyncio.run(asyncio.wait_for(rounds(), 30))


def test_the_proxy_serves_its_instances_figures_from_its_start() -> None:
    seen: list[dict[str, object]] = []
    prefill_app, decode_app = stub_prefill(seen), stub_decode(seen)
    for app, (hits, queries) in ((prefill_app, (512, 600)), (decode_app, (0, 40))):
        text = (f'vllm:prefix_cache_hits_total{{engine="0"}} {hits}\n'
                f'vllm:prefix_cache_queries_total{{engine="0"}} {queries}\n')

        @app.get("/metrics")
        async def metrics(text: str = text) -> PlainTextResponse:
            return PlainTextResponse(text)

    with serve(prefill_app) as prefill, serve(decode_app) as decode, \
            serve(proxy_with([prefill], decode)) as proxy:
        def figures() -> dict[str, str]:
            lines = httpx.get(f"http://{proxy}/metrics", timeout=10).text.splitlines()
            return {line.split(" ")[0]: line.split(" ")[1] for line in lines
                    if line.startswith("p2pkv_proxy_instance_prefix_cache")}

        wait_for(lambda: len(figures()) == 4)
        assert figures() == {
            f'p2pkv_proxy_instance_prefix_cache_hits{{instance="{prefill}"}}': "512.0",
            f'p2pkv_proxy_instance_prefix_cache_queries{{instance="{prefill}"}}': "600.0",
            f'p2pkv_proxy_instance_prefix_cache_hits{{instance="{decode}"}}': "0.0",
            f'p2pkv_proxy_instance_prefix_cache_queries{{instance="{decode}"}}': "40.0"}
