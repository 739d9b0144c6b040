"""`p2pkv bench serve`'s verdicts on given rounds: medians against colocated, each target met or not, rounds that
disagree said, and the breakdown of a request's time to first token from two scrapes of the metrics."""

from __future__ import annotations

from typing import Any

import pytest

from p2pkv.bench.serve import PARTS, breakdown, breakdown_table, table, verdicts


def _run(ttft: float, p99: float, itl: float, parts: dict[str, float] | None = None) -> tuple[dict[str, float],
                                                                                               dict[str, float]]:
    result = {"mean_ttft_ms": ttft, "median_ttft_ms": ttft, "p99_ttft_ms": p99, "mean_itl_ms": itl,
              "completed": 64.0}
    return result, parts or {label: float("nan") for label, _, _ in PARTS}


def test_targets_are_judged_on_the_medians_of_the_rounds() -> None:
    runs: dict[str, Any] = {
        "colocated": [_run(40, 100, 3.0), _run(44, 90, 3.1), _run(42, 95, 3.0)],
        # medians: 52 (1.24x), 180 (1.89x), 3.2 (1.04x): met, even with one slow round
        "proxy": [_run(52, 180, 3.2), _run(50, 170, 3.1), _run(300, 900, 9.0)],
        # medians: 60 (1.43x), 250 (2.63x), 3.6 (1.18x): none met
        "router": [_run(60, 250, 3.6), _run(61, 260, 3.7), _run(59, 240, 3.5)],
    }
    lines, met = verdicts(runs)
    assert not met
    assert [line.rsplit(": ", 1)[1] for line in lines if line.startswith("1P1D via proxy")] == ["met"] * 3
    assert [line.rsplit(": ", 1)[1] for line in lines if line.startswith("1P1D via router")] == ["NOT met"] * 3
    assert any(line.startswith("proxy: the rounds disagree") for line in lines)
    assert not any(line.startswith(("router: the rounds", "colocated: the rounds")) for line in lines)
    assert "1.24" in table(runs)[1] and "1.43" in table(runs)[1]
    assert verdicts({"colocated": runs["colocated"], "proxy": runs["proxy"]})[1]
    # A shorter ITL than colocated's (the decode instance decodes alone) meets its target; 1.2x does not.
    faster = {"colocated": runs["colocated"], "proxy": [_run(44, 95, 2.4)] * 3}
    slower = {"colocated": runs["colocated"], "proxy": [_run(44, 95, 3.6)] * 3}
    assert verdicts(faster)[1] and not verdicts(slower)[1]


def test_the_proxy_with_decode_requests_after_their_prefill_is_compared_without_a_target() -> None:
    colocated = [_run(40, 100, 3.0)] * 3
    runs: dict[str, Any] = {"colocated": colocated, "proxy": [_run(50, 150, 3.0)] * 3,
                            "after": [_run(80, 400, 5.0)] * 3}
    lines, met = verdicts(runs)
    assert met, "a comparison's missed targets failed the run"
    compared = [line for line in lines if "1P1D decode after" in line]
    assert len(compared) == 3 and all(line.startswith("for comparison, no target: ") for line in compared)
    assert [line.rsplit(": ", 1)[1] for line in compared] == ["NOT met"] * 3
    assert not verdicts({"colocated": colocated, "proxy": [_run(80, 400, 5.0)] * 3})[1]


def test_the_breakdown_is_each_parts_mean_between_two_scrapes() -> None:
    keys = [(source, name) for _, source, name in PARTS]
    before = {key: (1.0, 10.0) for key in keys}
    after = {key: (1.0, 10.0) for key in keys}
    after[("decode", "vllm:time_to_first_token_seconds")] = (1.5, 20.0)  # 10 requests, 0.5 s in all: 50 ms each
    parts = breakdown(before, after)
    assert parts["decode instance: arrival to first token"] == 50.0
    assert parts["colocated: arrival to first token"] != parts["colocated: arrival to first token"]  # NaN: none
    lines = breakdown_table({"colocated": [_run(1, 1, 1)], "proxy": [_run(1, 1, 1, parts)]})
    assert any(line.startswith("decode instance: arrival to first token") and "50.00" in line for line in lines)
    assert not any(line.startswith("colocated: arrival") for line in lines)  # no part measured: no row


def test_a_nixl_peer_without_nixl_installed_is_refused_before_anything_starts(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    from p2pkv.bench import serve

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nixl" else found(name, *a))

    def never(*_: object) -> None:
        raise AssertionError("nothing may start")

    monkeypatch.setattr(serve, "start", never)
    assert serve.main(None, 512, 32, 64, 4.0, "unused.png", via=("proxy", "nixl")) == 1
    assert "pip install nixl" in capsys.readouterr().out


def test_a_peer_runs_after_p2pkvs_instances_are_stopped_and_its_misses_do_not_fail_the_run(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The run's own parts (clusters, vLLM's benchmark) stubbed: what `main` does with them."""
    import importlib.util

    from p2pkv.bench import serve

    events: list[str] = []

    class Stopped:
        def __init__(self, name: str) -> None:
            self.name = name

        def stop(self) -> None:
            events.append(f"stop {self.name}")

    ours = {"colocated": [_run(40, 100, 3.0)] * 3, "proxy": [_run(50, 150, 3.0)] * 3}
    theirs = {"colocated": [_run(40, 100, 3.0)] * 3, "nixl": [_run(400, 1000, 9.0)] * 3}
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "nixl" else found(name, *a))
    monkeypatch.setattr(serve, "resolve_model", lambda model: "model")
    monkeypatch.setattr(serve, "start", lambda s, log_dir, fronts: (
        events.append(f"start {','.join(fronts)}") or [Stopped("p2pkv"), Stopped("colocated")],
        serve.Endpoints({}, {}, "http://colocated")))
    monkeypatch.setattr(serve, "start_nixl", lambda s, log_dir, colocated: (
        events.append(f"start nixl beside {colocated}") or Stopped("nixl"), serve.Endpoints({}, {}, colocated)))
    monkeypatch.setattr(serve, "measure", lambda s, endpoints, fronts: (
        events.append(f"measure {','.join(fronts)}") or (theirs if "nixl" in fronts else ours)))
    monkeypatch.setattr(serve, "write_plot", lambda runs, path: events.append(f"plot {','.join(runs)}"))
    assert serve.main(None, 512, 32, 64, 4.0, "p.png", via=("proxy", "nixl")) == 0
    assert events == ["start proxy", "measure proxy", "stop p2pkv", "start nixl beside http://colocated",
                      "measure nixl", "stop colocated", "stop nixl", "plot colocated,proxy,nixl"]
    out = capsys.readouterr().out
    assert "1P1D via proxy: mean TTFT 1.25x colocated (target <= 1.3x): met" in out
    assert "peer, no target: NIXL via router: mean TTFT 10.00x colocated (target <= 1.3x): NOT met" in out
