"""The instance side of discovery: one owned thread announcing this instance to the proxy every interval.

An instance announces itself only while its own OpenAI server answers `/health`, so the proxy never routes to
an instance that is still loading its model. Sends never block: with the proxy down, heartbeats are dropped.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence

import msgspec
import zmq

from p2pkv.config import ConnectorConfig, HeartbeatFormat, Role
from p2pkv.engine.refused import Refusal
from p2pkv.errors import ConfigError
from p2pkv.params import Address
from p2pkv.protocol import Heartbeat, PeerRefused, encode_datagram
from p2pkv.transport.threads import engine_thread

log = logging.getLogger(__name__)
# A heartbeat names this many refused peers at most (the latest), each reason cut to this many bytes: a
# heartbeat must fit the proxy's bound (`MAX_ANNOUNCEMENT_BYTES`).
MAX_REFUSED = 8
MAX_REASON_BYTES = 160
# Refusals older than this are not said: the proxy pairs the instances again a minute after a refusal (a pair still
# refused is refused afresh then), so an old one names a peer that is gone.
MAX_REFUSAL_AGE_S = 600.0


def refused_in_beat(notes: Mapping[str, Refusal], now: float) -> tuple[PeerRefused, ...]:
    """The latest `MAX_REFUSED` refusals of the last `MAX_REFUSAL_AGE_S` as a heartbeat says them, the latest
    first."""
    recent = [(address, note) for address, note in notes.items() if now - note.at <= MAX_REFUSAL_AGE_S]
    latest = sorted(recent, key=lambda item: item[1].at, reverse=True)[:MAX_REFUSED]
    return tuple(PeerRefused(address, note.reason.encode()[:MAX_REASON_BYTES].decode(errors="ignore"),
                             round(max(0.0, now - note.at), 1), note.launch) for address, note in latest)


class HeartbeatSender:
    def __init__(self, proxy: Address | Sequence[Address], role: str, http: Address, kv: Address, interval_s: float,
                 secret: bytes, tp_size: int = 0, pp_size: int = 0, legacy: bool = False,
                 dp_rank: int | None = None, pulls: bool = False, launch: str = "", kv_events: str = "") -> None:
        """`proxy`: one proxy or several (each gets every heartbeat: proxies side by side, for availability).
        `legacy`: announce in the old connector's format, for its proxy (prefill or decode only, unsigned).
        `dp_rank`: the data-parallel rank this engine is reached by through the instance's API server. `pulls`: a
        decode instance that takes its KV by pulls. `launch`: this start of the instance. `kv_events`: where its
        vLLM publishes KV cache events, for prefix-aware routing."""
        self.proxies = (proxy,) if isinstance(proxy, Address) else tuple(proxy)
        self.message = Heartbeat(role, str(http), str(kv), interval_s, uuid.uuid4().hex, tp_size, pp_size,
                                 -1 if dp_rank is None else dp_rank, pulls=pulls, launch=launch,
                                 kv_events=kv_events)
        self._legacy = msgspec.msgpack.encode({"type": _LEGACY_TYPES[role], "http_address": str(http),
                                               "zmq_address": str(kv)}) if legacy else b""
        self.interval_s = interval_s
        self._refusals: Mapping[str, Refusal] = {}  # replaced whole by `note_refusals`, read by the thread
        self._secret = secret
        self._health_url = f"http://{http}/health"
        self._stop = threading.Event()
        self._thread = engine_thread(self._run, "p2pkv-heartbeat")
        self.sent = 0

    def start(self) -> None:
        rank = f" data-parallel rank {self.message.dp_rank}" if self.message.dp_rank >= 0 else ""
        log.info("announcing %s %s%s (KV %s) to the proxy at %s every %.1f s", self.message.role,
                 self.message.http_address, rank, self.message.kv_address, ", ".join(map(str, self.proxies)),
                 self.interval_s)
        self._thread.start()

    def note_refusals(self, notes: Mapping[str, Refusal]) -> None:
        """The workers' refusals now (`RefusedPeers` of each, merged): later heartbeats say them."""
        self._refusals = dict(notes)

    def beat(self) -> bytes:
        """The next heartbeat's bytes."""
        if self._legacy:
            return self._legacy
        refused = refused_in_beat(self._refusals, time.monotonic())
        message = msgspec.structs.replace(self.message, refused=refused) if refused else self.message
        return encode_datagram(message, self._secret)

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _healthy(self, timeout_s: float) -> bool:
        try:
            with urllib.request.urlopen(self._health_url, timeout=max(0.05, timeout_s)) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        socks = []
        for proxy in self.proxies:  # one socket each: a DEALER connected to several would deal beats out among them
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing while the proxy is unreachable
            sock.setsockopt(zmq.SNDHWM, 4)
            sock.connect(f"tcp://{proxy}")
            socks.append((proxy, sock))
        announced: set[Address] = set()
        try:
            while not self._stop.is_set():
                due = time.monotonic() + self.interval_s
                # A server starved of CPU may take seconds to answer: wait for it until the next beat is due rather
                # than give up after a second (three slow answers in a row would have the proxy drop a live
                # instance), and keep the beats' cadence whatever the answer took.
                if self._healthy(self.interval_s):
                    beat = self.beat()
                    for proxy, sock in socks:
                        try:
                            sock.send(beat, zmq.NOBLOCK)
                        except zmq.Again:
                            continue  # that proxy is not connected; the next interval tries again
                        self.sent += 1
                        if proxy not in announced:
                            log.info("first heartbeat sent to %s", proxy)
                            announced.add(proxy)
                self._stop.wait(max(0.0, due - time.monotonic()))
        finally:
            for _, sock in socks:
                sock.close()


_ROLE_NAMES = {Role.PRODUCER: "prefill", Role.CONSUMER: "decode", Role.BOTH: "both"}
_LEGACY_TYPES = {"prefill": "P", "decode": "D"}


def sender_for(config: ConnectorConfig, tp_size: int = 0, pp_size: int = 0,
               dp_rank: int | None = None, kv_events: str = "") -> HeartbeatSender | None:
    """The heartbeat sender of an instance configured with `proxy_ip`/`proxy_port` (of its data-parallel rank
    `dp_rank`, where its API server fronts several; publishing KV cache events at `kv_events`); None without a
    proxy."""
    extra = config.extra
    if not extra.proxy_ip:
        return None
    if dp_rank is not None and extra.heartbeat_format is HeartbeatFormat.LEGACY:
        raise ConfigError("heartbeat_format legacy: the old proxy cannot choose a data-parallel rank; use p2pkv's "
                          "heartbeats (and proxy) with --data-parallel-size")
    proxies = extra.proxies
    kv = extra.kv_address(config.worker_port(0))  # as `DecodeParams` and the engines' hellos name it
    if extra.heartbeat_format is HeartbeatFormat.LEGACY and extra.auth_secret:
        log.warning("heartbeat_format legacy: heartbeats go unsigned (the old format has no signature); a p2pkv "
                    "proxy with a shared secret refuses them")
    return HeartbeatSender(proxies, _ROLE_NAMES[config.role],
                           Address(kv.host, extra.http_port), kv,
                           extra.heartbeat_interval_s, extra.auth_secret.encode(), tp_size, pp_size,
                           extra.heartbeat_format is HeartbeatFormat.LEGACY, dp_rank, config.takes_pulls,
                           config.launch, kv_events)
