"""The proxy's instances with their live state, and the policies that pick one per role."""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from p2pkv.params import Address
from p2pkv.proxy.instances import Instance
from p2pkv.proxy.pairs import Refused, Side

log = logging.getLogger(__name__)
# After a connection to an instance is refused, others are picked before it for this long: an instance that died
# would otherwise draw requests (each then sent again elsewhere) until its missed heartbeats drop it.
SHUNNED_S = 5.0
# Dropped instances whose engine id is kept (the latest ones): one that comes back under another id restarted.
GONE_KEPT = 256


class Policy(enum.Enum):
    LEAST_OUTSTANDING = "least-outstanding"
    ROUND_ROBIN = "round-robin"
    PREFIX = "prefix"  # the instance that holds most of the prompt, balanced against its load (`p2pkv.proxy.prefixes`)


@dataclass
class InstanceState:
    instance: Instance
    role: str
    in_flight: int = 0
    last_heartbeat: float | None = None  # wall-clock seconds of the last heartbeat; None if none came
    failures: int = 0
    expires_at: float | None = None  # monotonic; None for instances from static flags, which never expire
    discovered: bool = False
    shunned_until: float = 0.0  # monotonic: its connections were refused; others go first until then
    ranks: int = 1  # its workers (tensor- times pipeline-parallel size), as its heartbeats say
    kv_refused: tuple[Refused, ...] = ()  # workers of other instances its workers refused, as its heartbeats say
    engine_id: str = ""  # as its heartbeats name it: another one says it restarted
    up_since: float = 0.0  # monotonic: when the proxy heard it restarted; 0 if it has not
    kv_named: Address | None = None  # its first worker's address as its workers name it, where a probe said it
    launch: str = ""  # its start as its heartbeats (or probes) say it (`p2pkv.config.launch_of`); "": not said
    weights: str = ""  # the last weight update through the proxy it took (`p2pkv.proxy.control`); "": as started
    kv_events: str = ""  # where its KV cache events are published, as its heartbeats say; "": not said
    pending_tokens: int = 0  # prompt tokens it has to compute for the requests in flight there (prefix policy)

    def side(self) -> Side:
        return Side(f"{self.role} instance {self.instance.name}", self.kv_named or self.instance.kv, self.ranks,
                    self.kv_refused, self.up_since, self.launch, self.weights)

    def heard(self, engine_id: str, ranks: int, refused: tuple[Refused, ...], now: float, launch: str = "") -> None:
        """What a heartbeat said of its parallel size, its refusals, the engine id it runs as now and its start. A
        restart (another engine id or start) loaded the weights it was started with: updates before it are gone."""
        if (engine_id and self.engine_id and engine_id != self.engine_id) or (
                launch and self.launch and launch != self.launch):
            log.info("%s instance %s restarted (engine %s, start %s)", self.role, self.instance.name,
                     engine_id or self.engine_id, launch or self.launch)
            if self.weights:
                log.warning("%s instance %s runs the weights it was started with since its restart, not the update "
                            "%s: not paired with instances that took it until an update reaches them all",
                            self.role, self.instance.name, self.weights)
            self.up_since, self.weights = now, ""
        self.engine_id = engine_id or self.engine_id
        self.ranks, self.kv_refused, self.launch = ranks, refused, launch

    def describe(self) -> dict[str, object]:
        return {"role": self.role, "address": str(self.instance.http), "dp_rank": self.instance.dp_rank,
                "kv_address": str(self.instance.kv) if self.instance.kv else None,
                "last_heartbeat": self.last_heartbeat, "in_flight": self.in_flight, "failures": self.failures,
                "source": "heartbeat" if self.discovered else "static", "launch": self.launch or None,
                "weights": self.weights or None,
                "shunned_s": round(max(0.0, self.shunned_until - time.monotonic()), 1),
                "refused": [{"address": str(r.address), "reason": r.reason, "launch": r.launch or None,
                             "paired_again_in_s": round(max(0.0, r.until - time.monotonic()), 1)}
                            for r in self.kv_refused]}

    def refused(self, now: float | None = None) -> None:
        """A connection to it was refused: pick others first for `SHUNNED_S` (and other engines behind its address,
        `Pool.pick`)."""
        now = time.monotonic() if now is None else now
        if self.shunned_until <= now:
            log.warning("%s instance %s refused a connection; others go first for %.0f s", self.role,
                        self.instance.name, SHUNNED_S)
        self.shunned_until = now + SHUNNED_S


@dataclass
class Pool:
    """The instances of one role and how to choose among them."""

    role: str
    policy: Policy
    states: list[InstanceState] = field(default_factory=list)
    _turn: itertools.count[int] = field(default_factory=itertools.count)
    # The engine ids, starts and weight updates of dropped instances, by name: a restart takes longer than the
    # missed heartbeats that drop an instance, and refusals of the old engine must not count against the new one
    # (`InstanceState.up_since`), nor updates it took (`InstanceState.weights`); one only starved of heartbeats
    # for a while comes back as it was.
    _gone: dict[str, tuple[str, str, str]] = field(default_factory=dict)

    def prune(self, now: float | None = None) -> list[InstanceState]:
        """Drop discovered instances whose heartbeats are overdue; the dropped ones."""
        now = time.monotonic() if now is None else now
        gone = [s for s in self.states if s.expires_at is not None and s.expires_at <= now]
        if gone:
            self.states = [s for s in self.states if s not in gone]
            for state in gone:
                log.warning("%s instance %s missed its heartbeats; dropped", self.role, state.instance.name)
                if state.engine_id or state.launch:
                    self._gone.pop(state.instance.name, None)
                    self._gone[state.instance.name] = (state.engine_id, state.launch, state.weights)
                    while len(self._gone) > GONE_KEPT:
                        del self._gone[next(iter(self._gone))]
        return gone

    def count(self) -> int:
        self.prune()
        return len(self.states)

    def servers(self) -> list[InstanceState]:
        """One engine per API server (the first listed), after pruning: for what belongs to the server rather than
        to an engine (models, tokenizer, stored responses; pause and resume, which reach all its engines)."""
        self.prune()
        first: dict[Address, InstanceState] = {}
        for state in self.states:
            first.setdefault(state.instance.http, state)
        return list(first.values())

    def find(self, instance: Instance) -> InstanceState | None:
        return next((s for s in self.states if s.instance.same_engine(instance)), None)

    def heard_from(self, instance: Instance, wall: float, expires_at: float) -> bool:
        """Record a heartbeat; True when the instance is new to this pool."""
        state = self.find(instance)
        if state is None:
            engine_id, launch, weights = self._gone.pop(instance.name, ("", "", ""))
            self.states.append(InstanceState(instance, self.role, last_heartbeat=wall, expires_at=expires_at,
                                             discovered=True, engine_id=engine_id, launch=launch, weights=weights))
            return True
        state.last_heartbeat = wall
        if state.discovered:  # its KV address is as before (`identity_change`)
            state.expires_at = expires_at
        return False

    def remove(self, instance: Instance) -> bool:
        state = self.find(instance)
        if state is None or not state.discovered:
            return False
        self.states.remove(state)
        return True

    def pick(self, exclude: frozenset[Instance] = frozenset(), now: float | None = None,
             cost: Callable[[InstanceState], int] | None = None, slack: int = 0,
             spare: Callable[[InstanceState], int] | None = None) -> InstanceState | None:
        """One instance not in `exclude` by the policy, among those not shunned if there are any. `cost`: what a
        request costs on each instance (the prefix policy's prompt tokens left to compute there, queued ones
        included): one of those within `slack` of the cheapest is picked, the one lowest by `spare` (how full its
        cache is) where given; without a cost the prefix policy picks by least outstanding."""
        self.prune()
        now = time.monotonic() if now is None else now
        candidates = [s for s in self.states if s.instance not in exclude]
        if not candidates:
            return None
        # A refused connection says the server is down: every engine behind its address goes after the others.
        down = {s.instance.http for s in self.states if s.shunned_until > now}
        candidates = [s for s in candidates if s.instance.http not in down] or candidates
        if self.policy is Policy.ROUND_ROBIN:
            return candidates[next(self._turn) % len(candidates)]
        if cost is not None and self.policy is Policy.PREFIX:
            costs = {id(s): cost(s) for s in candidates}
            cheapest = min(costs.values())
            candidates = [s for s in candidates if costs[id(s)] <= cheapest + slack]
            if spare is not None and len(candidates) > 1:
                fullness = {id(s): spare(s) for s in candidates}
                least = min(fullness.values())
                candidates = [s for s in candidates if fullness[id(s)] == least]
            if len(candidates) > 1:  # then the cheapest of those
                cheapest = min(costs[id(s)] for s in candidates)
                candidates = [s for s in candidates if costs[id(s)] == cheapest]
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


def identity_change(live: list[InstanceState], role: str, instance: Instance, engine_id: str, launch: str
                    ) -> str | None:
    """What a heartbeat would change of a live discovered instance (its states, one per pool): its role, KV address,
    engine id or start; None if nothing. Its heartbeats may only renew it: one from anyone else naming its address
    would otherwise take its prefills or its clients. A restart is taken once the old instance expired (its
    engine id kept in `Pool._gone` tells it restarted)."""
    if not live:
        return None
    state = live[0]
    now_role = "both" if len(live) > 1 else state.role
    if role != now_role:
        return f"its role from {now_role} to {role}"
    if instance.kv != state.instance.kv:
        return f"its KV address from {state.instance.kv} to {instance.kv}"
    if engine_id != state.engine_id:
        return f"its engine id from {state.engine_id or 'none'} to {engine_id or 'none'}"
    if launch != state.launch:
        return f"its start from {state.launch or 'none'} to {launch or 'none'}"
    return None


def static_pool(role: str, instances: tuple[Instance, ...], policy: Policy) -> Pool:
    return Pool(role, policy, [InstanceState(i, role) for i in instances])
