"""Prometheus metrics of one engine, in a registry of its own (no module-level state)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass
class EngineMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.bytes_sent = Counter("p2pkv_bytes_sent", "KV bytes pushed to peers", ["transport"], registry=r)
        self.bytes_received = Counter("p2pkv_bytes_received", "KV bytes received from peers", ["transport"],
                                      registry=r)
        self.bytes_loaded = Counter("p2pkv_bytes_loaded", "KV bytes written into the paged cache", registry=r)
        self.transfers = Counter("p2pkv_transfers", "Finished transfers", ["direction", "outcome"], registry=r)
        self.bad_frames = Counter("p2pkv_bad_frames", "Malformed or unauthenticated frames dropped", registry=r)
        self.refused_connections = Counter("p2pkv_refused_connections", "Peer connections closed as they came: the "
                                           "connection cap reached (cap), no thread to serve one (no_thread), or "
                                           "accept failed (accept)", ["reason"], registry=r)
        self.foreign_frames = Counter("p2pkv_foreign_frames", "Frames naming a transfer that another connection "
                                      "began, ignored (that transfer goes on)", ["frame"], registry=r)
        self.refused_peers = Counter("p2pkv_refused_peers", "Peers refused at the handshake", registry=r)
        self.staging_bytes = Gauge("p2pkv_staging_bytes", "Bytes of received KV waiting to be loaded", registry=r)
        self.pool_bytes = Gauge("p2pkv_pool_bytes", "Bytes of the host pool holding staged KV", registry=r)
        self.device_copy_bytes = Counter("p2pkv_device_copy_bytes", "KV bytes copied between the device's cache "
                                         "and host buffers (GPU KV)", ["direction"], registry=r)
        self.pipes = Counter("p2pkv_pipes", "Pipes (communicators with one peer each, nccl) set up",
                             ["kind", "outcome"], registry=r)
        self.digests = Counter("p2pkv_digests", "Payloads checked against the sender's digest (integrity_check); "
                               "a mismatch drops the transfer", ["direction", "outcome"], registry=r)
        self.lease_renewals = Counter("p2pkv_lease_renewals", "Transfers whose blocks a decode side asked a prefill "
                                      "side to keep for its waiting requests (asked), and those kept here "
                                      "(renewed)", ["outcome"], registry=r)
        self.computed_here = Counter("p2pkv_requests_computed_here", "Requests that loaded nothing for want of p2pkv "
                                     "params: none, another connector's (foreign), or prefill params at a decode "
                                     "instance (prefill)", ["reason"], registry=r)
        self.transfer_seconds = Histogram("p2pkv_transfer_seconds", "Time per transfer: a push (send) or a pull",
                                          ["direction"], registry=r)
        self._lock = threading.Lock()
        self._totals: dict[str, float] = {}
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._interval = StepStats()
        self.intervals = False  # set by a caller that takes intervals (vLLM's worker, every step)

    def of(self, metric: Counter | Gauge | Histogram, *labels: str) -> Any:
        """The series of `metric` for these label values, looked up once: prometheus_client's `labels` checks its
        arguments and takes a lock on every call, and the engine's threads count every transfer."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:  # two threads may both get here: `labels` gives both the same series
            child = self._children[key] = metric.labels(*labels)
        return child

    def count_transfer(self, direction: str, outcome: str, seconds: float | None = None) -> None:
        """One finished transfer: `send` (a push), `pull`, or `load` (into the paged cache)."""
        self.of(self.transfers, direction, outcome).inc()
        if seconds is not None:
            self.of(self.transfer_seconds, direction).observe(seconds)
        if self.intervals:
            with self._lock:
                self._interval.transfer(direction, outcome, seconds)

    def count_bytes(self, kind: str, nbytes: int, transport: str = "") -> None:
        """KV bytes `sent` or `received` (over `transport`), or `loaded` into the paged cache."""
        if kind == "loaded":
            self.bytes_loaded.inc(nbytes)
        else:
            self.of(self.bytes_sent if kind == "sent" else self.bytes_received, transport).inc(nbytes)
        with self._lock:
            self._totals[f"bytes_{kind}"] = self._totals.get(f"bytes_{kind}", 0.0) + nbytes
            if self.intervals:
                self._interval.add_bytes(kind, nbytes)

    def take_interval(self) -> dict[str, Any] | None:
        """What was counted since the last call (vLLM's per-step connector stats), or None when nothing was."""
        with self._lock:
            if self._interval.empty():
                return None
            taken, self._interval = self._interval, StepStats()
        return taken.data

    def count_digest(self, direction: str, ok: bool) -> None:
        self.of(self.digests, direction, "ok" if ok else "mismatch").inc()
        self.add("digests_ok" if ok else "digest_mismatches", 1)

    def add(self, name: str, amount: float) -> None:
        """Plain totals for tests and logs, next to the Prometheus series."""
        with self._lock:
            self._totals[name] = self._totals.get(name, 0.0) + amount

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._totals)


class StepStats:
    """Transfers and bytes counted over an interval, as plain data (it crosses processes as vLLM's connector stats):
    `transfers` maps "direction outcome" to a count, `bytes` maps sent/received/loaded to a sum, and `seconds`
    maps a direction to the durations of its transfers (the first MAX_DURATIONS of them: taken every step, an
    interval holds few)."""

    MAX_DURATIONS = 4096

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        self.data: dict[str, Any] = data if data is not None else {}
        for key in ("transfers", "bytes", "seconds"):
            self.data.setdefault(key, {})

    def empty(self) -> bool:
        return not (self.data["transfers"] or self.data["bytes"])

    def transfer(self, direction: str, outcome: str, seconds: float | None) -> None:
        counts = self.data["transfers"]
        key = f"{direction} {outcome}"
        counts[key] = counts.get(key, 0) + 1
        if seconds is not None:
            durations = self.data["seconds"].setdefault(direction, [])
            if len(durations) < self.MAX_DURATIONS:
                durations.append(seconds)

    def add_bytes(self, kind: str, nbytes: int) -> None:
        sums = self.data["bytes"]
        sums[kind] = sums.get(kind, 0) + nbytes

    def merge(self, other: StepStats) -> StepStats:
        """Both intervals' counts in a new object (the data of either is left alone)."""
        out = StepStats()
        for part in (self.data, other.data):
            for key, n in part["transfers"].items():
                out.data["transfers"][key] = out.data["transfers"].get(key, 0) + n
            for key, n in part["bytes"].items():
                out.data["bytes"][key] = out.data["bytes"].get(key, 0) + n
            for key, durations in part["seconds"].items():
                out.data["seconds"].setdefault(key, []).extend(durations)
        return out
