"""The workers' refusals (peers refused at their hello: `p2pkv.engine.refused`) carried to the scheduler side, which
has the proxy told in the instance's heartbeats. Each worker sends its notes when they change, through vLLM's
worker-to-scheduler metadata; the scheduler side keeps each worker's latest and hands their union to the heartbeat
sender."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from p2pkv.engine.refused import Refusal, RefusedPeers

Notes = dict[str, Refusal]


class RefusalNotes(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker to scheduler: each reporting worker's notes by its slot (its rank in the instance), with their
    version."""

    def __init__(self, by_slot: dict[int, tuple[int, Notes]]) -> None:
        self.by_slot = by_slot

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, RefusalNotes):
            return self
        merged = dict(self.by_slot)
        for slot, (version, notes) in other.by_slot.items():
            if slot not in merged or merged[slot][0] < version:
                merged[slot] = version, notes
        return RefusalNotes(merged)


class RefusalReporter:
    """Worker side: the notes of `refused`, when they changed since they were last reported."""

    def __init__(self, slot: int) -> None:
        self._slot = slot
        self._reported = 0  # RefusedPeers starts at version 0 with no notes: nothing to report

    def report(self, refused: RefusedPeers) -> RefusalNotes | None:
        if refused.version == self._reported:  # every step: no copy of the notes unless they changed
            return None
        version, notes = refused.snapshot()
        self._reported = version
        return RefusalNotes({self._slot: (version, notes)})


class InstanceRefusals:
    """Scheduler side: every worker's latest notes; their union (the latest refusal of each peer) goes to `tell`."""

    def __init__(self, tell: Callable[[Mapping[str, Refusal]], None]) -> None:
        self._tell = tell
        self._by_slot: dict[int, tuple[int, Notes]] = {}
        self._union: Notes = {}

    def latest(self) -> Mapping[str, Refusal]:
        """The union last told: what a probe's answer says (`p2pkv.params.ProbeAnswer`)."""
        return self._union

    def update(self, meta: object) -> None:
        if not isinstance(meta, RefusalNotes):
            return
        changed = False
        for slot, (version, notes) in meta.by_slot.items():
            if slot not in self._by_slot or self._by_slot[slot][0] < version:
                self._by_slot[slot] = version, notes
                changed = True
        if not changed:
            return
        union: Notes = {}
        for _, notes in self._by_slot.values():
            for address, note in notes.items():
                if address not in union or union[address].at < note.at:
                    union[address] = note
        self._union = union
        self._tell(union)
