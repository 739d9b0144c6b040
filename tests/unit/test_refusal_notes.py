"""The workers' refusals on their way to the heartbeats: each worker reports its notes when they change; vLLM merges
the workers' reports of a step; the scheduler side keeps each worker's latest and hands on their union."""

from __future__ import annotations

import pickle
from collections.abc import Mapping

from p2pkv.engine.refused import Refusal, RefusedPeers
from p2pkv.vllm.refusals import InstanceRefusals, RefusalNotes, RefusalReporter


def test_reports_go_when_the_notes_change_and_the_scheduler_side_unites_every_workers_latest() -> None:
    told: list[dict[str, Refusal]] = []

    def tell(notes: Mapping[str, Refusal]) -> None:
        told.append(dict(notes))

    rank0, rank1 = RefusedPeers(), RefusedPeers()
    report0, report1 = RefusalReporter(0), RefusalReporter(1)
    instance = InstanceRefusals(tell)
    assert report0.report(rank0) is None and report1.report(rank1) is None  # nothing refused yet
    rank0.refused("p:7100", "dtype")
    rank1.refused("p:7101", "dtype")
    step = report0.report(rank0)
    assert isinstance(step, RefusalNotes)
    merged = step.aggregate(report1.report(rank1))  # as vLLM aggregates the workers' metadata of a step
    assert report0.report(rank0) is None  # reported: not again until it changes
    instance.update(merged)
    assert set(told[-1]) == {"p:7100", "p:7101"}
    assert instance.latest() == told[-1], "what a probe's answer says"
    rank1.accepted("p:7101")  # that prefill worker was restarted with a matching layout
    instance.update(report1.report(rank1))
    assert set(told[-1]) == {"p:7100"} and set(instance.latest()) == {"p:7100"}
    calls = len(told)
    instance.update(merged)  # an older report of the same workers changes nothing
    instance.update(None)
    assert len(told) == calls
    rank0.refused("p:7100", "dtype")  # refused again: a newer time for the proxy
    instance.update(report0.report(rank0))
    assert told[-1]["p:7100"].at >= told[calls - 1]["p:7100"].at and len(told) == calls + 1


def test_a_report_survives_pickling() -> None:
    """Workers of another process (tensor parallelism) send their output to the scheduler pickled."""
    peers = RefusedPeers()
    peers.refused("p:7100", "dtype")
    report = RefusalReporter(1).report(peers)
    assert report is not None
    copy = pickle.loads(pickle.dumps(report))
    assert isinstance(copy, RefusalNotes) and copy.by_slot == report.by_slot
