"""`p2pkv bench abuse`: every attack on the proxy and the KV port while good traffic flows, against a clean baseline
in the same run.

A real proxy (secret, client key and admin key set, discovery on loopback) in front of two stub instances, and a
real engine in its own process taking pushes; good traffic (requests through the proxy, 256 KiB pushes to the
engine) from another process at a fixed pace. Each attack (`p2pkv.bench.abuse_attacks`) runs in a window of its
own; per window the good requests' p50/p99 and the pushes' p99, against the baseline window, and the proxy's and
the engine's descriptors, threads and resident memory after it. Targets: every attack answered as it must, good p99
<= 3x the baseline, no good request or transfer lost, the engine's pool back to 0. Exits 1 if one is missed.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from p2pkv.bench.abuse_attacks import ATTACKS, Attack, Target, Verdict, drain
from p2pkv.bench.abuse_peer import Sample, good_run, receive_run, usage
from p2pkv.bench.cluster import Cluster, Process, free_ports

WINDOW_S = 4.0  # each attack's window lasts at least this long, so that it holds enough good samples
SETTLE_S = 1.0
TARGET_P99 = 3.0
MAX_CONNECTIONS = 64  # the attacked engine's cap, small so that the flood stays small
BODY_TIMEOUT_S = 3.0
_SPAWN = mp.get_context("spawn")


@dataclass(frozen=True)
class Window:
    name: str
    start: float
    end: float
    verdict: Verdict
    proxy: tuple[int, int, int]
    engine: tuple[int, int, int]


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(len(ordered) * q + 0.5) - 1))]


def _figures(samples: list[Sample], window: Window) -> tuple[list[float], list[float], int]:
    inside = [s for s in samples if window.start <= s.started < window.end]
    requests = [s.ms for s in inside if s.kind == "request" and s.ok]
    transfers = [s.ms for s in inside if s.kind == "transfer" and s.ok]
    return requests, transfers, sum(1 for s in inside if not s.ok)


def _attack(attack: Attack, target: Target) -> Verdict:
    try:
        return attack(target)
    except Exception as exc:  # an attack that broke something on its way is an attack not answered as it must
        return Verdict(False, f"{type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class Outcome:
    windows: list[Window]
    samples: list[Sample]
    lost: list[str]  # good transfers the engine never completed, each with why
    pool_bytes: int  # staged bytes the engine still held once the good traffic stopped
    log_dir: Path


def run(window_s: float = WINDOW_S) -> Outcome:
    """The baseline window, then one window per attack, each at least `window_s` long."""
    log_dir = Path(tempfile.mkdtemp(prefix="p2pkv-bench-abuse-"))
    secret, client_key, admin_key = (secrets.token_hex(16) for _ in range(3))
    cluster = Cluster(model="stub", log_dir=log_dir)
    cluster.extra_env.update({"P2PKV_PROXY_API_KEY": client_key, "P2PKV_PROXY_ADMIN_KEY": admin_key})
    p_port, d_port, proxy_port, discovery_port = free_ports(4)
    for name, port in (("prefill-stub", p_port), ("decode-stub", d_port)):
        cluster.processes.append(Process(name, [sys.executable, "-m", "p2pkv.bench.stub", str(port)],
                                         log_dir / f"{name}.log", cluster.env(), f"http://127.0.0.1:{port}/health"))
    proxy = cluster.add_proxy(proxy_port, [f"127.0.0.1:{p_port}"], [f"127.0.0.1:{d_port}@127.0.0.1:1"],
                              discovery_port, secret=secret, args=["--body-timeout", str(BODY_TIMEOUT_S)])
    landed: mp.Queue[str | None] = _SPAWN.Queue()
    transfer_ids: mp.Queue[str] = _SPAWN.Queue()
    engine_pipe, engine_end = _SPAWN.Pipe()
    good_pipe, good_end = _SPAWN.Pipe()
    receiver = _SPAWN.Process(target=receive_run, args=(engine_end, landed, secret, MAX_CONNECTIONS))
    good = None
    windows: list[Window] = []
    try:
        cluster.start(timeout_s=60)
        assert proxy.popen is not None
        receiver.start()
        if not engine_pipe.poll(60):
            raise RuntimeError("the attacked engine did not start")
        kv_address, engine_pid = engine_pipe.recv()
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        good = _SPAWN.Process(target=good_run, args=(good_end, landed, proxy_url, client_key, kv_address, secret,
                                                     transfer_ids))
        good.start()
        if not good_pipe.poll(60):
            raise RuntimeError("the good traffic did not start")
        good_pipe.recv()
        target = Target(proxy_url, f"127.0.0.1:{discovery_port}", client_key, admin_key, kv_address, secret,
                        MAX_CONNECTIONS, BODY_TIMEOUT_S, transfer_ids, landed)
        time.sleep(2.0)  # warm: connections made, first requests served
        for name, attack in (("baseline (no attack)", None), *ATTACKS):
            drain(transfer_ids)
            start = time.monotonic()
            verdict = _attack(attack, target) if attack is not None else Verdict(True, "")
            end = max(time.monotonic(), start + window_s)
            time.sleep(max(0.0, end - time.monotonic()) + SETTLE_S)
            windows.append(Window(name, start, end, verdict, usage(proxy.popen.pid), usage(engine_pid)))
            print(f"  {name}: {'answered' if verdict.ok else 'NOT ANSWERED'}; {verdict.what}", flush=True)
        good_pipe.send("stop")
        if not good_pipe.poll(60):
            raise RuntimeError("the good traffic did not stop")
        samples: list[Sample] = good_pipe.recv()
        if not engine_pipe.poll(120):
            raise RuntimeError("the attacked engine did not report")
        lost, pool_bytes = engine_pipe.recv()
    finally:
        for child in (good, receiver):
            if child is not None:
                child.join(30)
                if child.is_alive():
                    child.kill()
        cluster.stop()
    return Outcome(windows, samples, lost, pool_bytes, log_dir)


def report(outcome: Outcome) -> int:
    """The table, and each target missed; 1 if any was."""
    windows, samples, lost, pool_bytes = outcome.windows, outcome.samples, outcome.lost, outcome.pool_bytes
    base_requests, base_transfers, _ = _figures(samples, windows[0])
    base_p99, base_t99 = _p(base_requests, 0.99), _p(base_transfers, 0.99)
    missed = []
    print(f"{'window':<40}{'answered':>9}{'req p50':>9}{'req p99':>9}{'x base':>8}{'push p99':>10}{'x base':>8}"
          f"{'failed':>7}   proxy fds/threads/MiB   engine fds/threads/MiB")
    for window in windows:
        requests, transfers, failed = _figures(samples, window)
        r99, t99 = _p(requests, 0.99), _p(transfers, 0.99)
        print(f"{window.name:<40}{'yes' if window.verdict.ok else 'NO':>9}{_p(requests, 0.5):>9.1f}{r99:>9.1f}"
              f"{r99 / base_p99:>8.2f}{t99:>10.1f}{t99 / base_t99:>8.2f}{failed:>7}   "
              f"{'/'.join(map(str, window.proxy)):>21}   {'/'.join(map(str, window.engine)):>22}")
        if not window.verdict.ok:
            missed.append(f"{window.name}: not answered as it must ({window.verdict.what})")
        if r99 > TARGET_P99 * base_p99 or t99 > TARGET_P99 * base_t99:
            missed.append(f"{window.name}: good p99 above {TARGET_P99:g}x the baseline")
        if failed:
            missed.append(f"{window.name}: {failed} good requests or transfers failed")
    print(f"good samples: {len(samples)}; transfers the engine never completed: {len(lost)}; "
          f"its pool in use at the end: {pool_bytes} B")
    if lost:
        missed.append(f"{len(lost)} good transfers lost, e.g. {lost[0]}")
    if pool_bytes:
        missed.append(f"the engine's pool holds {pool_bytes} B at the end")
    first, last = windows[0], windows[-1]
    for name, before, after in (("proxy", first.proxy, last.proxy), ("engine", first.engine, last.engine)):
        if after[0] > before[0] + 16 or after[1] > before[1] + 8:
            missed.append(f"the {name} holds {after[0]} descriptors and {after[1]} threads after the attacks, "
                          f"{before[0]} and {before[1]} before")
    print(f"logs: {outcome.log_dir}")
    for line in missed:
        print(f"MISSED: {line}")
    print("every target met" if not missed else f"{len(missed)} targets missed")
    return 1 if missed else 0


def main() -> int:
    return report(run())


if __name__ == "__main__":
    sys.exit(main())
