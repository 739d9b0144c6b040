"""Per-request tracing in the proxy: response headers that name a request's transfer and the instances it went
through, and one log line per request. The transfer id is the key every instance logs its side under (`transfer
<id> send ...` on the prefill instance, `transfer <id> landed ...` or `... load failed` on the decode instance),
so a slow or recomputed request can be followed from the client's answer into both instances' logs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("p2pkv.proxy.requests")

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

    def finish(self, status: int, outcome: str) -> None:
        """Log the request's line, once."""
        if self.done:
            return
        self.done = True
        log.info("request transfer=%s prefill=%s prefill_ms=%.1f prefill_tries=%d decode=%s reroutes=%d status=%d "
                 "outcome=%s ms=%.1f%s", self.transfer_id, self.prefill or "none", self.prefill_ms, self.prefill_tries,
                 self.decode, self.reroutes, status, outcome, (time.monotonic() - self.started) * 1000,
                 f" route={self.route!r}" if self.route else "")
