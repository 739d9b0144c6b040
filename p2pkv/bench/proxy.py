"""`p2pkv bench proxy`: the proxy against stub backends on this host, next to calling the backends directly in
the same run. Latency is measured one request at a time; throughput at a fixed concurrency. Every path is called
with the client the proxy calls its instances with (`p2pkv.proxy.transport.upstream_client`)."""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from p2pkv.bench.cluster import Cluster, Process, free_ports
from p2pkv.proxy.transport import upstream_client

BODY = {"model": "stub", "prompt": "hello", "max_tokens": 4}


@dataclass(frozen=True)
class Figures:
    p50_ms: float
    p99_ms: float
    per_second: float


async def _measure(call: Callable[[httpx.AsyncClient], Awaitable[None]], requests: int,
                   concurrency: int) -> Figures:
    # The proxy's own client: the two calls made by hand cost the caller what they cost the proxy.
    async with upstream_client(30, 30, max_connections=concurrency * 2) as client:
        for _ in range(50):
            await call(client)
        latencies = []
        for _ in range(requests):
            started = time.perf_counter()
            await call(client)
            latencies.append((time.perf_counter() - started) * 1000)
        sem = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with sem:
                await call(client)

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(requests)))
        rate = requests / (time.perf_counter() - started)
    latencies.sort()
    return Figures(statistics.median(latencies), latencies[int(len(latencies) * 0.99) - 1], rate)


def run(requests: int, concurrency: int) -> dict[str, Figures]:
    log_dir = Path(tempfile.mkdtemp(prefix="p2pkv-bench-proxy-"))
    cluster = Cluster(model="stub", log_dir=log_dir)
    p_port, d_port, proxy_port = free_ports(3)
    for name, port in (("prefill-stub", p_port), ("decode-stub", d_port)):
        cluster.processes.append(Process(name, [sys.executable, "-m", "p2pkv.bench.stub", str(port)],
                                         log_dir / f"{name}.log", cluster.env(), f"http://127.0.0.1:{port}/health"))
    cluster.add_proxy(proxy_port, [f"127.0.0.1:{p_port}"], [f"127.0.0.1:{d_port}@127.0.0.1:1"])
    p_url, d_url, proxy_url = (f"http://127.0.0.1:{port}/v1/completions" for port in (p_port, d_port, proxy_port))

    async def direct(client: httpx.AsyncClient) -> None:
        (await client.post(d_url, json=BODY)).raise_for_status()

    async def two_steps(client: httpx.AsyncClient) -> None:
        pre = {**BODY, "max_tokens": 1, "kv_transfer_params": {"p2pkv": 1, "transfer_id": "t",
                                                                "do_remote_decode": True}}
        params = (await client.post(p_url, json=pre)).json()["kv_transfer_params"]
        (await client.post(d_url, json={**BODY, "kv_transfer_params": params})).raise_for_status()

    async def proxied(client: httpx.AsyncClient) -> None:
        (await client.post(proxy_url, json=BODY)).raise_for_status()

    try:
        cluster.start(timeout_s=60)
        return {name: asyncio.run(_measure(call, requests, concurrency))
                for name, call in (("backend directly", direct), ("prefill then decode, by hand", two_steps),
                                   ("through the proxy", proxied))}
    finally:
        cluster.stop()


def main(requests: int, concurrency: int) -> int:
    results = run(requests, concurrency)
    print(f"{'path':<32}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}   ({requests} requests, concurrency {concurrency})")
    for name, f in results.items():
        print(f"{name:<32}{f.p50_ms:>9.2f}{f.p99_ms:>9.2f}{f.per_second:>9.0f}")
    by_hand, proxy = results["prefill then decode, by hand"], results["through the proxy"]
    print(f"added p50 latency of the proxy over the same two calls by hand: {proxy.p50_ms - by_hand.p50_ms:.2f} ms")
    print(f"added p99 latency: {proxy.p99_ms - by_hand.p99_ms:.2f} ms")
    print(f"throughput through the proxy / the two calls by hand: {proxy.per_second / by_hand.per_second:.2f}")
    print(f"throughput through the proxy / one backend directly: "
          f"{proxy.per_second / results['backend directly'].per_second:.2f}")
    return 0
