"""Static instances that send no heartbeats (listed with `--prefill` and `--decode`, not told `proxy_ip`) are asked,
every `probe_interval_s`, what a heartbeat would have said: a probe (`ProbeParams`, a one-token completion the
connector answers with `ProbeAnswer`) tells the KV workers its workers refused at their hello, the address its
workers name themselves by (which other instances' refusals name), its parallel sizes and its engine id (another
one: it restarted). So a prefill and a decode instance that refused each other's KV are not paired
(`p2pkv.proxy.pairs`), with static lists as with heartbeats. An instance that does not answer is asked again at the
next round; what it said before stands."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from p2pkv.discovery.announcement import MAX_REFUSED
from p2pkv.discovery.events import MAX_ENDPOINT_BYTES
from p2pkv.errors import ConfigError
from p2pkv.params import Address, hex16_or_empty
from p2pkv.proxy.instances import Instance
from p2pkv.proxy.pairs import Said
from p2pkv.proxy.registry import InstanceState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probed:
    """What a probe's answer said, checked."""

    engine_id: str
    ranks: int  # tensor- times pipeline-parallel size (1 when not said)
    named: Address | None  # its first worker's address as its workers name it; None: not said
    refused: tuple[Said, ...]  # (a refused worker's address, why, seconds since, its instance's start or "")
    launch: str = ""  # its start (`p2pkv.config.launch_of`); "": not said
    kv_events: str = ""  # where it publishes KV cache events; "": not said
    # its tensor- and pipeline-parallel sizes (0: not said) and whether it takes its KV by pulls
    sizes: tuple[int, int, bool] = (0, 0, False)


def _size(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 4096:
        return value
    return 1


def read_probe(answer: Mapping[str, Any]) -> Probed:
    """The checked contents of a probe's answer (`ProbeAnswer.to_dict`); ValueError for anything malformed."""
    engine_id, named, raw = answer.get("engine_id", ""), answer.get("kv_named", ""), answer.get("refused", [])
    if not isinstance(engine_id, str) or not isinstance(named, str):
        raise ValueError("engine_id and kv_named: expected strings")
    launch = answer.get("launch", "")
    if not hex16_or_empty(launch):
        raise ValueError(f"launch: expected 16 hex digits, got {launch!r:.40}")
    if not isinstance(raw, list) or len(raw) > MAX_REFUSED:
        raise ValueError(f"refused: expected a list of at most {MAX_REFUSED} entries")
    launches = answer.get("refused_launches", [""] * len(raw))
    if not (isinstance(launches, list) and len(launches) == len(raw) and all(map(hex16_or_empty, launches))):
        raise ValueError("refused_launches: expected one launch (16 hex digits, or \"\") for each refusal")
    refused = []
    for entry, launch_refused in zip(raw, launches, strict=True):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[1], str) and isinstance(entry[2], (int, float))
                and not isinstance(entry[2], bool) and math.isfinite(entry[2]) and 0 <= entry[2] <= 1e9):
            raise ValueError(f"refused: expected [address, reason, seconds], got {entry!r}")
        try:
            refused.append((Address.parse(entry[0]), entry[1][:160], float(entry[2]), launch_refused))
        except ConfigError as exc:
            raise ValueError(f"refused: {exc}") from None
    try:
        address = Address.parse(named) if named else None
    except ConfigError as exc:
        raise ValueError(f"kv_named: {exc}") from None
    ranks = _size(answer.get("tp_size")) * _size(answer.get("pp_size"))
    events = answer.get("kv_events", "")
    if not (isinstance(events, str) and len(events) <= MAX_ENDPOINT_BYTES
            and (not events or events.startswith(("tcp://", "ipc://")))):
        raise ValueError(f"kv_events: expected a tcp:// or ipc:// endpoint, got {events!r:.40}")
    tp, pp = (value if isinstance(value := answer.get(key), int) and not isinstance(value, bool)
              and 0 < value <= 4096 else 0 for key in ("tp_size", "pp_size"))
    return Probed(engine_id[:64], ranks, address, tuple(refused), launch, events,
                  (tp, pp, answer.get("pulls") is True))


class StaticPoller:
    """Asks every static instance without heartbeats, each round, concurrently; `heard` takes what one said (for
    each of its states: a "both" instance is in two pools)."""

    def __init__(self, states: Callable[[], list[InstanceState]],
                 probe: Callable[[Instance], Awaitable[Mapping[str, Any]]],
                 heard: Callable[[list[InstanceState], Probed], None], interval_s: float, timeout_s: float) -> None:
        self._states, self._probe, self._heard = states, probe, heard
        self._interval_s, self._timeout_s = interval_s, timeout_s
        self._failing: set[Instance] = set()  # logged as not answering, until it answers again

    async def run(self) -> None:
        while True:
            await self.round()
            await asyncio.sleep(self._interval_s)

    async def round(self) -> None:
        by_instance: dict[Instance, list[InstanceState]] = {}
        for state in self._states():
            if not state.discovered and state.last_heartbeat is None:
                by_instance.setdefault(state.instance, []).append(state)
        await asyncio.gather(*(self._ask(instance, states) for instance, states in by_instance.items()))

    async def _ask(self, instance: Instance, states: list[InstanceState]) -> None:
        try:
            probed = read_probe(await asyncio.wait_for(self._probe(instance), self._timeout_s))
        except Exception as exc:  # down, busy, not running the connector, or a bad answer: asked again next round
            if instance not in self._failing:
                self._failing.add(instance)
                log.info("static instance %s did not answer the probe for its refusals (%r); asked again every "
                         "%.0f s", instance.name, exc, self._interval_s)
            return
        self._failing.discard(instance)
        self._heard(states, probed)
