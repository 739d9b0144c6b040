"""GET mode, sending side: KV blocks held for a decode instance to pull, each under a lease that expires."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from p2pkv.engine.device import PlaceSource

log = logging.getLogger(__name__)

# views(layer, first_block, num_blocks) -> the bytes of those blocks of that layer, in order.
ViewSource = Callable[[int, int, int], tuple[memoryview, ...]]
# (heads (first, end), layers (first, end) of the model or None for all held) -> a ViewSource over only those
# heads of those layers, numbered from 0 (another tensor- or pipeline-parallel size pulls).
Slicer = Callable[[tuple[int, int], tuple[int, int] | None], ViewSource]
# Where the same slice's blocks lie in this worker's storages, for a pull of a slice by reference or by pipe (None:
# not to be given).
SlicePlaces = Callable[[tuple[int, int], tuple[int, int] | None], PlaceSource | None]
UNKNOWN_TRANSFER = "unknown transfer"
_MAX_PULLERS = 4096
# Transfers no longer held, remembered (the latest this many) so that a pull of one is refused at once: a pull of a
# transfer not known here waits for it to be offered (a refused push is offered moments later), until its deadline.
_GONE_KEPT = 4096


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
    lease_s: float = 0.0  # each renewal keeps the blocks this much longer from then
    state: OfferState = OfferState.OFFERED
    places: PlaceSource | None = None  # where the blocks lie in this worker's storages, for pulls by reference or pipe
    slicer: Slicer | None = None  # for pulls of some heads only
    slice_places: SlicePlaces | None = None  # and by reference or by pipe
    pullers: int = 0  # pulls expected, as the first pull says (one per decode rank that needs these blocks)
    claimed: set[int] = field(default_factory=set)  # decode ranks that have pulled or are pulling
    in_flight: int = 0
    served: int = 0
    pulled_by: frozenset[str] = frozenset()  # the listeners of the decode ranks that will pull, where known

    @property
    def finished(self) -> bool:
        return self.state in (OfferState.SERVED, OfferState.EXPIRED)


class OfferTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offers: dict[str, Offer] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()  # transfer id -> why it is no longer held

    def offer(self, transfer_id: str, total_blocks: int, source: ViewSource, lease_s: float,
              places: PlaceSource | None = None, slicer: Slicer | None = None,
              slice_places: SlicePlaces | None = None, pulled_by: frozenset[str] = frozenset()) -> None:
        with self._lock:
            self._gone.pop(transfer_id, None)
            self._offers[transfer_id] = Offer(transfer_id, total_blocks, source, time.monotonic() + lease_s, lease_s,
                                              places=places, slicer=slicer, slice_places=slice_places,
                                              pulled_by=pulled_by)

    def refused(self, address: str, reason: str) -> list[str]:
        """This engine refused the decode rank whose listener is at `address`: nothing it was to pull can reach it
        (it is refused at every try), so those offers expire now, not when their leases run out: its request is
        computed on the decode side, whatever the other ranks pulled. An offer with a pull in flight is left to end
        as it does (by its lease, rarely). Returns the ids of those that expired."""
        released = []
        with self._lock:
            for offer in self._offers.values():
                if address in offer.pulled_by and not offer.finished and not offer.in_flight:
                    offer.state = OfferState.EXPIRED
                    released.append(offer.transfer_id)
        for transfer_id in released:
            log.warning("transfer %s: blocks freed: the decode worker at %s that was to pull them was refused (%s)",
                        transfer_id, address, reason)
        return released

    def renew(self, transfer_ids: list[str]) -> int:
        """The decode side still wants these transfers: each one still held for a pull is held for another lease
        from now. Returns how many were."""
        now, renewed = time.monotonic(), 0
        with self._lock:
            for transfer_id in transfer_ids:
                offer = self._offers.get(transfer_id)
                if offer is not None and not offer.finished:
                    offer.lease_deadline = max(offer.lease_deadline, now + offer.lease_s)
                    renewed += 1
        return renewed

    def claim(self, transfer_id: str, first_block: int, num_blocks: int, pullers: int = 1,
              puller: int = 0) -> Offer | str:
        """The offer, now SERVING, or why it cannot be pulled. With `pullers` > 1 (decode ranks pulling a head
        slice each) the offer is served once that many ranks have pulled it, each once."""
        with self._lock:
            offer = self._offers.get(transfer_id)
            if offer is None:
                gone = self._gone.get(transfer_id)
                return UNKNOWN_TRANSFER if gone is None else f"transfer is {gone}"
            if offer.finished:
                return f"transfer is {offer.state.value}"
            if puller in offer.claimed:
                return f"transfer is {offer.state.value}"
            if not 0 < pullers <= _MAX_PULLERS or (offer.pullers and pullers != offer.pullers):
                return f"{pullers} pullers announced ({offer.pullers or 'none'} before)"
            if not (0 <= first_block and num_blocks > 0 and first_block + num_blocks <= offer.total_blocks):
                return f"blocks {first_block}+{num_blocks} outside the {offer.total_blocks} offered"
            offer.pullers = pullers
            offer.claimed.add(puller)
            offer.in_flight += 1
            offer.state = OfferState.SERVING
            return offer

    def finish(self, offer: Offer) -> None:
        """One pull served: the bytes left this process (they are in the socket's buffers). Once every puller has
        been served, the blocks may be freed."""
        with self._lock:
            offer.in_flight -= 1
            offer.served += 1
            if offer.served >= offer.pullers:
                offer.state = OfferState.SERVED

    def poll(self, transfer_id: str) -> OfferState | None:
        with self._lock:
            offer = self._offers.get(transfer_id)
            return None if offer is None else offer.state

    def withdraw(self, transfer_id: str, deadline: float) -> bool:
        """No pull may read this offer's blocks any more (they are about to hold other KV): it expires now, or once
        the pulls in flight are done. False if one still is at the deadline."""
        while True:
            with self._lock:
                offer = self._offers.get(transfer_id)
                if offer is None or offer.finished:
                    return True
                if not offer.in_flight:
                    offer.state = OfferState.EXPIRED
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)  # a pull in flight: rare (a preempted request), and it ends by its own deadline

    def forget(self, transfer_id: str, why: str | None = None) -> None:
        """The transfer's blocks are no longer held. If it was offered (or `why` says why it never will be), a later
        pull of it is refused at once, saying why, rather than left waiting for an offer."""
        with self._lock:
            offer = self._offers.pop(transfer_id, None)
            why = why or (offer.state.value if offer is not None else None)
            if why is None:
                return
            self._gone[transfer_id] = why
            self._gone.move_to_end(transfer_id)
            while len(self._gone) > _GONE_KEPT:
                self._gone.popitem(last=False)

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for offer in self._offers.values():
                if not offer.finished and not offer.in_flight and now > offer.lease_deadline:
                    offer.state = OfferState.EXPIRED
                    log.warning("transfer %s: lease expired before the decode side pulled it (%d of %d pulls "
                                "served); blocks freed", offer.transfer_id, offer.served, max(1, offer.pullers))
