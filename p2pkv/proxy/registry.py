"""The proxy's instances with their live state, and the policies that pick one per role."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from p2pkv.proxy.instances import Instance


class Policy(enum.Enum):
    LEAST_OUTSTANDING = "least-outstanding"
    ROUND_ROBIN = "round-robin"


@dataclass
class InstanceState:
    instance: Instance
    role: str
    in_flight: int = 0
    last_heartbeat: float | None = None  # wall-clock seconds; None for instances from static flags
    failures: int = 0

    def describe(self) -> dict[str, object]:
        return {"role": self.role, "address": str(self.instance.http),
                "kv_address": str(self.instance.kv) if self.instance.kv else None,
                "last_heartbeat": self.last_heartbeat, "in_flight": self.in_flight, "failures": self.failures}


@dataclass
class Pool:
    """The instances of one role and how to choose among them."""

    role: str
    policy: Policy
    states: list[InstanceState] = field(default_factory=list)
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def pick(self, exclude: frozenset[Instance] = frozenset()) -> InstanceState | None:
        candidates = [s for s in self.states if s.instance not in exclude]
        if not candidates:
            return None
        if self.policy is Policy.ROUND_ROBIN:
            return candidates[next(self._turn) % len(candidates)]
        # Least outstanding; ties go round-robin so equal instances share the load.
        low = min(s.in_flight for s in candidates)
        tied = [s for s in candidates if s.in_flight == low]
        return tied[next(self._turn) % len(tied)]

    @contextmanager
    def busy(self, state: InstanceState) -> Iterator[None]:
        state.in_flight += 1
        try:
            yield
        finally:
            state.in_flight -= 1


def static_pool(role: str, instances: tuple[Instance, ...], policy: Policy) -> Pool:
    return Pool(role, policy, [InstanceState(i, role) for i in instances])
