"""`p2pkv bench transfer`: two engine processes on this host push KV-shaped transfers over each transport, next to
a baseline measured in the same run: a plain socket stream between two processes for `tcp`, a single-process
memcpy for `shm`. Prints GB/s and ratios per size, the latency of a 64 KiB transfer, and writes a PNG plot. For
`shm` it also measures the kernel's cross-process copy of the same bytes with no engine around it (`kernel`), the
most that transport could move."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import socket
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from p2pkv.bench import transfer_gpu, transfer_nixl
from p2pkv.bench.transfer_peer import (
    WINDOW,
    Shape,
    engine_for,
    hold_run,
    kv_buffer,
    offer_run,
    ping_run,
    push_run,
    stream_run,
)
from p2pkv.engine import TransferEngine
from p2pkv.engine.puller import PullState
from p2pkv.engine.store import StageState
from p2pkv.memory.huge import thp_mode
from p2pkv.params import Address
from p2pkv.transport.split_read import SplitReader
from p2pkv.transport.tcp import tune_socket

SIZES = tuple(1 << k for k in range(16, 29, 2))  # 64 KiB .. 256 MiB
TARGET = 0.9
TARGET_FROM = 256 << 10
LATENCY_TARGET_US = {"tcp": 50, "shm": 20}
LATENCY_BYTES = 64 << 10
BUSY = "a thread holding the interpreter lock in the receiving process"
PULL_BYTES = 1 << 20
_SPAWN = mp.get_context("spawn")


@dataclass
class Row:
    nbytes: int
    transport_gbps: dict[str, float] = field(default_factory=dict)
    baseline_gbps: dict[str, float] = field(default_factory=dict)
    kernel_gbps: float = 0.0  # shm's ceiling: process_vm_readv of the same bytes from another process, no engine
    nixl_gbps: dict[str, float] = field(default_factory=dict)  # --vs-nixl: NIXL's figure against each transport

    def ratio(self, transport: str) -> float:
        return self.transport_gbps[transport] / self.baseline_gbps[transport]


def _count(nbytes: int, budget_bytes: int) -> int:
    """Transfers per measurement: `budget_bytes` worth, at least 4, at most 2000 (about 0.2 s at 64 KiB)."""
    return max(4, min(2000, budget_bytes // nbytes))


def _collect(engine: TransferEngine, tids: Sequence[str], timeout_s: float) -> list[float]:
    """Completion time of each transfer, in order; staged bytes are released as soon as they are complete."""
    done: list[float] = []
    deadline = time.monotonic() + timeout_s
    for tid in tids:
        state = engine.wait_staged(tid, max(0.0, deadline - time.monotonic()))
        if state not in (StageState.COMPLETE, StageState.FAILED):
            raise RuntimeError(f"transfer {tid} did not complete")
        done.append(time.monotonic())
        if state is StageState.FAILED:
            raise RuntimeError(f"transfer {tid} failed: {engine.store.reason(tid)}")
        item = engine.take_staged(tid)
        if item is not None:
            engine.release_staged(item)
    return done


def _push(shape: Shape, transport: str, count: int, sequential: bool, warmup: int = 3,
          checks: bool = False) -> tuple[list[float], list[float]]:
    """Start and completion times of `count` transfers from a child process into this one, after `warmup`
    transfers that are not timed (connection set-up, staging pages faulted in); `checks`: integrity_check."""
    receiver = engine_for(shape, transport, max((2 * WINDOW + 4) * shape.nbytes, 64 << 20), checks)
    parent, child = _SPAWN.Pipe()
    prefix = f"{transport}-{shape.nbytes}-{'seq' if sequential else 'par'}-"
    tids = [f"{prefix}{i}" for i in range(warmup + count)]
    proc = _SPAWN.Process(target=push_run, args=(child, shape, transport, receiver.address, tids, sequential,
                                                 warmup), daemon=True)
    proc.start()
    try:
        done = _collect(receiver, tids, 300)
        if not parent.poll(60):
            raise RuntimeError("the sending process did not report")
        started, states = parent.recv()
        if any(s != "done" for s in states):
            raise RuntimeError(f"{transport} transfers ended as {sorted(set(states))}")
        return started[warmup:], done[warmup:]
    finally:
        proc.join(30)
        receiver.close()


def transfer_gbps(shape: Shape, transport: str, budget_bytes: int, checks: bool = False) -> float:
    count = _count(shape.nbytes, budget_bytes)
    started, done = _push(shape, transport, count, sequential=False, checks=checks)
    return count * shape.nbytes / (done[-1] - started[0]) / 1e9


def latency_ms(shape: Shape, transport: str, count: int = 40, checks: bool = False) -> float:
    started, done = _push(shape, transport, count, sequential=True, checks=checks)
    return statistics.median(d - s for s, d in zip(started, done, strict=True)) * 1000


@contextmanager
def busy_interpreter() -> Iterator[None]:
    """A thread of this process that runs Python without pause, as vLLM's does between the steps it launches: each
    of our threads that lets go of the interpreter lock then waits up to the switch interval (5 ms) to take it
    back."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    thread = threading.Thread(target=spin, name="p2pkv-bench-busy", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


def pull_latency_ms(shape: Shape, transport: str, count: int = 40, warmup: int = 3, checks: bool = False) -> float:
    """Median time of one GET-mode pull, from the request to the last byte in place, one pull at a time."""
    puller = engine_for(shape, transport, shape.nbytes, checks)
    parent, child = _SPAWN.Pipe()
    tids = [f"pull-{transport}-{i}" for i in range(warmup + count)]
    proc = _SPAWN.Process(target=offer_run, args=(child, shape, transport, tids), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("the offering process did not start")
        peer = Address.parse(parent.recv())
        local = kv_buffer(shape)  # the decode instance's KV cache
        per = shape.block_bytes

        def sink(layer: int, first: int, n: int) -> tuple[memoryview, ...]:
            return (local[layer][first * per : (first + n) * per].data,)

        times = []
        for tid in tids:
            started = time.monotonic()
            puller.pull(tid, peer, 0, shape.blocks, sink, started + 60)
            result = puller.wait_pull(tid, 60)
            if result is None or result.state is not PullState.DONE:
                raise RuntimeError(f"pull {tid} failed: {result}")
            times.append(time.monotonic() - started)
        parent.send("done")
        return statistics.median(times[warmup:]) * 1000
    finally:
        proc.join(30)
        puller.close()


def _recv_whole(conn: socket.socket, buf: memoryview) -> None:
    """Fill `buf` from a baseline's socket (its timeout bounds each wait)."""
    got = 0
    while got < buf.nbytes:
        n = conn.recv_into(buf[got:])
        if n == 0:
            raise RuntimeError("the sending process closed the connection early")
        got += n


def socket_gbps(nbytes: int, budget_bytes: int) -> float:
    count = _count(nbytes, budget_bytes)
    with socket.create_server(("127.0.0.1", 0)) as server:
        parent, child = _SPAWN.Pipe()
        proc = _SPAWN.Process(target=stream_run, args=(child, server.getsockname()[1], nbytes, count), daemon=True)
        proc.start()
        server.settimeout(60)
        conn, _ = server.accept()
        with conn:
            tune_socket(conn)
            conn.settimeout(60)  # a silent sender ends the measurement with an error, never a hang
            buf = memoryview(bytearray(nbytes))
            parent.send("go")
            if not parent.poll(60):
                raise RuntimeError("the streaming process did not start")
            started: float = parent.recv()
            for _ in range(count):
                _recv_whole(conn, buf)
            ended = time.monotonic()
            parent.send("done")
        proc.join(30)
    return count * nbytes / (ended - started) / 1e9


def socket_latency_ms(nbytes: int, count: int = 40, warmup: int = 3) -> float:
    """The latency floor for Python on this host: one message of `nbytes` from a child process over a plain socket,
    from the sender's first byte to the last one in this process, one at a time, as `latency_ms` times a transfer."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        parent, child = _SPAWN.Pipe()
        proc = _SPAWN.Process(target=ping_run, args=(child, server.getsockname()[1], nbytes, warmup + count),
                              daemon=True)
        proc.start()
        try:
            server.settimeout(60)
            conn, _ = server.accept()
            with conn:
                tune_socket(conn)
                conn.settimeout(60)  # a silent sender ends the measurement with an error, never a hang
                buf = memoryview(bytearray(nbytes))
                done = []
                for _ in range(warmup + count):
                    _recv_whole(conn, buf)
                    done.append(time.monotonic())
                    conn.sendall(b"k")
            if not parent.poll(60):
                raise RuntimeError("the sending process did not report")
            started: list[float] = parent.recv()
        finally:
            proc.join(30)
    return statistics.median(d - s for s, d in zip(started[warmup:], done[warmup:], strict=True)) * 1000


def kernel_gbps(shape: Shape, budget_bytes: int) -> float:
    """The kernel's cross-process copy alone, as the shm transport makes it (`SplitReader`: `process_vm_readv`,
    on two threads from 8 MiB), of the same KV-shaped bytes from a child process into memory mapped as the
    engine's staging pool maps it."""
    count = _count(shape.nbytes, budget_bytes)
    parent, child = _SPAWN.Pipe()
    proc = _SPAWN.Process(target=hold_run, args=(child, shape), daemon=True)
    proc.start()
    reader: SplitReader | None = None
    try:
        if not parent.poll(60):
            raise RuntimeError("the holding process did not start")
        pid, ranges = parent.recv()
        reader = SplitReader(pid)
        dest = mmap.mmap(-1, shape.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            dest.madvise(mmap.MADV_HUGEPAGE)
        views = [memoryview(dest)]
        reader.read(views, ranges)  # faults the destination in, as the warm-up transfers do
        started = time.perf_counter()
        for _ in range(count):
            reader.read(views, ranges)
        elapsed = time.perf_counter() - started
        views[0].release()
        dest.close()
        return count * shape.nbytes / elapsed / 1e9
    finally:
        if reader is not None:
            reader.close()
        parent.send("done")  # the holder stops now, also after a failed read
        proc.join(30)


def memcpy_gbps(nbytes: int, budget_bytes: int) -> float:
    count = _count(nbytes, budget_bytes)
    src = np.random.default_rng(0).integers(0, 256, nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)  # fault the destination's pages in first, as the engine's staging is after warm-up
    started = time.perf_counter()
    for _ in range(count):
        np.copyto(dst, src)
    return count * nbytes / (time.perf_counter() - started) / 1e9


def run(sizes: Sequence[int], transports: Sequence[str], budget_bytes: int, repeats: int = 1, checks: bool = False,
        huge_pages: bool = True, vs_nixl: bool = False) -> tuple[list[Row], dict[str, float]]:
    """Each figure is the best of `repeats` runs, for the transports and their baselines alike (this host's
    neighbours come and go; the best run is the one they disturbed least). `checks`: integrity_check on the
    engines' links (the baselines are unchanged). `huge_pages`: the sending side's KV (and the kernel reference's
    source) is backed by huge pages, as the connector backs vLLM's CPU KV cache by default. `vs_nixl`: NIXL's UCX
    write of the same shapes too, and its latency (in ms, as `NIXL` entries of the latencies)."""
    baselines = {"tcp": socket_gbps, "shm": memcpy_gbps}
    rows = []
    for nbytes in sizes:
        shape = Shape.of(nbytes, huge_pages=huge_pages)
        row = Row(shape.nbytes)
        for transport in transports:
            row.transport_gbps[transport] = max(transfer_gbps(shape, transport, budget_bytes, checks)
                                                for _ in range(repeats))
            row.baseline_gbps[transport] = max(baselines[transport](shape.nbytes, budget_bytes)
                                               for _ in range(repeats))
        if "shm" in transports:
            row.kernel_gbps = max(kernel_gbps(shape, budget_bytes) for _ in range(repeats))
        if vs_nixl:
            for transport in transports:
                row.nixl_gbps[transport] = transfer_nixl.measure(shape, transport, _count(shape.nbytes, budget_bytes),
                                                                 repeats).gbps
        rows.append(row)
    small = Shape.of(LATENCY_BYTES, huge_pages=huge_pages)
    latencies = {f"a 64 KiB transfer over {t}": latency_ms(small, t, checks=checks) for t in transports}
    with busy_interpreter():
        latencies.update({f"a 64 KiB transfer over {t}, {BUSY}": latency_ms(small, t, checks=checks)
                          for t in transports})
    latencies["64 KiB over a plain socket (Python, no engine)"] = socket_latency_ms(LATENCY_BYTES)
    if vs_nixl:
        latencies.update({f"a 64 KiB transfer, {transfer_nixl.NAMES[t]}": transfer_nixl.measure(
            small, t, _count(small.nbytes, budget_bytes), 1).latency_us / 1000 for t in transports})
    latencies.update({f"a 1 MiB pull (GET) over {t}": pull_latency_ms(
        Shape.of(PULL_BYTES, huge_pages=huge_pages), t, checks=checks)
                      for t in transports})
    return rows, latencies


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def write_plot(rows: Sequence[Row], transports: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"tcp": "plain socket stream", "shm": "single-process memcpy"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r.nbytes for r in rows]
    for transport in transports:
        line = ax.plot(xs, [r.transport_gbps[transport] for r in rows], marker="o", label=f"p2pkv {transport}")
        ax.plot(xs, [r.baseline_gbps[transport] for r in rows], linestyle="--", color=line[0].get_color(),
                label=f"baseline: {names[transport]}")
        if transport == "shm":
            ax.plot(xs, [r.kernel_gbps for r in rows], linestyle=":", color=line[0].get_color(),
                    label="process_vm_readv alone, as shm copies (its ceiling)")
        if all(transport in r.nixl_gbps for r in rows):
            ax.plot(xs, [r.nixl_gbps[transport] for r in rows], linestyle="-.", marker="x",
                    color=line[0].get_color(), label=transfer_nixl.NAMES[transport])
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [_size(x) for x in xs], rotation=30)
    ax.set_xlabel("transfer size (8 layers of KV blocks)")
    ax.set_ylabel("GB/s")
    ax.set_title("p2pkv bench transfer (two processes, one host)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(sizes: Sequence[int], transports: Sequence[str], budget_bytes: int, plot: str, repeats: int = 3,
         checks: bool = False, huge_pages: bool = True, vs_nixl: bool = False) -> int:
    if vs_nixl and not transfer_nixl.available():
        print("--vs-nixl: the nixl package is not importable here (pip install nixl)")
        return 2
    rows, latencies = run(sizes, transports, budget_bytes, repeats, checks, huge_pages, vs_nixl)
    if checks:
        print("integrity_check on: every engine payload carries its digest, checked where it lands")
    mode = thp_mode() or "not on this host"
    backing = ("2 MiB pages, as the connector backs vLLM's (huge_pages)" if huge_pages
               else "the pages it was allocated in (--no-huge-pages)")
    print(f"the sending side's KV: {backing}; the host's THP setting: {mode}")
    header = f"{'size':>9}"
    for t in transports:
        header += f"{t + ' GB/s':>12}{'baseline':>10}{'ratio':>8}"
    if "shm" in transports:
        header += f"{'kernel':>10}{'ceiling':>9}{'shm/kernel':>12}"
    print(header)
    failed: list[str] = []
    for row in rows:
        line = f"{_size(row.nbytes):>9}"
        for t in transports:
            ratio = row.ratio(t)
            line += f"{row.transport_gbps[t]:>12.2f}{row.baseline_gbps[t]:>10.2f}{ratio:>8.2f}"
            if row.nbytes >= TARGET_FROM and ratio < TARGET and t == "tcp":
                failed.append(f"tcp/socket at {_size(row.nbytes)}: {ratio:.2f}")
        if "shm" in transports:
            ceiling = row.kernel_gbps / row.baseline_gbps["shm"]
            of_kernel = row.transport_gbps["shm"] / row.kernel_gbps
            line += f"{row.kernel_gbps:>10.2f}{ceiling:>9.2f}{of_kernel:>12.2f}"
            if row.nbytes >= TARGET_FROM and of_kernel < TARGET:
                failed.append(f"shm/kernel at {_size(row.nbytes)}: {of_kernel:.2f}")
        print(line)
    print("baselines: tcp = a plain socket stream between two processes; shm = a single-process memcpy; "
          f"each figure is the best of {repeats} runs")
    if "shm" in transports:
        print("kernel = process_vm_readv of the same bytes from another process, no engine, as shm copies them (on two "
              "threads from 8 MiB); ceiling = kernel / memcpy, the most shm could reach against its baseline")
    if vs_nixl:
        failed += _print_nixl(rows, transports)
    for what, ms in latencies.items():
        how = "; the initiator sees its write done" if "NIXL" in what else ""
        print(f"latency of {what}: {ms * 1000:.0f} us (median{how})")
    for t in transports:
        us = latencies[f"a 64 KiB transfer over {t}"] * 1000
        if us > LATENCY_TARGET_US[t]:
            failed.append(f"64 KiB latency over {t}: {us:.0f} us (target {LATENCY_TARGET_US[t]} us)")
    write_plot(rows, transports, Path(plot))
    print(f"plot written to {plot}")
    failed += transfer_gpu.run(sizes, TARGET_FROM)
    targets = (f"{TARGET}x from {_size(TARGET_FROM)} up, tcp of the socket and shm of the kernel's copy; 64 KiB "
               f"latency <= {LATENCY_TARGET_US['tcp']} us tcp, {LATENCY_TARGET_US['shm']} us shm")
    if vs_nixl:
        targets += "; p2pkv >= NIXL at every size"
    if failed:
        print(f"targets ({targets}) missed: " + "; ".join(failed))
        return 1
    print(f"targets ({targets}) met")
    return 0


def _print_nixl(rows: Sequence[Row], transports: Sequence[str]) -> list[str]:
    """p2pkv against NIXL per size and transport; the sizes where p2pkv is slower."""
    header = f"{'size':>9}"
    for t in transports:
        header += f"{'p2pkv ' + t:>12}{transfer_nixl.NAMES[t]:>32}{'p2pkv/NIXL':>12}"
    print(header)
    slower = []
    for row in rows:
        line = f"{_size(row.nbytes):>9}"
        for t in transports:
            ratio = row.transport_gbps[t] / row.nixl_gbps[t]
            line += f"{row.transport_gbps[t]:>12.2f}{row.nixl_gbps[t]:>32.2f}{ratio:>12.2f}"
            if ratio < 1.0:
                slower.append(f"{t}/NIXL at {_size(row.nbytes)}: {ratio:.2f}")
        print(line)
    print("NIXL: its UCX backend, one WRITE request per transfer (a descriptor per layer), WINDOW in flight, done when "
          "the initiator sees it done; tcp: UCX_TLS=tcp; shm's peer: UCX's own pick of transports on one host")
    return slower
