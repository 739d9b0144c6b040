"""`p2pkv bench routing`: round-robin against the prefix policy on one live 2P1D cluster (SmolLM2-135M by default,
whose prefill costs what a real model's does on this host), with a shared-prefix workload.

The workload: `prefixes` system prompts of about `prefix_tokens` tokens, `questions` different questions after each,
shuffled (seeded), sent at a fixed rate as streamed completions. Each prefill instance's KV cache holds about half
of the prefixes, so that spreading every prefix over both instances evicts, as it does at scale with many prefixes
and many instances. The same requests go through two proxies over the same instances: one round-robin (instances
listed statically), one with the prefix policy (instances found by their heartbeats, which name their KV event
endpoints); every cache is emptied before each run (vLLM's dev mode).

Printed per policy: the prefill instances' prefix cache hit rate (from their own `vllm:prefix_cache_*` counters)
against the ideal for the workload (every request after the first of its prefix finds the prefix's full blocks),
mean and p99 TTFT, and the ratios. Targets: hit rate with `prefix` >= 0.9 of the ideal, mean TTFT `prefix` <=
0.75x `round-robin`. Exit status 1 if a request failed or a target was missed.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import secrets
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from p2pkv.bench.cluster import Cluster, InstanceSpec, free_ports, wait_for_huge_pages
from p2pkv.config import AUTH_SECRET_ENV
from p2pkv.models import resolve_model

BLOCK_SIZE = 128  # vLLM's CPU default, given explicitly: the cache is sized in blocks
MAX_MODEL_LEN = 1024  # vLLM wants a cache of at least this many tokens: it bounds how small the cache can be
HIT_TARGET = 0.9  # of the ideal hit rate
TTFT_TARGET = 0.75  # mean TTFT, prefix over round-robin
DECODE_CACHE_BYTES = 1 << 30
IN_FLIGHT = 4  # prompts a prefill instance's cache has room for beside the prefixes it holds
SETTLE_S = 1.0  # vLLM counts a request's cache hits just after it answers
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their has would when if so no will more can out up who said "
         "what about than into them only could new some these two may first then do any like my now over such our "
         "man me even most made after also did many before must through back years where much your way well down "
         "should because each just those people how too little state good very make world still own see men work "
         "long get here between both life being under never day same another know while last might us great old "
         "year off come since against go came right used take three").split()


@dataclass(frozen=True)
class RoutingSettings:
    model: str
    prefixes: int = 8
    questions: int = 16
    prefix_tokens: int = 1000
    rate: float = 1.0
    output_len: int = 8
    seed: int = 0
    held_share: float = 0.5  # of the prefixes, what one prefill instance's KV cache holds


def system_prompt(rng: random.Random, index: int, words: int) -> str:
    return f"System prompt {index}. " + " ".join(rng.choice(WORDS) for _ in range(words)) + "\n\n"


def workload(s: RoutingSettings, tokenizer: Any) -> list[tuple[int, str, list[int]]]:
    """The requests in sending order: (prefix index, prompt, its tokens)."""
    rng = random.Random(s.seed)
    systems = []
    for i in range(s.prefixes):
        words = s.prefix_tokens
        text = system_prompt(random.Random(f"{s.seed}-{i}"), i, words)
        while len(tokenizer(text)["input_ids"]) > s.prefix_tokens and words > 1:  # one token per word, or so
            words = int(words * 0.9)
            text = system_prompt(random.Random(f"{s.seed}-{i}"), i, words)
        systems.append(text)
    requests = []
    for i, system in enumerate(systems):
        for q in range(s.questions):
            topic = " ".join(rng.choice(WORDS) for _ in range(6))
            text = f"{system}Question {q}: what does it say about {topic}?\nAnswer:"
            requests.append((i, text, list(tokenizer(text)["input_ids"])))
    rng.shuffle(requests)
    return requests


def ideal_hit_rate(requests: list[tuple[int, str, list[int]]], block_size: int) -> float:
    """Cached over queried prompt tokens if every prompt found every full block an earlier one computed."""
    seen: list[list[int]] = []
    hits = total = 0
    for _, _, tokens in requests:
        best = 0
        for earlier in seen:
            n = 0
            for a, b in zip(tokens, earlier, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        hits += min(best, len(tokens) - 1) // block_size * block_size
        total += len(tokens)
        seen.append(tokens)
    return hits / total


def kv_bytes_per_token(model: str, dtype_bytes: int = 4) -> int:
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(2 * config["num_hidden_layers"] * heads * head_dim * dtype_bytes)


@dataclass
class Ports:
    http: list[int]
    kv: list[int]
    metrics: list[int]
    prefix_proxy: int
    round_robin_proxy: int
    discovery: int
    decode_only_proxy: int


def start(s: RoutingSettings, log_dir: Path, cache_blocks: int) -> tuple[Cluster, Ports]:
    """Two prefill instances (each with `cache_blocks` blocks of KV cache, publishing KV events) and a decode
    instance, behind a prefix proxy (by discovery) and a round-robin proxy (static lists)."""
    secret = secrets.token_hex(32)
    # No VLLM_CPU_KVCACHE_SPACE (kv_cache_gb=0): it would override each instance's --kv-cache-memory-bytes.
    cluster = Cluster(model=s.model, log_dir=log_dir, kv_cache_gb=0,
                      extra_env={"VLLM_SERVER_DEV_MODE": "1", AUTH_SECRET_ENV: secret})
    ports = free_ports(13)
    p = Ports(ports[0:3], ports[3:6], ports[6:9], ports[9], ports[10], ports[11], ports[12])
    events = Path(tempfile.mkdtemp(prefix="p2pkv-routing-"))
    shared = ("--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN))
    for i, name in enumerate(("prefill0", "prefill1", "decode0")):
        role = "kv_consumer" if name.startswith("decode") else "kv_producer"
        extra = {"metrics_port": p.metrics[i], "http_port": p.http[i], "proxy_ip": "127.0.0.1",
                 "proxy_port": p.discovery}
        args: tuple[str, ...] = (*shared, "--kv-cache-memory-bytes", str(DECODE_CACHE_BYTES))
        if role == "kv_producer":
            cache = cache_blocks * BLOCK_SIZE * kv_bytes_per_token(s.model)
            config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{events}/{name}"}
            args = (*shared, "--kv-cache-memory-bytes", str(cache), "--kv-events-config", json.dumps(config))
        cluster.add_vllm(name, InstanceSpec(role, p.http[i], p.kv[i], extra, args))
    cluster.add_proxy(p.prefix_proxy, [], [], p.discovery, secret=secret, args=("--prefill-policy", "prefix"))
    cluster.add_proxy(p.round_robin_proxy, [f"127.0.0.1:{p.http[0]}", f"127.0.0.1:{p.http[1]}"],
                      [f"127.0.0.1:{p.http[2]}@127.0.0.1:{p.kv[2]}"], 0, args=("--prefill-policy", "round-robin"),
                      name="proxy-round-robin")
    cluster.add_proxy(p.decode_only_proxy, [f"127.0.0.1:{p.http[0]}", f"127.0.0.1:{p.http[1]}"],
                      [f"127.0.0.1:{p.http[2]}@127.0.0.1:{p.kv[2]}"], 0,
                      args=("--decode-only-below", str(MAX_MODEL_LEN)), name="proxy-decode-only")
    try:
        cluster.start(progress=lambda line: print(f"[routing] {line}", flush=True))
        wait_for_huge_pages([proc for proc in cluster.processes if proc.ranks],
                            progress=lambda line: print(f"[routing] {line}", flush=True))
        deadline = time.monotonic() + 120
        while len(httpx.get(f"http://127.0.0.1:{p.prefix_proxy}/instances", timeout=10).json()["instances"]) < 3:
            if time.monotonic() > deadline:
                raise RuntimeError("the prefix proxy did not hear every instance's heartbeats")
            time.sleep(0.5)
    except BaseException:
        cluster.stop()
        raise
    return cluster, p


def counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def cache_counters(ports: Ports) -> tuple[float, float]:
    """Prefix cache hits and queries (tokens) summed over the prefill instances."""
    texts = [httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text for port in ports.http[:2]]
    return (sum(counter(t, "vllm:prefix_cache_hits_total") for t in texts),
            sum(counter(t, "vllm:prefix_cache_queries_total") for t in texts))


def reset_caches(ports: Ports) -> None:
    for port in ports.http:
        answer = httpx.post(f"http://127.0.0.1:{port}/reset_prefix_cache", timeout=30)
        if answer.status_code != 200:
            raise RuntimeError(f"reset_prefix_cache answered {answer.status_code} on port {port}")


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, output_len: int, at: float
               ) -> tuple[float, str] | None:
    """A streamed completion sent at `at` (monotonic): its time to first token and the prefill instance it names;
    None if it failed."""
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    sent = time.monotonic()
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
            "ignore_eos": True}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
            if answer.status_code != 200:
                return None
            first = None
            async for line in answer.aiter_lines():
                if first is None and line.startswith("data: ") and line != "data: [DONE]":
                    first = time.monotonic() - sent
            return (first, answer.headers.get("x-p2pkv-prefill", "?")) if first is not None else None
    except httpx.HTTPError:
        return None


async def _run(url: str, model: str, prompts: list[str], rate: float, output_len: int
               ) -> list[tuple[float, str] | None]:
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.monotonic() + 0.5
        return await asyncio.gather(*(_one(client, url, model, p, output_len, t0 + i / rate)
                                      for i, p in enumerate(prompts)))


@dataclass
class Result:
    policy: str
    hit_rate: float
    mean_ttft_ms: float
    p99_ttft_ms: float
    failed: int
    spread: dict[str, int]


def run_policy(policy: str, port: int, s: RoutingSettings, ports: Ports, prompts: list[str]) -> Result:
    url = f"http://127.0.0.1:{port}"
    reset_caches(ports)
    # Warm-up: kernels for these lengths compiled, both instances reached; then empty caches again.
    asyncio.run(_run(url, s.model, [f"Warm-up {i}. " + "word " * (s.prefix_tokens // 2) for i in range(4)],
                     s.rate * 4, s.output_len))
    reset_caches(ports)
    time.sleep(SETTLE_S)
    hits0, queries0 = cache_counters(ports)
    results = asyncio.run(_run(url, s.model, prompts, s.rate, s.output_len))
    time.sleep(SETTLE_S)
    hits1, queries1 = cache_counters(ports)
    ttfts = sorted(r[0] * 1000 for r in results if r is not None)
    spread: dict[str, int] = {}
    for r in results:
        if r is not None:
            spread[r[1]] = spread.get(r[1], 0) + 1
    p99 = ttfts[min(len(ttfts) - 1, math.ceil(0.99 * len(ttfts)) - 1)] if ttfts else float("nan")
    return Result(policy, (hits1 - hits0) / max(1.0, queries1 - queries0),
                  statistics.fmean(ttfts) if ttfts else float("nan"), p99, sum(r is None for r in results), spread)


SHORT_LENGTHS = (32, 128, 512)
SHORT_PROMPTS = 16
SHORT_RATE = 2.0
SHORT_TARGET = 1.1  # decode-only TTFT of 32-token prompts over the decode instance's own


def short_prompts(tokenizer: Any, length: int, tag: str) -> list[str]:
    """Prompts of about `length` tokens, none sharing a block with another."""
    out = []
    for i in range(SHORT_PROMPTS):
        rng = random.Random(f"{tag}-{length}-{i}")
        words = [f"Note {tag}-{i}:"] + [rng.choice(WORDS) for _ in range(length)]
        while len(tokenizer(" ".join(words))["input_ids"]) > length and len(words) > 2:
            words.pop()
        out.append(" ".join(words))
    return out


def short_mix(s: RoutingSettings, ports: Ports, tokenizer: Any) -> dict[int, dict[str, float]]:
    """Mean TTFT (ms) of prompts of each length in `SHORT_LENGTHS`: on the decode instance asked directly (as a
    colocated instance computes them), through the proxy sending them there alone (`--decode-only-below`), and
    through the proxy prefilling them elsewhere and moving their KV."""
    fronts = {"direct": ports.http[2], "decode-only": ports.decode_only_proxy, "disaggregated": ports.round_robin_proxy}
    out: dict[int, dict[str, float]] = {}
    for length in SHORT_LENGTHS:
        out[length] = {}
        for front, port in fronts.items():
            reset_caches(ports)
            prompts = short_prompts(tokenizer, length, front)
            results = asyncio.run(_run(f"http://127.0.0.1:{port}", s.model, prompts, SHORT_RATE, s.output_len))
            ttfts = [r[0] * 1000 for r in results if r is not None]
            out[length][front] = statistics.fmean(ttfts) if len(ttfts) == len(prompts) else float("nan")
    return out


def main(model: str | None, prefixes: int, questions: int, prefix_tokens: int, rate: float, seed: int) -> int:
    from transformers import AutoTokenizer

    resolved = resolve_model(model or "smollm2")
    s = RoutingSettings(resolved, prefixes, questions, prefix_tokens, rate, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(resolved)
    requests = workload(s, tokenizer)
    prompt_tokens = max(len(t) for _, _, t in requests)
    if prompt_tokens + s.output_len > MAX_MODEL_LEN:
        raise SystemExit(f"p2pkv bench routing: prompts of up to {prompt_tokens} tokens do not fit the bench's "
                         f"--max-model-len {MAX_MODEL_LEN}; use fewer --prefix-tokens")
    prefix_blocks = min(len(t) for _, _, t in requests) // BLOCK_SIZE  # full blocks every prompt of a prefix shares
    # Half the prefixes' full blocks, and the last blocks of the prompts in flight: an idle instance holds no more.
    cache_blocks = max(math.ceil(s.held_share * prefixes) * prefix_blocks + IN_FLIGHT, MAX_MODEL_LEN // BLOCK_SIZE)
    per_token = kv_bytes_per_token(resolved)
    ideal = ideal_hit_rate(requests, BLOCK_SIZE)
    print(f"[routing] {prefixes} system prompts of ~{prefix_tokens} tokens x {questions} questions = {len(requests)} "
          f"requests at {rate:g}/s, seed {seed}; prompts of up to {prompt_tokens} tokens", flush=True)
    print(f"[routing] each prefill instance's KV cache: {cache_blocks} blocks of {BLOCK_SIZE} tokens "
          f"({cache_blocks * BLOCK_SIZE * per_token / 2**20:.0f} MiB at {per_token} B/token): "
          f"{(cache_blocks - IN_FLIGHT) / prefix_blocks:.1f} of the {prefixes} prefixes ({prefix_blocks} full blocks "
          f"each) and the last blocks of {IN_FLIGHT} prompts", flush=True)
    log_dir = Path(tempfile.mkdtemp(prefix="p2pkv-bench-routing-"))
    cluster, ports = start(s, log_dir, cache_blocks)
    try:
        prompts = [text for _, text, _ in requests]
        results = [run_policy(policy, port, s, ports, prompts)
                   for policy, port in (("round-robin", ports.round_robin_proxy), ("prefix", ports.prefix_proxy))]
        short = short_mix(s, ports, tokenizer)
    finally:
        cluster.stop()
    print(f"[routing] logs in {log_dir}")
    print(f"ideal prefix cache hit rate for this workload: {ideal:.3f}")
    print(f"{'policy':<12} {'hit rate':>9} {'of ideal':>9} {'mean TTFT ms':>13} {'p99 TTFT ms':>12} {'failed':>7}  "
          "prefills per instance")
    for r in results:
        print(f"{r.policy:<12} {r.hit_rate:>9.3f} {r.hit_rate / ideal:>9.2f} {r.mean_ttft_ms:>13.1f} "
              f"{r.p99_ttft_ms:>12.1f} {r.failed:>7}  {sorted(r.spread.values())}")
    rr, px = results
    ratio, p99_ratio = px.mean_ttft_ms / rr.mean_ttft_ms, px.p99_ttft_ms / rr.p99_ttft_ms
    print(f"prefix / round-robin: mean TTFT {ratio:.2f}x, p99 TTFT {p99_ratio:.2f}x, hit rate "
          f"{px.hit_rate / max(rr.hit_rate, 1e-9):.2f}x")
    met_hits, met_ttft = px.hit_rate >= HIT_TARGET * ideal, ratio <= TTFT_TARGET
    print(f"target: prefix hit rate >= {HIT_TARGET} of ideal: {'met' if met_hits else 'MISSED'} "
          f"({px.hit_rate / ideal:.2f}); mean TTFT prefix <= {TTFT_TARGET}x round-robin: "
          f"{'met' if met_ttft else 'MISSED'} ({ratio:.2f}x)")
    print(f"short prompts ({SHORT_PROMPTS} per length at {SHORT_RATE:g}/s), mean TTFT in ms:")
    print(f"{'tokens':>7} {'direct':>9} {'decode-only':>12} {'disaggregated':>14} {'decode-only/direct':>19} "
          f"{'disaggregated/direct':>21}")
    for length, row in short.items():
        print(f"{length:>7} {row['direct']:>9.1f} {row['decode-only']:>12.1f} {row['disaggregated']:>14.1f} "
              f"{row['decode-only'] / row['direct']:>19.2f} {row['disaggregated'] / row['direct']:>21.2f}")
    short_ratio = short[SHORT_LENGTHS[0]]["decode-only"] / short[SHORT_LENGTHS[0]]["direct"]
    met_short = short_ratio <= SHORT_TARGET
    print(f"target: {SHORT_LENGTHS[0]}-token prompts decode-only <= {SHORT_TARGET}x the decode instance's own: "
          f"{'met' if met_short else 'MISSED'} ({short_ratio:.2f}x)")
    met_ttft = met_ttft and met_short
    failed = sum(r.failed for r in results)
    if failed:
        print(f"{failed} requests failed")
    return 0 if met_hits and met_ttft and not failed else 1
