"""`scripts/gpu_check.sh`: every check that needs a CUDA GPU, as one table of PASS / FAIL / SKIP rows; exit status 1 if
any row fails. Rows (a) to (h) measure what users run (`p2pkv.bench.gpu_rows`); each has a target it can fail.

Without a CUDA device every row is reported as skipped and the exit status is 0. Each check runs in a process of its
own, to a deadline (`P2PKV_GPU_ROW_TIMEOUT_S`, 90 s by default): a hung check, or one that breaks its CUDA context,
fails its own row and no other.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from p2pkv.bench import gpu_rows
from p2pkv.bench.push_timeline import push_timeline


@dataclass(frozen=True)
class Row:
    name: str
    outcome: str  # PASS, FAIL, SKIP
    detail: str


def _pinned_pool() -> str:
    """The host pool pins ahead of demand on its own thread (cudaHostRegister, segment by segment), and copies
    between it and the device reach 80% of a plain pinned copy."""
    import torch

    from p2pkv.bench.staged import mean_seconds
    from p2pkv.memory import HostPool

    size = 1 << 30
    pool = HostPool(2 * size, segment=size // 4)
    pool.prepare()
    deadline = time.monotonic() + 30
    buf = further = None
    while (buf is None or further is None) and time.monotonic() < deadline:  # refused until pinned, then given
        buf = buf or pool.allocate(size // 2)
        further = further or pool.allocate(size // 2)
        time.sleep(0.05)
    if buf is None or further is None:
        raise AssertionError("the pool did not pin 1 GiB ahead of demand in 30 s")
    host = torch.frombuffer(buf.view, dtype=torch.uint8)
    if not host.is_pinned() or not torch.frombuffer(further.view, dtype=torch.uint8).is_pinned():
        raise AssertionError("the host pool is not pinned")
    baseline_host = torch.empty(size // 2, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(size // 2, dtype=torch.uint8, device="cuda")

    def gbps(src: torch.Tensor, dst: torch.Tensor) -> float:
        return float(src.numel() / mean_seconds(lambda: dst.copy_(src, non_blocking=True), "cuda") / 1e9)

    h2d, base_h2d = gbps(host, device), gbps(baseline_host, device)
    d2h, base_d2h = gbps(device, host), gbps(device, baseline_host)
    pool.close()
    ratio = min(h2d / base_h2d, d2h / base_d2h)
    if ratio < 0.8:
        raise AssertionError(f"pool copies at {ratio:.2f}x a pinned copy")
    return f"to device {h2d:.1f} GB/s ({h2d / base_h2d:.2f}x), to host {d2h:.1f} GB/s ({d2h / base_d2h:.2f}x)"


CHECKS: tuple[tuple[str, Callable[[], str]], ...] = (
    ("(a) cuda_ipc, a 1 GiB request between two processes", gpu_rows.cuda_ipc),
    ("(b) staging a 1 GiB request through pinned memory", gpu_rows.staging),
    ("(c) a half-head slice against whole heads", gpu_rows.head_slice_pull),
    ("(d) forward on a non-default stream, slice from an engine thread", gpu_rows.stream_order),
    ("(e) kernel blocks and layouts byte for byte", gpu_rows.kernel_blocks),
    ("(f) nccl between two GPUs, a peer killed mid-transfer", gpu_rows.nccl_two_gpus),
    ("(g) landing while a 200 ms kernel runs", gpu_rows.landing),
    ("(h) each layer pushed as the forward's stream computes it", push_timeline),
    ("nccl binding, one rank to itself", gpu_rows.nccl_self),
    ("tcp with GPU caches through the pinned pool", gpu_rows.tcp_staged),
    ("pinned host pool, pinned ahead of demand", _pinned_pool),
)


ROW_TIMEOUT_S = float(os.environ.get("P2PKV_GPU_ROW_TIMEOUT_S", "90"))
_RESULT = "p2pkv-gpu-row\t"


def _one(index: int) -> int:
    """Run one check in this process: its measurements on stdout, a traceback on stderr if it fails, and its result
    as the last line (`_RESULT`, outcome, detail)."""
    _, check = CHECKS[index]
    try:
        outcome, detail = "PASS", check()
    except gpu_rows.RowSkipped as exc:
        outcome, detail = "SKIP", str(exc)
    except Exception as exc:  # the parent makes it a row
        traceback.print_exc()
        outcome, detail = "FAIL", f"{type(exc).__name__}: {exc}"
    print(f"{_RESULT}{outcome}\t{' '.join(detail.split())}", flush=True)
    return 0


def _in_child(index: int, timeout_s: float) -> Row:
    """One check in a process of its own, to a deadline: a hung check, or one that leaves the CUDA context broken,
    costs only its own row."""
    name = CHECKS[index][0]
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "p2pkv.bench.gpu_check", "--row", str(index)],
                              stdout=subprocess.PIPE, text=True, timeout=timeout_s)
        out, code = done.stdout, done.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        print(out, end="", flush=True)
        return Row(name, "FAIL", f"did not finish in {timeout_s:.0f} s")
    result = None
    for line in out.splitlines():
        if line.startswith(_RESULT):
            result = line[len(_RESULT):].split("\t", 1)
        else:
            print(line, flush=True)
    took = f" ({time.monotonic() - started:.1f} s)"
    if result is None or len(result) != 2:
        return Row(name, "FAIL", f"the check's process ended with status {code} and no result{took}")
    return Row(name, result[0], result[1] + took)


def run(timeout_s: float = ROW_TIMEOUT_S) -> list[Row]:
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    rows = []
    for index, (name, _) in enumerate(CHECKS):
        if not has_gpu:
            rows.append(Row(name, "SKIP", "no CUDA device on this machine"))
            continue
        print(f"== {name}", flush=True)
        rows.append(_in_child(index, timeout_s))
    return rows


def main() -> int:
    rows = run()
    width = max(len(r.name) for r in rows)
    print(f"{'check':<{width}}  result  detail")
    for r in rows:
        print(f"{r.name:<{width}}  {r.outcome:<6}  {r.detail}")
    failed = [r for r in rows if r.outcome == "FAIL"]
    skipped = [r for r in rows if r.outcome == "SKIP"]
    print(f"{len(rows) - len(failed) - len(skipped)} of {len(rows)} rows passed, {len(skipped)} skipped"
          + (f", {len(failed)} failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--row":
        raise SystemExit(_one(int(sys.argv[2])))
    raise SystemExit(main())
