"""The proxy's subscriptions to its instances' KV cache events: one ZMQ SUB socket per instance that announces an
endpoint (`Heartbeat.kv_events`), read by one asyncio task that feeds the `PrefixIndex`.

Subscriptions follow the pools: a new instance is subscribed to, one that is gone (or restarted: another engine id
or start) is dropped with its blocks. The proxy only connects where the heartbeat's sender is: a tcp endpoint on
the instance's own host, an ipc path only for an instance on loopback (the same host). A batch that is not one is
counted and skipped; nothing an instance publishes can stop the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from p2pkv.hostaddr import is_loopback, local_ip_towards
from p2pkv.proxy.metrics import ProxyMetrics
from p2pkv.proxy.prefixes import PrefixIndex
from p2pkv.proxy.registry import InstanceState

log = logging.getLogger(__name__)
MAX_BATCH_BYTES = 4 << 20  # a larger message drops the publisher's connection (ZMQ reconnects)
QUEUED_BATCHES = 64  # per instance, waiting to be read: what a publisher can make the proxy hold is bounded
SYNC_S = 0.5  # how often subscriptions are matched with the pools
BATCHES_PER_TURN = 64  # read from one socket before the event loop serves anything else
BAD_LOG_S = 60.0


def subscribable(endpoint: str, host: str) -> bool:
    """Whether the proxy may connect to `endpoint`, announced by an instance at `host`: a tcp endpoint on that host,
    an ipc one only for an instance on this host."""
    if endpoint.startswith("ipc://"):
        return is_loopback(host) or local_ip_towards(host.strip("[]")) == host.strip("[]")
    if not endpoint.startswith("tcp://"):
        return False
    where = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
    return where == host.strip("[]")


@dataclass
class _Feed:
    endpoint: str
    engine: str  # engine id and start: another one means the instance restarted, its cache empty
    sock: zmq.asyncio.Socket


class EventFeeds:
    def __init__(self, index: PrefixIndex, metrics: ProxyMetrics, states: Callable[[], list[InstanceState]]) -> None:
        self.index = index
        self.metrics = metrics
        self._states = states
        self._ctx = zmq.asyncio.Context()
        self._feeds: dict[str, _Feed] = {}
        self._bad_logged = -BAD_LOG_S
        self._bad = 0
        self._refused: set[tuple[str, str]] = set()  # (instance, endpoint) not subscribed to, logged once each

    def sync(self) -> None:
        """Subscribe to each instance's announced endpoint; drop those gone, moved or restarted."""
        wanted: dict[str, tuple[str, str]] = {}
        for state in self._states():
            endpoint, name = state.kv_events, state.instance.name
            if not endpoint:
                continue
            if subscribable(endpoint, state.instance.http.host):
                wanted[name] = endpoint, f"{state.engine_id}/{state.launch}"
            elif (name, endpoint) not in self._refused and len(self._refused) < 4096:
                self._refused.add((name, endpoint))
                log.warning("KV events of %s: not subscribing to %s, which is not on the instance's host; it is "
                            "routed by load", name, endpoint)
        for name, feed in list(self._feeds.items()):
            if wanted.get(name) != (feed.endpoint, feed.engine):
                feed.sock.close(linger=0)
                del self._feeds[name]
                self.index.forget(name)
                with contextlib.suppress(KeyError):
                    self.metrics.index_blocks.remove(name)
                log.info("KV events of %s: unsubscribed from %s", name, feed.endpoint)
        for name, (endpoint, engine) in wanted.items():
            if name in self._feeds:
                continue
            sock = self._ctx.socket(zmq.SUB)
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
                sock.setsockopt(zmq.RCVHWM, QUEUED_BATCHES)
                if endpoint.startswith("tcp://["):
                    sock.setsockopt(zmq.IPV6, 1)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.connect(endpoint)
            except Exception as exc:  # whatever an endpoint holds, the others are still followed
                sock.close(linger=0)
                if (name, endpoint) not in self._refused and len(self._refused) < 4096:
                    self._refused.add((name, endpoint))
                    log.warning("KV events of %s: cannot subscribe to %r (%r)", name, endpoint[:200], exc)
                continue
            self.index.forget(name)  # a new subscription starts from an empty cache view
            self._feeds[name] = _Feed(endpoint, engine, sock)
            log.info("KV events of %s: subscribed to %s", name, endpoint)
        for name in self._feeds:
            blocks = self.index.instances.get(name)
            self.metrics.index_blocks.labels(name).set(blocks.size if blocks is not None else 0)

    def take(self, name: str, frames: list[bytes]) -> None:
        """One message from instance `name`'s publisher: (topic, sequence number, batch)."""
        try:
            if len(frames) != 3 or len(frames[1]) != 8:
                raise ValueError(f"expected (topic, sequence, batch), got {len(frames)} frames")
            applied, skipped = self.index.apply(name, int.from_bytes(frames[1], "big"), frames[2])
        except Exception as exc:  # nothing an instance publishes may stop the others' events
            self._skipped(name, 1, f"a batch: {exc!r:.200}")
            return
        self.metrics.kv_events.labels(name, "applied").inc(applied)
        if skipped:
            self._skipped(name, skipped, f"{skipped} events: {self.index.last_error}")

    def _skipped(self, name: str, count: int, what: str) -> None:
        self._bad += count
        self.metrics.kv_events.labels(name, "bad").inc(count)
        now = time.monotonic()
        if now - self._bad_logged >= BAD_LOG_S:
            self._bad_logged = now
            log.warning("KV events of %s: skipped %s (%d skipped so far)", name, what, self._bad)

    async def _turn(self) -> None:
        """Subscriptions matched with the pools, then what arrived within `SYNC_S` read."""
        self.sync()
        if not self._feeds:
            await asyncio.sleep(SYNC_S)
            return
        poller = zmq.asyncio.Poller()
        by_sock = {}
        for name, feed in self._feeds.items():
            poller.register(feed.sock, zmq.POLLIN)
            by_sock[feed.sock] = name
        ready = await poller.poll(int(SYNC_S * 1000))
        for sock, _ in ready:
            name = by_sock[sock]
            for _ in range(BATCHES_PER_TURN):  # then the others and the sync get their turn
                try:
                    frames = await sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.take(name, frames)
                await asyncio.sleep(0)  # a finished future does not yield: requests are served between batches

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self._turn()
                except asyncio.CancelledError:
                    raise
                except Exception:  # the subscriptions outlive any one failure; logged, then on
                    now = time.monotonic()
                    if now - self._bad_logged >= BAD_LOG_S:
                        self._bad_logged = now
                        log.exception("KV events: reading failed; going on")
                    await asyncio.sleep(SYNC_S)
        finally:
            for feed in self._feeds.values():
                feed.sock.close(linger=0)
            self._feeds.clear()
            self._ctx.term()
