"""p2pkv's transfers in vLLM's own statistics: the "KV Transfer metrics" log line and `vllm:p2pkv_*` series on
the instance's `/metrics`.

Each worker hands vLLM what its engine counted since the last step (`EngineMetrics.take_interval`); vLLM sums the
workers' intervals (`aggregate`), ships them to its front end as plain data, and there logs a summary every log
interval (`reduce`) and records them in its Prometheus registry (`P2pkvPromMetrics.observe`).
"""

from __future__ import annotations

import math
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from p2pkv.engine.metrics import StepStats

DIRECTIONS = ("send", "pull", "load")
BYTE_KINDS = ("sent", "received", "loaded")
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class P2pkvStats(KVConnectorStats):  # type: ignore[misc]
    """One interval's transfers, bytes and transfer times, summed over workers (`StepStats` data)."""

    def reset(self) -> None:
        self.data = StepStats().data

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return P2pkvStats(data=StepStats(self.data).merge(StepStats(other.data)).data)

    def is_empty(self) -> bool:
        return StepStats(self.data).empty()

    def reduce(self) -> dict[str, int | float]:
        """The log line's fields: transfers by direction and outcome, MB moved, and transfer times."""
        stats = StepStats(self.data)
        out: dict[str, int | float] = {}
        for key in sorted(stats.data["transfers"]):
            out[key.replace(" ", "s ", 1)] = stats.data["transfers"][key]
        for kind in BYTE_KINDS:
            if kind in stats.data["bytes"]:
                out[f"MB {kind}"] = round(stats.data["bytes"][kind] / 1e6, 3)
        for direction in DIRECTIONS:
            durations = sorted(stats.data["seconds"].get(direction, ()))
            if durations:
                out[f"avg {direction} ms"] = round(sum(durations) / len(durations) * 1000, 2)
                out[f"p90 {direction} ms"] = round(durations[math.ceil(0.9 * len(durations)) - 1] * 1000, 2)
        return out


class P2pkvPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """`vllm:p2pkv_transfers_total{direction,outcome}`, `vllm:p2pkv_bytes_total{kind}` and
    `vllm:p2pkv_transfer_seconds{direction}`, next to vLLM's own labels (model name, engine index)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = list(labelnames)
        self._transfers = self._counter_cls(name="vllm:p2pkv_transfers", documentation="p2pkv transfers finished, "
                                            "by direction (send, pull, load) and outcome",
                                            labelnames=[*names, "direction", "outcome"])
        self._bytes = self._counter_cls(name="vllm:p2pkv_bytes", documentation="KV bytes p2pkv sent, received, "
                                        "or loaded into the paged cache", labelnames=[*names, "kind"])
        self._seconds = self._histogram_cls(name="vllm:p2pkv_transfer_seconds", documentation="Time per p2pkv "
                                            "transfer: a push (send) or a pull", buckets=list(SECONDS_BUCKETS),
                                            labelnames=[*names, "direction"])
        self._children: dict[tuple[int, str, tuple[str, ...]], Any] = {}

    def _child(self, metric: Any, name: str, engine_idx: int, *labels: str) -> Any:
        key = (engine_idx, name, labels)
        child = self._children.get(key)
        if child is None:
            values = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
            child = self._children[key] = metric.labels(*values, *labels)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = StepStats(transfer_stats_data)
        for key, n in stats.data["transfers"].items():
            direction, _, outcome = key.partition(" ")
            self._child(self._transfers, "transfers", engine_idx, direction, outcome).inc(n)
        for kind, n in stats.data["bytes"].items():
            self._child(self._bytes, "bytes", engine_idx, kind).inc(n)
        for direction, durations in stats.data["seconds"].items():
            histogram = self._child(self._seconds, "seconds", engine_idx, direction)
            for seconds in durations:
                histogram.observe(seconds)
