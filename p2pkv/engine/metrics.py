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
        self.transfer_seconds = Histogram("p2pkv_transfer_seconds", "Push time per transfer", ["direction"],
                                          registry=r)
        self._lock = threading.Lock()
        self._totals: dict[str, float] = {}
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def of(self, metric: Counter | Gauge | Histogram, *labels: str) -> Any:
        """The series of `metric` for these label values, looked up once: prometheus_client's `labels` checks its
        arguments and takes a lock on every call, and the engine's threads count every transfer."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:  # two threads may both get here: `labels` gives both the same series
            child = self._children[key] = metric.labels(*labels)
        return child

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
