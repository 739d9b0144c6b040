"""Log lines for events that can come in floods (bad frames, refused connections): one a minute at most."""

from __future__ import annotations

import logging
import threading
import time

EVERY_S = 60.0


class Occasional:
    """Writes an event's line at most once per `every_s`, with how many such events there were since the last line
    (an attacker's flood must not become a flood of log lines, nor hide that it happened)."""

    def __init__(self, logger: logging.Logger, every_s: float = EVERY_S) -> None:
        self._log = logger
        self._every_s = every_s
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._count = 0

    def note(self, level: int, message: str, *args: object) -> None:
        with self._lock:
            self._count += 1
            now = time.monotonic()
            if now - self._last < self._every_s:
                return
            count, self._count, self._last = self._count, 0, now
        self._log.log(level, message + " (%d such since the last line)", *args, count)
