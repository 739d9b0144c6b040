"""Per-request tracing in the proxy: response headers that name a request's transfer and the instances it went
through, and one log line per request. The transfer id is the key every instance logs its side under (`transfer
<id> send ...` on the prefill instance, `transfer <id> landed ...` or `... load failed` on the decode instance),
so a slow or recomputed request can be followed from the client's answer into both instances' logs."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("p2pkv.proxy.requests")
slow_log = logging.getLogger("p2pkv.proxy.slow")

TRANSFER_HEADER = "x-p2pkv-transfer-id"
PREFILL_HEADER = "x-p2pkv-prefill"  # the prefill instance used, or "none" (the decode instance prefilled itself)
PREFILL_MS_HEADER = "x-p2pkv-prefill-ms"  # its answer's time, as the proxy saw it (retries not counted)
DECODE_HEADER = "x-p2pkv-decode"
ROUTE_HEADER = "x-p2pkv-route"  # why a request went to its decode instance alone, where the proxy chose that


@dataclass
class RequestTrace:
    transfer_id: str
    decode: str
    started: float
    prefill: str = ""
    prefill_ms: float = 0.0
    prefill_tries: int = 0
    reroutes: int = 0
    done: bool = False
    route: str = ""  # why the decode instance got it alone ("": it did not, or not by the proxy's choice)

    def prefilled(self, instance: str, started: float) -> None:
        """The prefill on `instance`, asked at `started`, answered with the KV's params."""
        self.prefill, self.prefill_ms = instance, (time.monotonic() - started) * 1000

    def reroute(self, transfer_id: str, decode: str) -> None:
        """The request starts again as a new transfer (its decode instance failed before answering)."""
        self.transfer_id, self.decode, self.reroutes = transfer_id, decode, self.reroutes + 1
        self.prefill, self.prefill_ms = "", 0.0

    def headers(self) -> dict[str, str]:
        headers = {TRANSFER_HEADER: self.transfer_id, PREFILL_HEADER: self.prefill or "none",
                   PREFILL_MS_HEADER: f"{self.prefill_ms:.1f}", DECODE_HEADER: self.decode}
        if self.route:
            headers[ROUTE_HEADER] = self.route
        return headers

    def breakdown(self, first_token_s: float) -> str:
        """Where a request's time to its first token went, as the proxy saw it."""
        prefill = (f"prefill on {self.prefill} {self.prefill_ms:.0f} ms ({self.prefill_tries} tries)" if self.prefill
                   else f"no prefill ({self.route or 'computed on the decode instance'})")
        decode_ms = first_token_s * 1000 - self.prefill_ms
        return (f"{prefill}, then decode on {self.decode} {decode_ms:.0f} ms to its first token"
                f"{f', {self.reroutes} reroutes' if self.reroutes else ''}; transfer {self.transfer_id}")

    def finish(self, status: int, outcome: str) -> None:
        """Log the request's line, once."""
        if self.done:
            return
        self.done = True
        log.info("request transfer=%s prefill=%s prefill_ms=%.1f prefill_tries=%d decode=%s reroutes=%d status=%d "
                 "outcome=%s ms=%.1f%s", self.transfer_id, self.prefill or "none", self.prefill_ms, self.prefill_tries,
                 self.decode, self.reroutes, status, outcome, (time.monotonic() - self.started) * 1000,
                 f" route={self.route!r}" if self.route else "")


SLOW_MIN_S = 1.0  # a first token sooner than this is never called slow
SLOW_FACTOR = 10.0  # times the median of the recent requests'
SLOW_WINDOW = 256  # recent requests the median is taken over
SLOW_AFTER = 16  # requests seen before any is called slow
SLOW_LOG_S = 10.0  # one line at most this often; the others are counted in the next


class SlowRequests:
    """Requests whose first token took both `SLOW_MIN_S` and `SLOW_FACTOR` times the recent median: each counted,
    and logged (a warning, at most one every `SLOW_LOG_S`) with where its time went and its transfer id, the key to
    both instances' lines for it."""

    def __init__(self, count: Callable[[], None]) -> None:
        self._count = count
        self._recent: deque[float] = deque(maxlen=SLOW_WINDOW)
        self._logged = -SLOW_LOG_S
        self._unlogged = 0

    def note(self, trace: RequestTrace, first_token_s: float) -> bool:
        """One request's time to first token; whether it was slow."""
        recent = sorted(self._recent)
        self._recent.append(first_token_s)
        if len(recent) < SLOW_AFTER:
            return False
        median = recent[len(recent) // 2]
        if first_token_s <= max(SLOW_MIN_S, SLOW_FACTOR * median):
            return False
        self._count()
        now = time.monotonic()
        if now - self._logged < SLOW_LOG_S:
            self._unlogged += 1
            return True
        more = f" ({self._unlogged} more since the last such line)" if self._unlogged else ""
        self._logged, self._unlogged = now, 0
        slow_log.warning("slow request: first token after %.0f ms, %.0fx the median of the last %d (%.0f ms): %s; "
                         "its lines in both instances' logs say where it waited%s", first_token_s * 1000,
                         first_token_s / median if median else float("inf"), len(recent), median * 1000,
                         trace.breakdown(first_token_s), more)
        return True
