"""`scripts/gpu_check.sh`: every check that needs a CUDA GPU, as one table; exit status 1 if any row fails.

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

from p2pkv.bench.gpu_rows import cuda_ipc, nccl_self, scatter, tcp_staged


@dataclass(frozen=True)
class Row:
    name: str
    outcome: str  # PASS, FAIL, SKIP
    detail: str


def _layouts_on_device() -> str:
    """LayerGeometry ranges on CUDA views, every physical order: copying blocks by those byte ranges on the device
    lands exactly what the logical views say."""
    import torch

    from p2pkv.layout import LayerGeometry

    sizes = {"L": 3, "B": 12, "H": 8, "N": 16, "C": 256}
    checked = 0
    for order in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"):
        stride, step = {}, 1
        for dim in reversed(order):
            stride[dim] = step
            step *= sizes[dim]
        shape = [sizes[d] for d in "BHNC"]
        src_flat = torch.randn(step, device="cuda").to(torch.bfloat16)
        dst_flat = torch.zeros(step, device="cuda", dtype=torch.bfloat16)
        src_bytes, dst_bytes = src_flat.view(torch.uint8), dst_flat.view(torch.uint8)
        for layer in range(sizes["L"]):
            src = src_flat.as_strided(shape, [stride[d] for d in "BHNC"], layer * stride["L"])
            dst = dst_flat.as_strided(shape, [stride[d] for d in "BHNC"], layer * stride["L"])
            moves = {3: 1, 4: 2, 9: 7}
            s_ranges = LayerGeometry.of(src).ranges(list(moves))
            d_ranges = LayerGeometry.of(dst).ranges(list(moves.values()))
            payload = torch.cat([src_bytes[a : a + n] for a, n in s_ranges])
            at = 0
            for a, n in d_ranges:
                dst_bytes[a : a + n].copy_(payload[at : at + n])
                at += n
            for s, d in moves.items():
                if not torch.equal(dst[d], src[s]):
                    raise AssertionError(f"{order} layer {layer}: block {s} -> {d} differs")
            checked += len(moves)
    return f"{checked} block copies over 6 physical orders, byte for byte"


def _pinned_pool() -> str:
    """The host pool is pinned with CUDA as it is used (cudaHostRegister, segment by segment), and copies between
    it and the device reach 80% of a plain pinned copy."""
    import torch

    from p2pkv.bench.staged import mean_seconds
    from p2pkv.memory import HostPool

    size = 1 << 30
    pool = HostPool(2 * size, segment=size // 4)
    buf, further = pool.allocate(size // 2), pool.allocate(size // 2)
    assert buf is not None and further is not None
    host = torch.frombuffer(buf.view, dtype=torch.uint8)
    if not host.is_pinned() or not torch.frombuffer(further.view, dtype=torch.uint8).is_pinned():
        raise AssertionError("the host pool is not pinned")
    if pool.pinned_bytes != size:
        raise AssertionError(f"{pool.pinned_bytes} bytes pinned for 1 GiB handed out")
    baseline_host = torch.empty(size // 2, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(size // 2, dtype=torch.uint8, device="cuda")

    def gbps(src: torch.Tensor, dst: torch.Tensor) -> float:
        return float(src.numel() / mean_seconds(lambda: dst.copy_(src, non_blocking=True), "cuda") / 1e9)

    h2d, base_h2d = gbps(host, device), gbps(baseline_host, device)
    d2h, base_d2h = gbps(device, host), gbps(device, baseline_host)
    ratio = min(h2d / base_h2d, d2h / base_d2h)
    if ratio < 0.8:
        raise AssertionError(f"pool copies at {ratio:.2f}x a pinned copy")
    return f"to device {h2d:.1f} GB/s ({h2d / base_h2d:.2f}x), to host {d2h:.1f} GB/s ({d2h / base_d2h:.2f}x)"


CHECKS: tuple[tuple[str, Callable[[], str]], ...] = (
    ("KV layouts on CUDA tensors", _layouts_on_device),
    ("pinned host pool bandwidth", _pinned_pool),
    ("cuda_ipc transport (two processes, one GPU)", cuda_ipc),
    ("nccl pipe (one-rank send to self)", nccl_self),
    ("tcp with GPU tensors (pinned staging)", tcp_staged),
    ("scatter into a paged cache >= 0.5x device copy", scatter),
)


ROW_TIMEOUT_S = float(os.environ.get("P2PKV_GPU_ROW_TIMEOUT_S", "90"))
_RESULT = "p2pkv-gpu-row\t"


def _one(index: int) -> int:
    """Run one check in this process: its measurements on stdout, a traceback on stderr if it fails, and its result
    as the last line (`_RESULT`, outcome, detail)."""
    _, check = CHECKS[index]
    try:
        outcome, detail = "PASS", check()
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
    print(f"{len(rows) - len(failed)} of {len(rows)} rows did not fail" + (f"; {len(failed)} failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--row":
        raise SystemExit(_one(int(sys.argv[2])))
    raise SystemExit(main())
