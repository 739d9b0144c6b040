"""Pulls from different peers in parallel: a few pullers ("lanes"), each with its own thread, links and pipes. A peer
keeps the lane it was first given (lanes are handed out in turn), so its pulls stay in order on one link, while a
pull that waits (for an offer not made yet, a slow peer, a copy) holds up only the pulls of the peers in its lane.
A decode rank that gathers from two prefill ranks (other tensor- or pipeline-parallel sizes) pulls both at once."""

from __future__ import annotations

import threading
from collections.abc import Callable

from p2pkv.engine.puller import Puller, PullJob, PullResult, Renewal
from p2pkv.params import Address

LANES = 4


class PullLanes:
    """The `Puller` interface over `count` pullers made by `make`."""

    def __init__(self, make: Callable[[], Puller], count: int = LANES) -> None:
        if count < 1:
            raise ValueError(f"at least one lane, not {count}")
        self._lanes = [make() for _ in range(count)]
        self._lock = threading.Lock()
        self._of_peer: dict[Address, Puller] = {}
        self._of_key: dict[str, Puller] = {}  # the lane holding each pull's result, until it is forgotten

    def start(self) -> None:
        for lane in self._lanes:
            lane.start()

    def _lane(self, peer: Address) -> Puller:
        lane = self._of_peer.get(peer)
        if lane is None:
            lane = self._lanes[len(self._of_peer) % len(self._lanes)]
            self._of_peer[peer] = lane
        return lane

    def submit(self, job: PullJob) -> None:
        with self._lock:
            lane = self._lane(job.peer)
            self._of_key[job.result_key] = lane
        lane.submit(job)

    def renew(self, renewal: Renewal) -> None:
        with self._lock:
            lane = self._lane(renewal.peer)
        lane.renew(renewal)

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
        for lane in self._lanes:
            lane.close()
