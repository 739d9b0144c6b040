"""GET mode, sending side: KV blocks held for a decode instance to pull, each under a lease that expires."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from p2pkv.engine.device import RangeSource

log = logging.getLogger(__name__)

# views(layer, first_block, num_blocks) -> the bytes of those blocks of that layer, in order.
ViewSource = Callable[[int, int, int], tuple[memoryview, ...]]
UNKNOWN_TRANSFER = "unknown transfer"


class OfferState(enum.Enum):
    OFFERED = "offered"
    SERVING = "serving"
    SERVED = "served"
    EXPIRED = "expired"


@dataclass
class Offer:
    transfer_id: str
    total_blocks: int
    source: ViewSource
    lease_deadline: float
    state: OfferState = OfferState.OFFERED
    ranges: RangeSource | None = None  # where the blocks lie in the exported cache, for pulls by reference

    @property
    def finished(self) -> bool:
        return self.state in (OfferState.SERVED, OfferState.EXPIRED)


class OfferTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offers: dict[str, Offer] = {}

    def offer(self, transfer_id: str, total_blocks: int, source: ViewSource, lease_s: float,
              ranges: RangeSource | None = None) -> None:
        with self._lock:
            self._offers[transfer_id] = Offer(transfer_id, total_blocks, source, time.monotonic() + lease_s,
                                              ranges=ranges)

    def claim(self, transfer_id: str, first_block: int, num_blocks: int) -> Offer | str:
        """The offer, now SERVING, or why it cannot be pulled."""
        with self._lock:
            offer = self._offers.get(transfer_id)
            if offer is None:
                return UNKNOWN_TRANSFER
            if offer.state is not OfferState.OFFERED:
                return f"transfer is {offer.state.value}"
            if not (0 <= first_block and num_blocks > 0 and first_block + num_blocks <= offer.total_blocks):
                return f"blocks {first_block}+{num_blocks} outside the {offer.total_blocks} offered"
            offer.state = OfferState.SERVING
            return offer

    def finish(self, offer: Offer) -> None:
        """Served: the bytes left this process (they are in the socket's buffers), the blocks may be freed."""
        with self._lock:
            offer.state = OfferState.SERVED

    def poll(self, transfer_id: str) -> OfferState | None:
        with self._lock:
            offer = self._offers.get(transfer_id)
            return None if offer is None else offer.state

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._offers.pop(transfer_id, None)

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for offer in self._offers.values():
                if offer.state is OfferState.OFFERED and now > offer.lease_deadline:
                    offer.state = OfferState.EXPIRED
                    log.warning("transfer %s: lease expired before the decode side pulled it; blocks freed",
                                offer.transfer_id)
