"""Decode side: requests that wait in vLLM's queue for blocks before their KV can be loaded.

Under load a decode instance queues requests for longer than a transfer is kept for them: the prefill instance
holds a GET transfer's blocks for `lease_s`, and pushed bytes are staged here for `staging_expiry_s`. Once either
runs out the load fails and vLLM computes the prompt again, on the instance that has the least time for it. So
while a request waits, the workers are told, every third of the shorter of the two (or of the prefill instance's
own lease, which it says in its answer, where that is shorter still), to keep what is staged of its transfer and
to ask the prefill instance to keep holding its blocks. A request stops being tracked once vLLM gives it blocks
(its load starts at once) or finishes it. Keyed by vLLM's request id only within this instance's
scheduler, where that id is the request's own."""

from __future__ import annotations

import time
from dataclasses import dataclass

from p2pkv.params import Address, DecodeParams
from p2pkv.vllm.metadata import Wanted


@dataclass
class _Waiting:
    transfer_id: str
    prefill: Address
    prefill_ranks: int
    interval_s: float
    next_at: float  # when its transfer is next named


class WaitingRequests:
    def __init__(self, keep_s: float, tp_size: int, pp_size: int) -> None:
        """`keep_s`: how long a transfer is kept for a request without word from here (the shorter of our lease
        and staging expiry); renewals go every third of it, or of the prefill instance's lease where that is
        shorter (it says its own in the params)."""
        self._keep_s = keep_s
        self._own_sizes = (tp_size, pp_size)
        self._waiting: dict[str, _Waiting] = {}
        self._next_at = float("inf")  # the soonest `next_at`, or later

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, req_id: str, params: DecodeParams) -> None:
        if params.prefill_kv is None:
            return  # nothing is held for it anywhere but here, and a push not yet come is not ours to keep
        # Each rank of the prefill instance holds its own blocks; a size not said is taken to be ours.
        ranks = (params.prefill_tp or self._own_sizes[0]) * (params.prefill_pp or self._own_sizes[1])
        interval_s = min(self._keep_s, params.lease_s or self._keep_s) / 3
        next_at = time.monotonic() + interval_s
        self._waiting[req_id] = _Waiting(params.transfer_id, params.prefill_kv, ranks, interval_s, next_at)
        self._next_at = min(self._next_at, next_at)

    def drop(self, req_id: str) -> None:
        self._waiting.pop(req_id, None)

    def due(self, now: float) -> list[Wanted]:
        """The transfers of requests that have waited an interval since they came or were last named, by prefill
        instance. Those within half an interval of it go along, so that renewals go out together rather than one
        request at a time."""
        if now < self._next_at:
            return []
        self._next_at = float("inf")
        by_prefill: dict[tuple[Address, int], list[str]] = {}
        for waiting in self._waiting.values():
            if now >= waiting.next_at - waiting.interval_s / 2:
                by_prefill.setdefault((waiting.prefill, waiting.prefill_ranks), []).append(waiting.transfer_id)
                waiting.next_at = now + waiting.interval_s
            self._next_at = min(self._next_at, waiting.next_at)
        # The samples of one request (`n` > 1) share its transfer: named once.
        return [Wanted(prefill, tuple(dict.fromkeys(ids)), ranks) for (prefill, ranks), ids in by_prefill.items()]
