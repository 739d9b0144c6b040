"""p2pkv's transfers in vLLM's statistics: the engine's per-step intervals, their sums over workers, the log line's
fields, and the Prometheus series vLLM's front end records."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from p2pkv.engine.metrics import EngineMetrics, StepStats
from p2pkv.vllm.connector import P2pNcclConnector
from p2pkv.vllm.stats import P2pkvPromMetrics, P2pkvStats


def _counted(metrics: EngineMetrics) -> None:
    metrics.count_transfer("send", "ok", 0.010)
    metrics.count_transfer("send", "ok", 0.030)
    metrics.count_transfer("send", "failed", 0.500)
    metrics.count_transfer("load", "ok")
    metrics.count_bytes("sent", 1000, "shm")
    metrics.count_bytes("loaded", 600)


def test_an_interval_holds_what_was_counted_since_the_last_one() -> None:
    metrics = EngineMetrics()
    metrics.intervals = True
    assert metrics.take_interval() is None
    _counted(metrics)
    data = metrics.take_interval()
    assert data == {"transfers": {"send ok": 2, "send failed": 1, "load ok": 1},
                    "bytes": {"sent": 1000, "loaded": 600},
                    "seconds": {"send": [0.010, 0.030, 0.500]}}
    assert metrics.take_interval() is None  # taken: the next interval starts empty
    metrics.count_bytes("received", 5, "tcp")
    assert metrics.take_interval() == {"transfers": {}, "bytes": {"received": 5}, "seconds": {}}
    # The engine's own series count the same things.
    assert metrics.totals()["bytes_sent"] == 1000 and metrics.totals()["bytes_loaded"] == 600
    assert metrics.of(metrics.transfers, "send", "ok")._value.get() == 2


def test_no_intervals_are_kept_unless_someone_takes_them() -> None:
    """The engine outside vLLM (benchmarks, tests) counts its Prometheus series only."""
    metrics = EngineMetrics()
    _counted(metrics)
    metrics.intervals = True
    assert metrics.take_interval() is None
    assert metrics.totals()["bytes_sent"] == 1000


def test_an_interval_keeps_a_bounded_number_of_durations() -> None:
    stats = StepStats()
    for _ in range(StepStats.MAX_DURATIONS + 10):
        stats.transfer("pull", "ok", 0.001)
    assert stats.data["transfers"]["pull ok"] == StepStats.MAX_DURATIONS + 10
    assert len(stats.data["seconds"]["pull"]) == StepStats.MAX_DURATIONS


def test_workers_intervals_sum_and_the_log_line_summarises_them() -> None:
    a, b = EngineMetrics(), EngineMetrics()
    a.intervals = b.intervals = True
    _counted(a)
    b.count_transfer("send", "ok", 0.020)
    b.count_bytes("sent", 500, "tcp")
    first, second = a.take_interval(), b.take_interval()
    assert first is not None and second is not None
    summed = P2pkvStats(data=first).aggregate(P2pkvStats(data=second))
    assert summed.data == {"transfers": {"send ok": 3, "send failed": 1, "load ok": 1},
                           "bytes": {"sent": 1500, "loaded": 600},
                           "seconds": {"send": [0.010, 0.030, 0.500, 0.020]}}
    assert first["transfers"]["send ok"] == 2  # the parts are left alone
    assert summed.reduce() == {"loads ok": 1, "sends failed": 1, "sends ok": 3, "MB sent": 0.002, "MB loaded": 0.001,
                               "avg send ms": 140.0, "p90 send ms": 500.0}
    assert not summed.is_empty()
    summed.reset()
    assert summed.is_empty()


def test_the_connector_class_builds_its_stats_from_the_data_vllm_ships() -> None:
    """vLLM's front end rebuilds the stats from plain data through the connector class, and logs nothing from an
    empty one."""
    stats = P2pNcclConnector.build_kv_connector_stats({"transfers": {"pull ok": 1}, "bytes": {}, "seconds": {}})
    assert isinstance(stats, P2pkvStats) and stats.reduce() == {"pulls ok": 1}
    assert P2pNcclConnector.build_kv_connector_stats(None).is_empty()


def test_prometheus_series_carry_vllms_labels_and_ours() -> None:
    registry = CollectorRegistry()
    types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    prom = P2pkvPromMetrics(config, types, ["model_name", "engine"], {0: ["m", 0], 1: ["m", 1]})
    metrics = EngineMetrics()
    metrics.intervals = True
    _counted(metrics)
    data = metrics.take_interval()
    assert data is not None
    prom.observe(data, 1)
    prom.observe(data, 1)
    labels = {"model_name": "m", "engine": "1"}
    value = registry.get_sample_value
    assert value("vllm:p2pkv_transfers_total", {**labels, "direction": "send", "outcome": "ok"}) == 4
    assert value("vllm:p2pkv_transfers_total", {**labels, "direction": "load", "outcome": "ok"}) == 2
    assert value("vllm:p2pkv_bytes_total", {**labels, "kind": "loaded"}) == 1200
    assert value("vllm:p2pkv_transfer_seconds_count", {**labels, "direction": "send"}) == 6
    assert value("vllm:p2pkv_transfer_seconds_bucket", {**labels, "direction": "send", "le": "0.025"}) == 2
    assert value("vllm:p2pkv_transfers_total", {"model_name": "m", "engine": "0", "direction": "send",
                                                "outcome": "ok"}) is None
