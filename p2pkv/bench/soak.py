"""`p2pkv bench soak`: many requests through a local 1P1D cluster; checks that every request succeeds, that
staging and pool usage return to zero, and that no vLLM process keeps growing (resident memory between the
middle of the run and its end). With `--pause-every`, the cluster is also paused through the proxy and resumed
again and again while the requests go, as an RL trainer does to update the weights: a request the pause aborts
(vLLM's `finish_reason` "abort") is counted apart, every other must succeed, and nothing may be left held."""

from __future__ import annotations

import asyncio
import contextlib
import random
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from p2pkv.bench.cluster import Cluster, InstanceSpec, Process, free_ports, wait_for_huge_pages
from p2pkv.models import resolve_model

RSS_GROWTH_LIMIT = 0.05


@dataclass
class SoakResult:
    requests: int
    failures: int
    seconds: float
    rss_mark_mb: dict[str, float] = field(default_factory=dict)
    rss_end_mb: dict[str, float] = field(default_factory=dict)
    staging_bytes: float = 0.0
    pool_bytes: float = 0.0
    received: dict[str, float] = field(default_factory=dict)  # decode's bytes received, by transport
    digests: dict[str, float] = field(default_factory=dict)  # with integrity_check: decode's digests by outcome
    left: int = 0  # requests whose client went away on purpose before the answer (the mixed soak's "leave")
    aborted: int = 0  # requests a pause aborted (`--pause-every`)
    pauses: list[float] = field(default_factory=list)  # how long each pause took to answer, seconds
    pause_failures: int = 0  # pauses, weight reloads or resumes that did not answer 200
    reloads: list[float] = field(default_factory=list)  # `--reload-weights`: how long each reload took, seconds
    kv_usage: dict[str, float] = field(default_factory=dict)  # vLLM's KV cache usage of each instance at the end

    def growth(self, name: str) -> float:
        return self.rss_end_mb[name] / self.rss_mark_mb[name] - 1.0

    @property
    def ok(self) -> bool:
        mismatches = sum(v for k, v in self.digests.items() if 'outcome="mismatch"' in k)
        return (self.failures == 0 and self.pause_failures == 0 and self.staging_bytes == 0 and self.pool_bytes == 0
                and mismatches == 0
                and not any(self.kv_usage.values())
                and all(self.growth(n) < RSS_GROWTH_LIMIT for n in self.rss_mark_mb if n in self.rss_end_mb))


def tree_rss_mb(proc: Process) -> dict[str, float]:
    """Resident memory of a vLLM server and of each of its engine and worker processes."""
    import psutil  # a dependency of vLLM, so present wherever this benchmark can run

    assert proc.popen is not None
    root = psutil.Process(proc.popen.pid)
    out: dict[str, float] = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            name = "api" if p.pid == root.pid else p.name().removeprefix("VLLM::").lower()
            out[f"{proc.name}.{name}"] = p.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return out


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


_USAGE = "vllm:kv_cache_usage_perc"


# Request shapes of a mixed soak, in turn: each takes its own path through the proxy and the connector.
SHAPES = ("plain", "samples", "batch", "one_token", "whole", "prompt_logprobs", "stream", "leave", "stream_batch")
_LETTERS = "abcdefghijklmnopqrstuvwxyz "
# Two blocks of vLLM's CPU default (128 tokens) and one token, with the tiny model's one-byte tokens, sent again and
# again: the decode instance soon holds it whole in its prefix cache and loads nothing.
_WHOLE = "whole " + "w" * (2 * 128 + 1 - len("whole "))


def request_body(i: int, rng: random.Random, model: str, mixed: bool) -> dict[str, Any]:
    """Request `i` of a soak: a plain completion of a random prompt, or in a mixed soak one of `SHAPES` in turn."""
    text = f"{i} " + "".join(rng.choice(_LETTERS) for _ in range(rng.randint(20, 700)))
    body: dict[str, Any] = {"model": model, "prompt": text, "max_tokens": rng.randint(4, 16), "temperature": 0}
    shape = SHAPES[i % len(SHAPES)] if mixed else "plain"
    if shape == "samples":
        body.update(n=3, temperature=1.0, top_k=1)
    elif shape == "batch":
        body["prompt"] = [text, text[::-1], f"{i} and a short one"]
    elif shape == "one_token":
        body["prompt"] = "x"
    elif shape == "whole":
        body["prompt"] = _WHOLE
    elif shape == "prompt_logprobs":
        body["prompt_logprobs"] = 1
    elif shape == "stream":
        body["stream"] = True
    elif shape == "stream_batch":
        body.update(prompt=[text, f"{i} and a short one"], stream=True)
    elif shape == "leave":  # a long prompt and answer, which the client does not wait for (`leave_after`)
        body.update(prompt=text + text[::-1], max_tokens=64, ignore_eos=True)
    return body


def leave_after(i: int, mixed: bool) -> float | None:
    """How long the client of request `i` waits before it goes away (None: until the answer). The mixed soak's
    "leave" requests go away at points through the prefill and the decode, 0.05 to 0.5 s after they were sent."""
    if not mixed or SHAPES[i % len(SHAPES)] != "leave":
        return None
    return 0.05 + 0.075 * ((i // len(SHAPES)) % 7)


def aborted(body: dict[str, Any], resp: httpx.Response) -> bool:
    """A whole answer of which a choice was cut short by a pause (vLLM's `finish_reason` "abort")."""
    if body.get("stream"):
        return '"finish_reason":"abort"' in resp.text.replace(" ", "")
    choices = resp.json().get("choices")
    return isinstance(choices, list) and any(c.get("finish_reason") == "abort" for c in choices)


def answered(body: dict[str, Any], resp: httpx.Response) -> bool:
    """Whether the answer is a whole one: a stream to its end, or a choice per prompt and sample."""
    if resp.status_code != 200:
        return False
    if body.get("stream"):
        return "data: [DONE]" in resp.text
    prompts = len(body["prompt"]) if isinstance(body["prompt"], list) else 1
    choices = resp.json().get("choices")
    return isinstance(choices, list) and len(choices) == prompts * body.get("n", 1)


async def _drive(proxy: str, model: str, requests: int, concurrency: int, mark: int,
                 on_mark: asyncio.Event, result: SoakResult, mixed: bool = False) -> None:
    rng = random.Random(0)
    sem = asyncio.Semaphore(concurrency)
    done = 0
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(i: int) -> None:
            nonlocal done
            body = request_body(i, rng, model, mixed)
            leave = leave_after(i, mixed)
            async with sem:
                try:
                    resp = await client.post(f"{proxy}/v1/completions", json=body,
                                             timeout=leave if leave is not None else client.timeout)
                    if not answered(body, resp):
                        result.failures += 1
                    elif aborted(body, resp):
                        result.aborted += 1
                except httpx.TimeoutException:
                    if leave is None:
                        result.failures += 1
                    else:
                        result.left += 1
                except (httpx.HTTPError, ValueError):  # ValueError: a body that is not JSON
                    result.failures += 1
            done += 1
            if done == mark:
                on_mark.set()

        await asyncio.gather(*(one(i) for i in range(requests)))


async def _pausing(proxy: str, every_s: float, result: SoakResult, stop: asyncio.Event,
                   reload_from: str | None = None) -> None:
    """Every `every_s` until `stop`: pause the cluster through the proxy (vLLM's default, mode=abort with the
    caches cleared); hold it a second, or with `reload_from` have every instance reload its weights from that
    checkpoint (through the proxy's `/collective_rpc`); resume it."""
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": reload_from}}
    async with httpx.AsyncClient(timeout=300) as client:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
            if stop.is_set():
                return
            started = time.monotonic()
            try:
                paused = await client.post(f"{proxy}/pause")
                result.pauses.append(time.monotonic() - started)
                reloaded_ok = True
                if reload_from is None:
                    await asyncio.sleep(1.0)
                elif paused.status_code == 200:
                    started = time.monotonic()
                    reloaded = await client.post(f"{proxy}/collective_rpc", json=rpc)
                    result.reloads.append(time.monotonic() - started)
                    reloaded_ok = reloaded.status_code == 200
                resumed = await client.post(f"{proxy}/resume")
            except httpx.HTTPError:
                result.pause_failures += 1
                continue
            result.pause_failures += (paused.status_code != 200) + (not reloaded_ok) + (resumed.status_code != 200)


async def _with_pauses(drive: Coroutine[Any, Any, None], proxy: str, every_s: float, result: SoakResult,
                       reload_from: str | None = None) -> None:
    if every_s <= 0:
        await drive
        return
    stop = asyncio.Event()
    pauser = asyncio.ensure_future(_pausing(proxy, every_s, result, stop, reload_from))
    try:
        await drive
    finally:
        stop.set()
        await pauser


async def _noting_mark(drive: Coroutine[Any, Any, None], marked: asyncio.Event, at_mark: Callable[[], None]) -> None:
    """Run `drive`, calling `at_mark` once `marked` is set; return (or raise) when `drive` ends, also when it ends
    without reaching the mark (then `at_mark` is not called)."""
    task = asyncio.ensure_future(drive)
    seen = asyncio.ensure_future(marked.wait())
    await asyncio.wait({task, seen}, return_when=asyncio.FIRST_COMPLETED)
    seen.cancel()
    if marked.is_set():
        at_mark()
    await task


def run_soak(model: str, requests: int, concurrency: int, log_dir: Path, send_type: str = "PUT_ASYNC",
             transport: str = "auto", integrity_check: bool = False, mixed: bool = False,
             pause_every_s: float = 0.0, reload_weights: bool = False) -> SoakResult:
    """`reload_weights`: each pause reloads every instance's weights from `model` (the same weights: the outputs
    do not change, the update's path is exercised under load)."""
    # vLLM serves its pause and resume in dev mode only.
    cluster = Cluster(model=model, log_dir=log_dir,
                      extra_env={"VLLM_SERVER_DEV_MODE": "1"} if pause_every_s > 0 else {})
    p_http, p_kv, d_http, d_kv, d_metrics, proxy_port = free_ports(6)
    mode: dict[str, object] = {"send_type": send_type, "transport": transport, "integrity_check": integrity_check}
    prefill = cluster.add_vllm("prefill", InstanceSpec("kv_producer", p_http, p_kv, mode))
    decode = cluster.add_vllm("decode", InstanceSpec("kv_consumer", d_http, d_kv, {**mode, "metrics_port": d_metrics}))
    cluster.add_proxy(proxy_port, [f"127.0.0.1:{p_http}"], [f"127.0.0.1:{d_http}@127.0.0.1:{d_kv}"])
    result = SoakResult(requests, 0, 0.0)
    try:
        cluster.start(progress=lambda line: print(f"[soak] {line}", flush=True))
        wait_for_huge_pages([prefill, decode], progress=lambda line: print(f"[soak] {line}", flush=True))
        # The second half: vLLM's CPU build fills bounded caches (GEMM kernels per batch size) for a while, and
        # the faster the cluster runs, the more batch sizes it meets and the later they are full.
        mark = max(1, requests // 2)
        marked = asyncio.Event()

        def at_mark() -> None:
            result.rss_mark_mb = {**tree_rss_mb(prefill), **tree_rss_mb(decode)}
            print(f"[soak] {mark} requests done; resident memory noted", flush=True)

        started = time.monotonic()
        proxy = f"http://127.0.0.1:{proxy_port}"
        drive = _drive(proxy, model, requests, concurrency, mark, marked, result, mixed)
        reload_from = model if reload_weights else None
        asyncio.run(_noting_mark(_with_pauses(drive, proxy, pause_every_s, result, reload_from), marked, at_mark))
        result.seconds = time.monotonic() - started
        time.sleep(1.0)  # let the last transfers' bookkeeping settle
        result.rss_end_mb = {**tree_rss_mb(prefill), **tree_rss_mb(decode)}
        # What is held for requests that went away is freed at once (within a step or two, and the proxy's discard
        # goes in the background), not at expiry (120 s) or the end of a lease (30 s): a few seconds at most.
        deadline = time.monotonic() + (5.0 if result.left else 0.0)
        while True:
            text = httpx.get(f"http://127.0.0.1:{d_metrics}/metrics", timeout=10).text
            result.kv_usage = {name: _metric(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text,
                                             _USAGE) for name, port in (("prefill", p_http), ("decode", d_http))}
            if ((not _metric(text, "p2pkv_staging_bytes") and not any(result.kv_usage.values()))
                    or time.monotonic() > deadline):
                break
            time.sleep(0.2)
        result.staging_bytes = _metric(text, "p2pkv_staging_bytes")
        result.pool_bytes = _metric(text, "p2pkv_pool_bytes")
        result.received = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                           if line.startswith("p2pkv_bytes_received_total{")}
        result.digests = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                          if line.startswith("p2pkv_digests_total{")}
    finally:
        cluster.stop()
    return result


def main(model: str | None, requests: int, concurrency: int, send_type: str = "PUT_ASYNC",
         transport: str = "auto", integrity_check: bool = False, mixed: bool = False,
         pause_every_s: float = 0.0, reload_weights: bool = False) -> int:
    model = resolve_model(model)
    log_dir = Path(tempfile.mkdtemp(prefix="p2pkv-soak-"))
    r = run_soak(model, requests, concurrency, log_dir, send_type, transport, integrity_check, mixed, pause_every_s,
                 reload_weights)
    print(f"{'metric':<46}{'value':>14}")
    print(f"{'requests':<46}{r.requests:>14}")
    print(f"{'failed requests':<46}{r.failures:>14}")
    print(f"{'requests per second':<46}{r.requests / r.seconds:>14.1f}")
    if r.left:
        print(f"{'requests whose client went away (on purpose)':<46}{r.left:>14}")
    if pause_every_s > 0:
        print(f"{'pauses through the proxy':<46}{len(r.pauses):>14}")
        if r.pauses:
            print(f"{'  longest pause to answer (s)':<46}{max(r.pauses):>14.2f}")
        if r.reloads:
            print(f"{'  weight reloads (longest, s)':<46}{len(r.reloads):>8} ({max(r.reloads):.2f})")
        print(f"{'  pauses, reloads or resumes that failed':<46}{r.pause_failures:>14}")
        print(f"{'requests a pause aborted':<46}{r.aborted:>14}")
    print(f"{'decode staging bytes at the end':<46}{r.staging_bytes:>14.0f}")
    for name, usage in sorted(r.kv_usage.items()):
        print(f"{name + ' KV cache usage at the end':<46}{usage:>14.4f}")
    print(f"{'decode pool bytes at the end':<46}{r.pool_bytes:>14.0f}")
    for series, value in sorted(r.received.items()) + sorted(r.digests.items()):
        print(f"{'decode ' + series.removeprefix('p2pkv_'):<46}{value:>14.0f}")
    print(f"{'process: RSS at the mark / at the end (MiB)':<46}{'growth':>14}")
    for name in sorted(r.rss_mark_mb):
        if name in r.rss_end_mb:
            mib = f"{r.rss_mark_mb[name]:.0f} / {r.rss_end_mb[name]:.0f}"
            print(f"{'  ' + name + ': ' + mib:<46}{r.growth(name):>14.1%}")
    print(f"result: {'PASS' if r.ok else 'FAIL'} (logs in {log_dir})")
    return 0 if r.ok else 1
