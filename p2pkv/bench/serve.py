"""`p2pkv bench serve`: vLLM's serving benchmark against a local 1P1D cluster and against one colocated instance of
the same model, one after the other on this host; time to first token, inter-token latency and throughput side by
side, with the mean KV transfer time per request from p2pkv's metrics, and a PNG plot.

The cluster is measured through each front asked for (`--via`), one after the other on the same instances: p2pkv's
proxy (it names the decode instance: the prefill side pushes), and a router of vLLM's standard disaggregation
protocol (`p2pkv.bench.router`: it names none, so the decode side always pulls)."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from p2pkv.cli.cluster import Cluster, InstanceSpec, free_ports, wait_for_huge_pages
from p2pkv.models import resolve_model


@dataclass(frozen=True)
class ServeSettings:
    model: str
    input_len: int = 512
    output_len: int = 32
    num_prompts: int = 64
    request_rate: float = 4.0


FRONTS = {"proxy": "1P1D via proxy", "router": "1P1D via router"}
ROWS = (("mean TTFT (ms)", "mean_ttft_ms"), ("median TTFT (ms)", "median_ttft_ms"), ("p99 TTFT (ms)", "p99_ttft_ms"),
        ("mean ITL (ms)", "mean_itl_ms"), ("p99 ITL (ms)", "p99_itl_ms"), ("mean TPOT (ms)", "mean_tpot_ms"),
        ("output tokens/s", "output_throughput"), ("requests/s", "request_throughput"),
        ("completed requests", "completed"))


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


def bench_disaggregated(s: ServeSettings, log_dir: Path,
                        fronts: Sequence[str] = ("proxy",)) -> dict[str, tuple[dict[str, float], float]]:
    """Results through each of `fronts` in front of one 1P1D cluster, each with its mean transfer time (ms)."""
    from p2pkv.vllm.bench_serve import run_vllm_bench_serve

    cluster = Cluster(model=s.model, log_dir=log_dir / "disaggregated")
    p_http, p_kv, p_metrics, d_http, d_kv, d_metrics, proxy_port, router_port = free_ports(8)
    instances = [cluster.add_vllm("prefill", InstanceSpec("kv_producer", p_http, p_kv, {"metrics_port": p_metrics})),
                 cluster.add_vllm("decode", InstanceSpec("kv_consumer", d_http, d_kv, {"metrics_port": d_metrics}))]
    urls = {}
    if "proxy" in fronts:
        cluster.add_proxy(proxy_port, [f"127.0.0.1:{p_http}"], [f"127.0.0.1:{d_http}@127.0.0.1:{d_kv}"])
        urls["proxy"] = f"http://127.0.0.1:{proxy_port}"
    if "router" in fronts:
        cluster.add_router(router_port, [f"http://127.0.0.1:{p_http}"], [f"http://127.0.0.1:{d_http}"])
        urls["router"] = f"http://127.0.0.1:{router_port}"
    metrics = [f"http://127.0.0.1:{port}/metrics" for port in (p_metrics, d_metrics)]
    out = {}
    try:
        cluster.start(progress=lambda line: print(f"[serve] {line}", flush=True))
        # The colocated instance has no connector: nothing of its own on the host while it is measured.
        wait_for_huge_pages(instances, progress=lambda line: print(f"[serve] {line}", flush=True))
        for front in fronts:
            print(f"[serve] through the {front}", flush=True)
            before = _transfer_seconds(metrics)
            result = run_vllm_bench_serve(urls[front], s.model, s.input_len, s.output_len, s.num_prompts,
                                          s.request_rate)
            after = _transfer_seconds(metrics)
            transfers = after[1] - before[1]
            out[front] = result, (after[0] - before[0]) / transfers * 1000 if transfers else float("nan")
        return out
    finally:
        cluster.stop()


def bench_colocated(s: ServeSettings, log_dir: Path) -> dict[str, float]:
    from p2pkv.vllm.bench_serve import run_vllm_bench_serve

    cluster = Cluster(model=s.model, log_dir=log_dir / "colocated")
    (port,) = free_ports(1)
    cluster.add_vllm("colocated", InstanceSpec("", port))
    try:
        cluster.start(progress=lambda line: print(f"[serve] {line}", flush=True))
        return run_vllm_bench_serve(f"http://127.0.0.1:{port}", s.model, s.input_len, s.output_len, s.num_prompts,
                                    s.request_rate)
    finally:
        cluster.stop()


def table(disagg: dict[str, tuple[dict[str, float], float]], colocated: dict[str, float]) -> list[str]:
    """One column per front and the colocated one, each front's ratio to colocated after it."""
    head = f"{'metric':<26}" + "".join(f"{FRONTS[f]:>17}{'ratio':>7}" for f in disagg) + f"{'colocated':>12}"
    lines = [head]
    for label, key in ROWS:
        b = colocated.get(key, float("nan"))
        cells = []
        for result, _ in disagg.values():
            a = result.get(key, float("nan"))
            cells.append(f"{a:>17.2f}{(a / b if b else float('nan')):>7.2f}")
        lines.append(f"{label:<26}" + "".join(cells) + f"{b:>12.2f}")
    lines.append(f"{'mean KV transfer (ms)':<26}" + "".join(f"{ms:>17.2f}{'':>7}" for _, ms in disagg.values())
                 + f"{'-':>12}")
    return lines


def write_plot(disagg: dict[str, tuple[dict[str, float], float]], colocated: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: Sequence[tuple[str, Sequence[tuple[str, str]]]] = (
        ("time to first token (ms)", (("mean", "mean_ttft_ms"), ("p99", "p99_ttft_ms"))),
        ("inter-token latency (ms)", (("mean", "mean_itl_ms"), ("p99", "p99_itl_ms"))),
        ("throughput", (("output tok/s", "output_throughput"),)),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 3.8))
    series = [(FRONTS[front], result) for front, (result, _) in disagg.items()] + [("colocated", colocated)]
    width = 0.8 / len(series)
    for ax, (title, keys) in zip(axes, panels, strict=True):
        xs = range(len(keys))
        for n, (label, result) in enumerate(series):
            ax.bar([x - 0.4 + width * (n + 0.5) for x in xs], [result.get(k, 0.0) for _, k in keys], width,
                   label=label)
        ax.set_xticks(list(xs), [label for label, _ in keys])
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle("p2pkv bench serve (vLLM's serving benchmark, one host)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(model: str | None, input_len: int, output_len: int, num_prompts: int, request_rate: float,
         plot: str, via: Sequence[str] = ("proxy", "router")) -> int:
    model = resolve_model(model)
    s = ServeSettings(model, input_len, output_len, num_prompts, request_rate)
    log_dir = Path(tempfile.mkdtemp(prefix="p2pkv-serve-"))
    disagg = bench_disaggregated(s, log_dir, tuple(dict.fromkeys(via)))
    colocated = bench_colocated(s, log_dir)
    print(f"random dataset: {input_len} input and {output_len} output tokens, {num_prompts} prompts, "
          f"{request_rate} requests/s; logs in {log_dir}")
    for line in table(disagg, colocated):
        print(line)
    write_plot(disagg, colocated, Path(plot))
    print(f"plot written to {plot}")
    failed = sum(num_prompts - int(result.get("completed", 0)) for result, _ in disagg.values())
    return 1 if failed else 0
