"""Pulls from different peers in parallel: a puller ("lane"), with its own thread, links and pipes, for each peer, made
when its first pull comes (up to `MAX_LANES`; beyond that a new peer shares the lane with the fewest peers). A peer
keeps its lane, so its pulls stay in order on one link, while a pull that waits (a slow or silent peer, a copy) holds
up none of another peer's. A decode rank that gathers from several prefill ranks (other tensor- or
pipeline-parallel sizes) pulls from all of them at once. A lane idle for `IDLE_S` ends (its peers get a new one at
their next pull): peers that went away (restarts on other ports, scaled-down instances) hold no thread."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from p2pkv.engine.puller import Puller, PullJob, PullResult, Renewal
from p2pkv.errors import TransferError
from p2pkv.params import Address

MAX_LANES = 64
IDLE_S = 300.0


class PullLanes:
    """The `Puller` interface over pullers made by `make`, one per peer (at most `most`)."""

    def __init__(self, make: Callable[[], Puller], most: int = MAX_LANES, idle_s: float = IDLE_S) -> None:
        if most < 1:
            raise ValueError(f"at least one lane, not {most}")
        self._make = make
        self._most = most
        self._idle_s = idle_s
        self._lanes: list[Puller] = []
        self._lock = threading.Lock()
        self._of_peer: dict[Address, Puller] = {}
        self._of_key: dict[str, Puller] = {}  # the lane holding each pull's result, until it is forgotten
        self._started = False
        self._closed = False
        self._ending: list[Puller] = []  # retired lanes whose threads may still be letting go

    def start(self) -> None:
        with self._lock:
            self._started = True
            for lane in self._lanes:
                lane.start(self._retire, self._idle_s)

    def _lane(self, peer: Address) -> Puller:
        """The peer's lane (the caller holds the lock); a new one for a new peer while there are fewer than `most`."""
        lane = self._of_peer.get(peer)
        if lane is not None:
            return lane
        if self._closed:
            raise TransferError("the engine is closed")
        if len(self._lanes) < self._most:
            lane = self._make()
            self._lanes.append(lane)
            if self._started:
                lane.start(self._retire, self._idle_s)
        else:
            peers = collections.Counter(self._of_peer.values())
            lane = min(self._lanes, key=lambda candidate: peers[candidate])
        self._of_peer[peer] = lane
        return lane

    def submit(self, job: PullJob) -> None:
        with self._lock:  # queued under the lock: a lane retires only with nothing queued (`_retire`)
            lane = self._lane(job.peer)
            self._of_key[job.result_key] = lane
            lane.submit(job)

    def renew(self, renewal: Renewal) -> None:
        with self._lock:
            self._lane(renewal.peer).renew(renewal)

    def _retire(self, lane: Puller) -> bool:
        """An idle lane asks to end: yes unless something was queued for it meanwhile; its peers are forgotten."""
        with self._lock:
            if self._closed or not lane.idle() or lane not in self._lanes:
                return False
            self._lanes.remove(lane)
            self._of_peer = {peer: mine for peer, mine in self._of_peer.items() if mine is not lane}
            self._ending = [*(ended for ended in self._ending if ended.running()), lane]  # joined at close
            return True

    def _holder(self, key: str) -> Puller | None:
        with self._lock:
            return self._of_key.get(key)

    def poll(self, key: str) -> PullResult | None:
        lane = self._holder(key)
        return lane.poll(key) if lane is not None else None

    def wait(self, key: str, deadline: float) -> PullResult | None:
        lane = self._holder(key)
        return lane.wait(key, deadline) if lane is not None else None

    def forget(self, key: str) -> None:
        with self._lock:
            lane = self._of_key.pop(key, None)
        if lane is not None:
            lane.forget(key)

    def lane_of(self, peer: Address) -> int:
        """Which lane `peer`'s pulls go to (for tests and logs)."""
        with self._lock:
            return self._lanes.index(self._lane(peer))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            lanes = [*self._lanes, *self._ending]
        for lane in lanes:
            lane.close()
