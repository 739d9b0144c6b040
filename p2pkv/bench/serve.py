"""`p2pkv bench serve`: vLLM's serving benchmark against a local 1P1D cluster and against one colocated instance of
the same model, on this host, in interleaved rounds measured from the moment every instance is ready (each run
once the previous one's workers have stopped spinning).

The cluster is measured through each front asked for (`--via`): p2pkv's proxy (it names the decode instance: the
prefill side pushes), and a router of vLLM's standard disaggregation protocol (`p2pkv.bench.router`: it names none,
so the decode side always pulls). Each round runs the colocated instance, then each front, on the same live
instances. With `nixl` among the fronts (NIXL installed: `pip install nixl`), vLLM's own NixlConnector 1P1D behind
that router is measured after them as a peer, not a target: in a phase of its own, against the colocated instance
measured in the same phase, since NIXL's progress thread keeps a core busy.

Printed: each round's TTFT, the medians over the rounds side by side with their ratios to colocated, where a
request's time to first token goes (from the proxy's, the instances' and vLLM's own metrics, as means over the
round's requests), and whether each target is met: mean TTFT <= 1.3x colocated, p99 TTFT <= 2x, mean ITL within
10%. Exit status 1 if a request failed or a target of p2pkv's fronts was missed.
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from p2pkv.bench.cluster import Cluster, InstanceSpec, free_ports, wait_for_huge_pages
from p2pkv.models import resolve_model

FRONTS = {"proxy": "1P1D via proxy", "after": "1P1D decode after", "router": "1P1D via router",
          "nixl": "NIXL via router"}
PEERS = ("nixl",)  # measured in a phase of their own, beside p2pkv's fronts, with no target
# Measured beside the others for comparison, with no target: the proxy sending each decode request only once its
# prefill answered (`--decode-alongside off`), as it did before decode requests went alongside.
COMPARED = ("after",)
# The ratios to colocated a front must stay under; ITL within 10% (a shorter one, disaggregation's point, is met).
TARGETS = (("mean TTFT", "mean_ttft_ms", 1.3), ("p99 TTFT", "p99_ttft_ms", 2.0), ("mean ITL", "mean_itl_ms", 1.1))
DISAGREE = 2.0  # rounds whose mean TTFT differ by more than this factor are said to disagree
SETTLE_S = 1.0  # vLLM records a request's metrics just after its answer: waited for before a run's last scrape
# vLLM's CPU workers spin for about a second after their last step, on the cores the next run's instances use
# (the colocated instance and the prefill instance share one here): each run starts once that is over.
IDLE_S = 2.0
ROWS = (("mean TTFT (ms)", "mean_ttft_ms"), ("median TTFT (ms)", "median_ttft_ms"), ("p99 TTFT (ms)", "p99_ttft_ms"),
        ("mean ITL (ms)", "mean_itl_ms"), ("p99 ITL (ms)", "p99_itl_ms"), ("mean TPOT (ms)", "mean_tpot_ms"),
        ("output tokens/s", "output_throughput"), ("requests/s", "request_throughput"),
        ("completed requests", "completed"))
# (label, source, histogram): the parts of a request's time to first token, in ms, means over a round's requests.
# Sources: "proxy" (its /metrics), "prefill"/"decode" (vLLM's /metrics on the instance; p2pkv's on its workers:
# "prefill-kv", "decode-kv"), "colocated".
PARTS = (
    ("client TTFT at the proxy", "proxy", "p2pkv_proxy_time_to_first_token_seconds"),
    ("prefill request, as the proxy saw it", "proxy", "p2pkv_proxy_prefill_seconds"),
    ("prefill instance: arrival to first token", "prefill", "vllm:time_to_first_token_seconds"),
    ("prefill instance: queued", "prefill", "vllm:request_queue_time_seconds"),
    ("prefill instance: its prefill step", "prefill", "vllm:request_prefill_time_seconds"),
    ("KV push (prefill side) or pull (decode side)", "kv", "p2pkv_transfer_seconds"),
    ("decode instance: arrival to first token", "decode", "vllm:time_to_first_token_seconds"),
    ("decode instance: queued, KV loading included", "decode", "vllm:request_queue_time_seconds"),
    ("decode instance: its prefill step", "decode", "vllm:request_prefill_time_seconds"),
    ("colocated: arrival to first token", "colocated", "vllm:time_to_first_token_seconds"),
    ("colocated: its prefill step", "colocated", "vllm:request_prefill_time_seconds"),
)


@dataclass(frozen=True)
class ServeSettings:
    model: str
    input_len: int = 512
    output_len: int = 32
    num_prompts: int = 64
    request_rate: float = 4.0
    rounds: int = 3
    warmups: int = 16
    extra: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config for both instances


def histogram_sum_count(text: str, name: str) -> tuple[float, float]:
    """Sum and count of a histogram (all label sets) in Prometheus text."""
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def _transfer_seconds(metrics: Sequence[str]) -> tuple[float, float]:
    """Sum and count of `p2pkv_transfer_seconds` over both instances: a push is timed by its sender, a pull by its
    puller, so each transfer once."""
    found = [histogram_sum_count(httpx.get(url, timeout=10).text, "p2pkv_transfer_seconds") for url in metrics]
    return sum(total for total, _ in found), sum(count for _, count in found)


@dataclass
class Endpoints:
    """Where the running instances' metrics are: by source name, the /metrics URLs whose histograms add up."""

    metrics: dict[str, list[str]]
    fronts: dict[str, str]  # front -> base URL
    colocated: str
    caches: tuple[str, ...] = ()  # base URLs of the vLLM instances (in dev mode) whose prefix caches each run empties

    def reset_caches(self) -> None:
        """Every instance's prefix cache emptied: each run finds its prompts in no cache, as the first one did."""
        for url in self.caches:
            answer = httpx.post(f"{url}/reset_prefix_cache", timeout=30)
            if answer.status_code != 200:
                raise RuntimeError(f"{url}/reset_prefix_cache answered {answer.status_code}: the benchmark needs "
                                   "the instances in vLLM's dev mode (VLLM_SERVER_DEV_MODE=1)")

    def scrape(self) -> dict[tuple[str, str], tuple[float, float]]:
        texts = {source: [httpx.get(url, timeout=10).text for url in urls] for source, urls in self.metrics.items()}
        out = {}
        for _, source, name in PARTS:
            found = [histogram_sum_count(text, name) for text in texts.get(source, [])]
            out[(source, name)] = (sum(s for s, _ in found), sum(c for _, c in found))
        return out


def breakdown(before: dict[tuple[str, str], tuple[float, float]], after: dict[tuple[str, str], tuple[float, float]]
              ) -> dict[str, float]:
    """Each part's mean in ms over what was observed between two scrapes (NaN where nothing was)."""
    out = {}
    for label, source, name in PARTS:
        total = after[(source, name)][0] - before[(source, name)][0]
        count = after[(source, name)][1] - before[(source, name)][1]
        out[label] = total / count * 1000 if count else float("nan")
    return out


def start(s: ServeSettings, log_dir: Path, fronts: Sequence[str]) -> tuple[list[Cluster], Endpoints]:
    """The 1P1D cluster with its fronts, and the colocated instance, started together; back once all serve."""
    # vLLM's dev mode serves /reset_prefix_cache, which empties the caches before each run (`Endpoints.caches`).
    dev = {"VLLM_SERVER_DEV_MODE": "1"}
    disagg = Cluster(model=s.model, log_dir=log_dir / "disaggregated", extra_env=dev)
    colocated = Cluster(model=s.model, log_dir=log_dir / "colocated", extra_env=dev)
    p_http, p_kv, p_metrics, d_http, d_kv, d_metrics, proxy_port, router_port, c_http, after_port = free_ports(10)
    disagg.add_vllm("prefill", InstanceSpec("kv_producer", p_http, p_kv, {**s.extra, "metrics_port": p_metrics}))
    disagg.add_vllm("decode", InstanceSpec("kv_consumer", d_http, d_kv, {**s.extra, "metrics_port": d_metrics}))
    colocated.add_vllm("colocated", InstanceSpec("", c_http))
    urls = {}
    # Both instances named with their KV addresses, as heartbeats would name them: the decode request goes alongside.
    instances = [f"127.0.0.1:{p_http}@127.0.0.1:{p_kv}"], [f"127.0.0.1:{d_http}@127.0.0.1:{d_kv}"]
    if "proxy" in fronts:
        disagg.add_proxy(proxy_port, *instances)
        urls["proxy"] = f"http://127.0.0.1:{proxy_port}"
    if "after" in fronts:
        disagg.add_proxy(after_port, *instances, args=("--decode-alongside", "off"), name="proxy-after")
        urls["after"] = f"http://127.0.0.1:{after_port}"
    if "router" in fronts:
        disagg.add_router(router_port, [f"http://127.0.0.1:{p_http}"], [f"http://127.0.0.1:{d_http}"])
        urls["router"] = f"http://127.0.0.1:{router_port}"
    local = "http://127.0.0.1:{}/metrics".format
    proxies = [local(port) for front, port in (("proxy", proxy_port), ("after", after_port)) if front in fronts]
    endpoints = Endpoints({"proxy": proxies, "prefill": [local(p_http)],
                           "decode": [local(d_http)], "kv": [local(p_metrics), local(d_metrics)],
                           "colocated": [local(c_http)]}, urls, f"http://127.0.0.1:{c_http}",
                          tuple(f"http://127.0.0.1:{port}" for port in (p_http, d_http, c_http)))
    clusters = [disagg, colocated] if fronts else [colocated]
    try:
        for cluster in clusters:  # every process starts at once; then each cluster is waited for
            cluster.log_dir.mkdir(parents=True, exist_ok=True)
            for proc in cluster.processes:
                proc.start()
        for cluster in clusters:
            cluster.start(progress=lambda line: print(f"[serve] {line}", flush=True))
        # Ready as `p2pkv up` says it: once the workers' KV caches are faulted in again in huge pages.
        if fronts:
            wait_for_huge_pages([p for p in disagg.processes if p.ranks],
                                progress=lambda line: print(f"[serve] {line}", flush=True))
    except BaseException:
        for cluster in clusters:
            cluster.stop()
        raise
    return clusters, endpoints


Run = tuple[dict[str, float], dict[str, float]]  # vLLM's benchmark results, the breakdown


def measure(s: ServeSettings, endpoints: Endpoints, fronts: Sequence[str],
            say: Callable[[str], None] = print) -> dict[str, list[Run]]:
    """`s.rounds` rounds of vLLM's benchmark, each the colocated instance then each front, on live instances."""
    from p2pkv.vllm.bench_serve import run_vllm_bench_serve

    order = ["colocated", *fronts]
    base = {"colocated": endpoints.colocated, **endpoints.fronts}
    if s.warmups:
        for name in order:
            say(f"[serve] warming up {name} ({s.warmups} requests)")
            endpoints.reset_caches()
            run_vllm_bench_serve(base[name], s.model, s.input_len, s.output_len, s.warmups, float("inf"), seed=99)
    runs: dict[str, list[Run]] = {name: [] for name in order}
    for r in range(s.rounds):
        # Each round starts with the next one: no front is always measured right after the same other one.
        for name in order[r % len(order):] + order[:r % len(order)]:
            time.sleep(IDLE_S)
            # The fronts of a round get the same prompts at the same moments (one seed), each run on empty prefix
            # caches: the fronts share the cluster's instances, which would otherwise hold the prompts already.
            endpoints.reset_caches()
            before = endpoints.scrape()
            result = run_vllm_bench_serve(base[name], s.model, s.input_len, s.output_len, s.num_prompts,
                                          s.request_rate, seed=1 + r)
            time.sleep(SETTLE_S)
            runs[name].append((result, breakdown(before, endpoints.scrape())))
            say(f"[serve] round {r + 1} {name}: TTFT mean {result.get('mean_ttft_ms', float('nan')):.1f} / median "
                f"{result.get('median_ttft_ms', float('nan')):.1f} / p99 {result.get('p99_ttft_ms', float('nan')):.1f}"
                f" ms, ITL mean {result.get('mean_itl_ms', float('nan')):.2f} ms, "
                f"{int(result.get('completed', 0))} completed")
    return runs


def median_of(runs: Sequence[Run], key: str) -> float:
    values = [result.get(key, float("nan")) for result, _ in runs]
    return statistics.median(values) if values else float("nan")


def table(runs: dict[str, list[Run]]) -> list[str]:
    """Medians over the rounds: one column per front with its ratio to colocated, then colocated."""
    fronts = [name for name in runs if name != "colocated"]
    lines = [f"{'metric (median of rounds)':<28}" + "".join(f"{FRONTS[f]:>17}{'ratio':>7}" for f in fronts)
             + f"{'colocated':>12}"]
    for label, key in ROWS:
        b = median_of(runs["colocated"], key)
        cells = "".join(f"{median_of(runs[f], key):>17.2f}{median_of(runs[f], key) / b if b else float('nan'):>7.2f}"
                        for f in fronts)
        lines.append(f"{label:<28}{cells}{b:>12.2f}")
    return lines


def breakdown_table(runs: dict[str, list[Run]]) -> list[str]:
    """Where a request's time to first token goes, per front (medians over rounds of each part's mean)."""
    names = list(runs)
    lines = [f"{'where TTFT goes (ms, mean per request)':<46}" + "".join(f"{n:>12}" for n in names)]
    for label, source, _ in PARTS:
        cells = []
        for name in names:
            # Each column from its own path: the cluster's instances also answer the proxy's probes meanwhile.
            ours = (source == "colocated") == (name == "colocated")
            values = [parts[label] for _, parts in runs[name] if ours and parts[label] == parts[label]]
            cells.append(f"{statistics.median(values):>12.2f}" if values else f"{'-':>12}")
        if any(c.strip() != "-" for c in cells):
            lines.append(f"{label:<46}" + "".join(cells))
    return lines


def verdicts(runs: dict[str, list[Run]]) -> tuple[list[str], bool]:
    """Each front's targets against colocated (medians over rounds), and rounds that disagree; whether all met."""
    lines, met = [], True
    colocated = runs["colocated"]
    for front in (name for name in runs if name != "colocated"):
        for label, key, limit in TARGETS:
            ratio = median_of(runs[front], key) / median_of(colocated, key)
            ok = ratio <= limit
            met &= ok or front in COMPARED
            lines.append(f"{'for comparison, no target: ' if front in COMPARED else ''}{FRONTS[front]}: {label} "
                         f"{ratio:.2f}x colocated (target <= {limit:g}x): {'met' if ok else 'NOT met'}")
    for name, front_runs in runs.items():
        means = [result.get("mean_ttft_ms", float("nan")) for result, _ in front_runs]
        if len(means) > 1 and min(means) > 0 and max(means) / min(means) > DISAGREE:
            lines.append(f"{name}: the rounds disagree: mean TTFT {', '.join(f'{m:.1f}' for m in means)} ms "
                         f"(more than {DISAGREE:g}x apart); take the medians with care")
    return lines, met


def write_plot(runs: dict[str, list[Run]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: Sequence[tuple[str, Sequence[tuple[str, str]]]] = (
        ("time to first token (ms)", (("mean", "mean_ttft_ms"), ("p99", "p99_ttft_ms"))),
        ("inter-token latency (ms)", (("mean", "mean_itl_ms"), ("p99", "p99_itl_ms"))),
        ("throughput", (("output tok/s", "output_throughput"),)),
    )
    series = [(FRONTS.get(name, name), front_runs) for name, front_runs in runs.items() if name != "colocated"]
    series.append(("colocated", runs["colocated"]))
    width = 0.8 / len(series)
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 3.8))
    for ax, (title, keys) in zip(axes, panels, strict=True):
        xs = range(len(keys))
        for n, (label, front_runs) in enumerate(series):
            ax.bar([x - 0.4 + width * (n + 0.5) for x in xs], [median_of(front_runs, k) for _, k in keys], width,
                   label=label)
        ax.set_xticks(list(xs), [label for label, _ in keys])
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle("p2pkv bench serve (vLLM's serving benchmark, one host; medians of rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def start_nixl(s: ServeSettings, log_dir: Path, colocated: str) -> tuple[Cluster, Endpoints]:
    """vLLM's NixlConnector 1P1D behind the standard-protocol router, beside the running colocated instance."""
    dev = {"VLLM_SERVER_DEV_MODE": "1"}
    nixl = Cluster(model=s.model, log_dir=log_dir / "nixl", extra_env=dev)
    p_http, p_side, d_http, d_side, router_port = free_ports(5)
    nixl.add_vllm("prefill", InstanceSpec("kv_producer", p_http, p_side, connector="nixl"))
    nixl.add_vllm("decode", InstanceSpec("kv_consumer", d_http, d_side, connector="nixl"))
    nixl.add_router(router_port, [f"http://127.0.0.1:{p_http}"], [f"http://127.0.0.1:{d_http}"])
    local = "http://127.0.0.1:{}/metrics".format
    endpoints = Endpoints({"prefill": [local(p_http)], "decode": [local(d_http)],
                           "colocated": [f"{colocated}/metrics"]},
                          {"nixl": f"http://127.0.0.1:{router_port}"}, colocated,
                          (f"http://127.0.0.1:{p_http}", f"http://127.0.0.1:{d_http}", colocated))
    try:
        nixl.start(progress=lambda line: print(f"[serve] {line}", flush=True))
    except BaseException:
        nixl.stop()
        raise
    return nixl, endpoints


def main(model: str | None, input_len: int, output_len: int, num_prompts: int, request_rate: float,
         plot: str, via: Sequence[str] = ("proxy", "router"), rounds: int = 3, warmups: int = 16,
         extra: dict[str, Any] | None = None) -> int:
    fronts = tuple(f for f in dict.fromkeys(via) if f not in PEERS)
    peers = tuple(f for f in dict.fromkeys(via) if f in PEERS)
    if "nixl" in peers and importlib.util.find_spec("nixl") is None:
        print("p2pkv bench serve: --via nixl needs NIXL, which is not installed here: pip install nixl")
        return 1
    model = resolve_model(model)
    s = ServeSettings(model, input_len, output_len, num_prompts, request_rate, rounds, warmups, extra or {})
    log_dir = Path(tempfile.mkdtemp(prefix="p2pkv-serve-"))
    clusters, endpoints = start(s, log_dir, fronts)
    peer_runs: dict[str, list[Run]] = {}
    try:
        runs = measure(s, endpoints, fronts) if fronts else {}
        if peers:
            if fronts:
                clusters.pop(0).stop()  # p2pkv's instances go: the peer runs on the same cores
            nixl, nixl_endpoints = start_nixl(s, log_dir, endpoints.colocated)
            clusters.append(nixl)
            peer_runs = measure(s, nixl_endpoints, peers)
    finally:
        for cluster in clusters:
            cluster.stop()
    print(f"random dataset: {input_len} input and {output_len} output tokens, {num_prompts} prompts at "
          f"{request_rate} requests/s, {rounds} rounds after {warmups} warm-up requests, measured from ready; "
          f"logs in {log_dir}")
    met = True
    lines: list[str] = []
    if runs:
        for line in [*table(runs), "", *breakdown_table(runs), ""]:
            print(line)
        lines, met = verdicts(runs)
    if peer_runs:
        print("peer, in a phase of its own against the colocated instance measured in that phase (no target):")
        for line in [*table(peer_runs), "", *breakdown_table(peer_runs), ""]:
            print(line)
        lines += [f"peer, no target: {line}" for line in verdicts(peer_runs)[0]]
    for line in lines:
        print(line)
    write_plot({**runs, **{name: r for name, r in peer_runs.items() if name != "colocated"}}
               if runs else peer_runs, Path(plot))
    print(f"plot written to {plot}")
    failed = sum(num_prompts - int(result.get("completed", 0))
                 for measured in (runs, peer_runs) for front in measured.values() for result, _ in front)
    if failed:
        print(f"{failed} requests failed")
    return 0 if met and not failed else 1
