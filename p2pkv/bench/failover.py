"""`p2pkv bench failover`: a local 1P2D cluster serving greedy streams through the proxy; once every stream has
streamed a third of its tokens, one decode instance is killed (SIGKILL, its whole process group). Each stream must
still end whole (every token, `[DONE]`, no error event), with the text the same request gets when sent again
afterwards; the proxy's resumes (`p2pkv_proxy_stream_resumes_total`) and reroutes are reported. With
`--stream-resumes 0` the proxy's streams on the killed instance end with an error event instead."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from p2pkv.bench.cluster import Cluster, InstanceSpec, free_ports
from p2pkv.models import resolve_model


@dataclass
class Stream:
    text: str = ""
    tokens: int = 0  # the stream's choice events: one token each as vLLM streams a request alone, several with
    # `--stream-interval`
    error: str | None = None
    done: bool = False  # `[DONE]` came

    def whole(self) -> bool:
        return self.error is None and self.done and self.tokens > 0


@dataclass
class FailoverResult:
    streams: list[Stream] = field(default_factory=list)
    again: list[str] = field(default_factory=list)  # each request's text, sent again once the streams ended
    killed_at_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)

    def ok(self) -> bool:
        return (bool(self.streams) and all(s.whole() for s in self.streams)
                and [s.text for s in self.streams] == self.again)


def body(i: int, model: str, max_tokens: int, stream: bool = True, interval: int = 1) -> dict[str, Any]:
    """Request `i`; `interval`: tokens in each streamed event after the first (vLLM's `stream_interval`)."""
    request = {"model": model, "prompt": f"[{i}] " + "lorem ipsum dolor sit amet " * 10, "max_tokens": max_tokens,
               "temperature": 0, "ignore_eos": True, "stream": stream}
    return {**request, "stream_interval": interval} if stream and interval > 1 else request


async def _read(client: httpx.AsyncClient, proxy: str, request: dict[str, Any], out: Stream) -> None:
    try:
        async with client.stream("POST", f"{proxy}/v1/completions", json=request) as resp:
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    out.done = True
                elif line.startswith("data: "):
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        out.error = str(event["error"].get("message", event["error"]))[:200]
                    for choice in event.get("choices") or []:
                        out.text += choice.get("text") or ""
                        out.tokens += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = repr(exc)[:200]


async def drive(proxy: str, model: str, streams: int, max_tokens: int, kill: Callable[[], None],
                timeout_s: float = 600.0, interval: int = 1) -> FailoverResult:
    """`streams` streams at once; `kill` once each has a third of its tokens (or all have ended)."""
    result = FailoverResult([Stream() for _ in range(streams)])
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        readers = [asyncio.ensure_future(_read(client, proxy, body(i, model, max_tokens, interval=interval), s))
                   for i, s in enumerate(result.streams)]
        third = max_tokens // 3 // interval  # events
        while not all(s.tokens >= third or r.done() for s, r in zip(result.streams, readers, strict=True)):
            if time.monotonic() - started > timeout_s:
                break
            await asyncio.sleep(0.05)
        kill()
        result.killed_at_s = time.monotonic() - started
        await asyncio.wait_for(asyncio.gather(*readers), timeout_s)
        for i in range(streams):
            answer = await client.post(f"{proxy}/v1/completions", json=body(i, model, max_tokens, stream=False))
            result.again.append(answer.json()["choices"][0]["text"] if answer.status_code == 200 else "")
        text = (await client.get(f"{proxy}/metrics")).text
    for line in text.splitlines():
        if line.startswith(("p2pkv_proxy_stream_resumes_total", "p2pkv_proxy_reroutes_total",
                            "p2pkv_proxy_requests_total")):
            name, value = line.rsplit(" ", 1)
            result.metrics[name] = float(value)
    return result


def run(model: str, streams: int, max_tokens: int, stream_resumes: int, log_dir: Path, interval: int = 1
        ) -> FailoverResult:
    cluster = Cluster(model=model, log_dir=log_dir)
    p_http, p_kv, d0_http, d0_kv, d1_http, d1_kv, proxy_port = free_ports(7)
    cluster.add_vllm("prefill", InstanceSpec("kv_producer", p_http, p_kv, {}))
    victim = cluster.add_vllm("decode0", InstanceSpec("kv_consumer", d0_http, d0_kv, {}))
    cluster.add_vllm("decode1", InstanceSpec("kv_consumer", d1_http, d1_kv, {}))
    cluster.add_proxy(proxy_port, [f"127.0.0.1:{p_http}"],
                      [f"127.0.0.1:{d0_http}@127.0.0.1:{d0_kv}", f"127.0.0.1:{d1_http}@127.0.0.1:{d1_kv}"],
                      args=("--stream-resumes", str(stream_resumes)))

    def kill() -> None:
        assert victim.popen is not None
        print(f"[failover] killing decode0 (process group {victim.popen.pid})", flush=True)
        os.killpg(victim.popen.pid, signal.SIGKILL)

    try:
        cluster.start(progress=lambda line: print(f"[failover] {line}", flush=True))
        return asyncio.run(drive(f"http://127.0.0.1:{proxy_port}", model, streams, max_tokens, kill,
                                 interval=interval))
    finally:
        cluster.stop()


def main(model: str | None, streams: int, max_tokens: int, stream_resumes: int, interval: int = 1) -> int:
    model = resolve_model(model)
    log_dir = Path(tempfile.mkdtemp(prefix="p2pkv-failover-"))
    r = run(model, streams, max_tokens, stream_resumes, log_dir, interval)
    whole = sum(s.whole() for s in r.streams)
    same = sum(s.text == again for s, again in zip(r.streams, r.again, strict=True))
    rows = [("streams", len(r.streams)), ("decode0 killed after (s)", f"{r.killed_at_s:.1f}"),
            ("streams ended whole", whole), ("streams ended with an error", sum(bool(s.error) for s in r.streams)),
            ("text equal to the request sent again", same)]
    rows += [(name.removeprefix("p2pkv_proxy_"), f"{value:.0f}") for name, value in sorted(r.metrics.items())]
    print(f"{'metric':<52}{'value':>10}")
    for name, value in rows:
        print(f"{name:<52}{value:>10}")
    print(f"result: {'PASS' if r.ok() else 'FAIL'} (logs in {log_dir})")
    return 0 if r.ok() else 1
