"""`p2pkv bench serve`: vLLM's serving benchmark against a local 1P1D cluster (through the proxy) and against one
colocated instance of the same model, one after the other on this host; time to first token, inter-token latency
and throughput side by side, with the mean KV transfer time per request from p2pkv's metrics, and a PNG plot."""

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


def bench_disaggregated(s: ServeSettings, log_dir: Path) -> tuple[dict[str, float], float]:
    """Results through the proxy of a 1P1D cluster, and the mean transfer time per request in ms."""
    from p2pkv.vllm.bench_serve import run_vllm_bench_serve

    cluster = Cluster(model=s.model, log_dir=log_dir / "disaggregated")
    p_http, p_kv, p_metrics, d_http, d_kv, proxy_port = free_ports(6)
    instances = [cluster.add_vllm("prefill", InstanceSpec("kv_producer", p_http, p_kv, {"metrics_port": p_metrics})),
                 cluster.add_vllm("decode", InstanceSpec("kv_consumer", d_http, d_kv))]
    cluster.add_proxy(proxy_port, [f"127.0.0.1:{p_http}"], [f"127.0.0.1:{d_http}@127.0.0.1:{d_kv}"])
    try:
        cluster.start(progress=lambda line: print(f"[serve] {line}", flush=True))
        # The colocated instance has no connector: nothing of its own on the host while it is measured.
        wait_for_huge_pages(instances, progress=lambda line: print(f"[serve] {line}", flush=True))
        metrics = f"http://127.0.0.1:{p_metrics}/metrics"
        before = histogram_sum_count(httpx.get(metrics, timeout=10).text, "p2pkv_transfer_seconds")
        result = run_vllm_bench_serve(f"http://127.0.0.1:{proxy_port}", s.model, s.input_len, s.output_len,
                                      s.num_prompts, s.request_rate)
        after = histogram_sum_count(httpx.get(metrics, timeout=10).text, "p2pkv_transfer_seconds")
        transfers = after[1] - before[1]
        transfer_ms = (after[0] - before[0]) / transfers * 1000 if transfers else float("nan")
        return result, transfer_ms
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


def table(disagg: dict[str, float], colocated: dict[str, float], transfer_ms: float) -> list[str]:
    lines = [f"{'metric':<26}{'1P1D via proxy':>16}{'colocated':>14}{'ratio':>8}"]
    for label, key in ROWS:
        a, b = disagg.get(key, float("nan")), colocated.get(key, float("nan"))
        ratio = a / b if b else float("nan")
        lines.append(f"{label:<26}{a:>16.2f}{b:>14.2f}{ratio:>8.2f}")
    lines.append(f"{'mean KV transfer (ms)':<26}{transfer_ms:>16.2f}{'-':>14}")
    return lines


def write_plot(disagg: dict[str, float], colocated: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: Sequence[tuple[str, Sequence[tuple[str, str]]]] = (
        ("time to first token (ms)", (("mean", "mean_ttft_ms"), ("p99", "p99_ttft_ms"))),
        ("inter-token latency (ms)", (("mean", "mean_itl_ms"), ("p99", "p99_itl_ms"))),
        ("throughput", (("output tok/s", "output_throughput"),)),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 3.8))
    for ax, (title, keys) in zip(axes, panels, strict=True):
        xs = range(len(keys))
        ax.bar([x - 0.2 for x in xs], [disagg.get(k, 0.0) for _, k in keys], 0.4, label="1P1D via proxy")
        ax.bar([x + 0.2 for x in xs], [colocated.get(k, 0.0) for _, k in keys], 0.4, label="colocated")
        ax.set_xticks(list(xs), [label for label, _ in keys])
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle("p2pkv bench serve (vLLM's serving benchmark, one host)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(model: str | None, input_len: int, output_len: int, num_prompts: int, request_rate: float,
         plot: str) -> int:
    model = resolve_model(model)
    s = ServeSettings(model, input_len, output_len, num_prompts, request_rate)
    log_dir = Path(tempfile.mkdtemp(prefix="p2pkv-serve-"))
    disagg, transfer_ms = bench_disaggregated(s, log_dir)
    colocated = bench_colocated(s, log_dir)
    print(f"random dataset: {input_len} input and {output_len} output tokens, {num_prompts} prompts, "
          f"{request_rate} requests/s; logs in {log_dir}")
    for line in table(disagg, colocated, transfer_ms):
        print(line)
    write_plot(disagg, colocated, Path(plot))
    print(f"plot written to {plot}")
    failed = num_prompts - int(disagg.get("completed", 0))
    return 1 if failed else 0
