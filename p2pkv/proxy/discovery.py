"""The proxy side of discovery: a ZMQ ROUTER socket read by one asyncio task in the proxy's event loop.

Each message is parsed on its own (`p2pkv.discovery.parse_announcement`); a malformed or unauthenticated one is
counted and dropped, and the loop reads on. Expiry is not decided here: pools drop overdue instances whenever they
are consulted, so a dead instance leaves even when no other heartbeat arrives.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from p2pkv.discovery import Announcement, parse_announcement
from p2pkv.errors import ConfigError, ProtocolError

log = logging.getLogger(__name__)
_LOG_EVERY_S = 10.0


class DiscoveryListener:
    def __init__(self, host: str, port: int, secret: bytes, on_announcement: Callable[[Announcement], None],
                 on_refused: Callable[[], None]) -> None:
        self._secret = secret
        self._on_announcement = on_announcement
        self._on_refused = on_refused
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)  # larger messages drop the sender's connection
        endpoint = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close()
            raise ConfigError(f"--discovery-port: cannot listen on {endpoint} ({exc})") from None
        self.endpoint = endpoint
        self._last_logged = 0.0
        self.refused = 0

    async def run(self) -> None:
        log.info("discovery listening on %s", self.endpoint)
        try:
            while True:
                frames = await self._sock.recv_multipart()
                self.handle(frames[-1] if len(frames) >= 2 else b"")
        finally:
            self._sock.close()
            self._ctx.term()

    def handle(self, raw: bytes) -> None:
        try:
            announcement = parse_announcement(raw, self._secret)
        except ProtocolError as exc:
            self.refused += 1
            self._on_refused()
            now = time.monotonic()
            if now - self._last_logged > _LOG_EVERY_S:
                self._last_logged = now
                log.warning("dropped a discovery message (%d so far): %s", self.refused, exc)
            return
        self._on_announcement(announcement)


def start(listener: DiscoveryListener) -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(listener.run(), name="p2pkv-discovery")
