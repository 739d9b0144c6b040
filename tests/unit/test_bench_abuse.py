"""`p2pkv bench abuse` runs every attack against a real proxy and a real engine while good traffic flows (its p99
targets are for the benchmark command on a quiet machine; here: every attack answered, nothing lost, nothing left
held)."""

from __future__ import annotations

import pytest

from p2pkv.bench.abuse import report, run


def test_every_attack_is_answered_and_no_good_request_or_transfer_is_lost(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = run(window_s=1.0)
    names = [w.name for w in outcome.windows]
    assert len(names) == 11 and names[0].startswith("baseline"), names
    unanswered = [f"{w.name}: {w.verdict.what}" for w in outcome.windows if not w.verdict.ok]
    assert not unanswered
    failed = [s for s in outcome.samples if not s.ok]
    assert not failed, failed[:5]
    kinds = {s.kind for s in outcome.samples}
    assert kinds == {"request", "transfer"}, kinds
    assert not outcome.lost
    assert outcome.pool_bytes == 0
    first, last = outcome.windows[0], outcome.windows[-1]
    assert last.proxy[0] <= first.proxy[0] + 16 and last.engine[0] <= first.engine[0] + 16, (first, last)
    report(outcome)  # its p99 verdict depends on the machine's load; the table names every window
    table = capsys.readouterr().out
    assert all(name in table for name in names) and "not answered" not in table
