"""`p2pkv bench overlap`: PUT_ASYNC's promise on a GPU, measured on the CPU. A prefill worker side (a child process)
pushes a request's KV while a device layer finishes the forward's layers one by one, layer L at (L + 1) x
`layer_ms` after the forward began (`PacedDevice`); a decode worker side (this process, stepping as vLLM's idle
loop does) lands each layer as it arrives. Both are the connector's own worker sides over two real engines, over
tcp and over shm, with Llama-3-8B's geometry.

Per transport it prints the median, over layers, of a layer's arrival at the decode side minus the moment its copy
was done on the prefill side (`median layer lag`), and how long after the forward's end the last layer was in the
decode side's blocks (`last layer landed`), each the median of `rounds` rounds. Layers come `layer_ms` apart, so
each crosses alone: the median lag is also one layer's wire time in this run, the baseline of the second target.
Targets: lag <= 10 ms; last layer landed <= 2 x one layer's wire time (the last layer's own crossing, then its copy
into the blocks)."""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from p2pkv.bench.cluster import free_ports
from p2pkv.bench.overlap_peer import llama_cache, prefill_run, side
from p2pkv.kv.device_copy import HostOps
from p2pkv.kv.staging import STAGE_ENV
from p2pkv.params import Address
from p2pkv.vllm.metadata import LoadSpec, P2pkvMetadata
from p2pkv.vllm.worker import WorkerSide

_SPAWN = mp.get_context("spawn")
LAG_TARGET_MS = 10.0
TAIL_TARGET = 2.0  # x one layer's wire time
BLOCK_BYTES = 64 << 10  # 16 tokens x 8 KV heads x 128 x (K, V) x bfloat16


class LandingClock(HostOps):
    """The decode side's device layer: copies as the host's, each one's end noted by where it wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[float, int]] = []  # (when the copy ended, the address it wrote at)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        self.writes.append((time.monotonic(), dst.data_ptr()))

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        dst.index_copy_(0, index, src)
        self.writes.append((time.monotonic(), dst.data_ptr() + int(index.min()) * dst.stride(0) * dst.element_size()))


@dataclass(frozen=True)
class Round:
    lags_ms: list[float]  # per layer: arrival at the decode side minus its copy's end on the prefill side
    tail_ms: float  # the last layer in the decode side's blocks, after the forward's end


def _landed(clock: LandingClock, since: int, base: int, layer_bytes: int, layers: int) -> list[float]:
    """When each layer's last copy into the decode side's blocks ended, from the writes after `since`."""
    landed = [0.0] * layers
    for when, address in clock.writes[since:]:
        layer = (address - base) // layer_bytes
        if 0 <= layer < layers:
            landed[layer] = max(landed[layer], when)
    return landed


def _answer(conn: mp.connection.Connection, timeout_s: float, what: str) -> Any:
    if not conn.poll(timeout_s):
        raise RuntimeError(f"the prefill side did not send {what} in {timeout_s:g} s")
    return conn.recv()


def _round(decode: WorkerSide, clock: LandingClock, prefill: mp.connection.Connection, base: int, tid: str,
           layers: int, blocks: int, layer_s: float, prefill_at: Address) -> Round:
    ids = tuple(range(blocks))
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id=tid, transfer_id=tid, first_block=0, block_ids=ids,
                                              fallback_from=prefill_at)]))
    since = len(clock.writes)
    prefill.send((tid, ids, layer_s))
    start: float = _answer(prefill, 60, "the forward's start")
    deadline = time.monotonic() + 120
    decode.engine.wait_arrival(tid, 0, 120)  # its arrivals are read off the store before a step takes it
    item = decode.engine.store.peek(tid)
    loaded: set[str] = set()
    while tid not in loaded:
        if time.monotonic() > deadline:
            raise RuntimeError(f"transfer {tid} did not land")
        decode.bind(P2pkvMetadata(idle=True))  # vLLM steps on, computing nothing, while the load is on the way
        loaded = decode.get_finished(set())[1] or set()
    if decode.take_load_errors():
        raise RuntimeError(f"transfer {tid} failed to load")
    outcome = _answer(prefill, 60, "the push's outcome")
    if outcome != "done" or item is None:
        raise RuntimeError(f"transfer {tid}: the push ended {outcome}")
    landed = _landed(clock, since, base, blocks * BLOCK_BYTES, layers)
    lags = [(item.arrived[layer] - (start + (layer + 1) * layer_s)) * 1000 for layer in range(layers)]
    return Round(lags, (max(landed) - (start + layers * layer_s)) * 1000)


@dataclass(frozen=True)
class Result:
    transport: str
    lag_ms: float  # also one layer's wire time: each layer crosses alone
    tail_ms: float
    lags_ms: list[float]  # per layer, of the round whose median lag was the median

    @property
    def met(self) -> bool:
        return self.lag_ms <= LAG_TARGET_MS and self.tail_ms <= TAIL_TARGET * self.lag_ms


def run(transport: str, layers: int, tokens: int, layer_s: float, rounds: int) -> Result:
    blocks = tokens // 16
    p_port, d_port = free_ports(2)
    clock = LandingClock()
    kv = llama_cache(layers, blocks, False)
    base = next(iter(kv.values())).data_ptr()
    decode = side("kv_consumer", d_port, transport, kv, clock)
    parent, child = _SPAWN.Pipe()
    proc = _SPAWN.Process(target=prefill_run, args=(child, p_port, transport, layers, blocks, f"127.0.0.1:{d_port}"),
                          daemon=True)
    proc.start()
    try:
        if not parent.poll(120) or parent.recv() != "ready":
            raise RuntimeError("the prefill side did not start")
        at = Address("127.0.0.1", p_port)
        _round(decode, clock, parent, base, f"{transport}-warm", layers, blocks, 0.0, at)  # links, pages
        paced = [_round(decode, clock, parent, base, f"{transport}-{r}", layers, blocks, layer_s, at)
                 for r in range(rounds)]
    finally:
        parent.send(None)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        decode.shutdown()
    middle = sorted(paced, key=lambda r: statistics.median(r.lags_ms))[len(paced) // 2]
    return Result(transport, statistics.median(middle.lags_ms), statistics.median(r.tail_ms for r in paced),
                  middle.lags_ms)


def plot(results: Sequence[Result], layer_ms: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for result in results:
        ax.plot(range(len(result.lags_ms)), result.lags_ms, marker="o", markersize=3,
                label=f"{result.transport} (median {result.lag_ms:.1f} ms)")
    ax.axhline(LAG_TARGET_MS, color="grey", linestyle="--", label=f"target {LAG_TARGET_MS:g} ms")
    ax.set_xlabel("layer")
    ax.set_ylabel("arrival at the decode side after its copy was done (ms)")
    ax.set_title(f"p2pkv bench overlap: a layer every {layer_ms:g} ms, Llama-3-8B, 2 processes")
    ax.set_ylim(0, max(LAG_TARGET_MS, *(max(r.lags_ms) for r in results)) * 1.3)
    ax.legend(loc="upper right", ncols=3, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(layer_ms: float, layers: int, tokens: int, transports: Sequence[str], rounds: int, plot_to: str) -> int:
    import os

    os.environ[STAGE_ENV] = "1"  # both caches handled as a GPU's: through host buffers and the device layer
    # A worker's host side is one thread, as vLLM's is: torch's intra-op threads, each process's spinning on the
    # same two cores, made one 8 MiB landing copy take 0.5 to 5 ms; on one thread it takes 0.8 to 0.9.
    torch.set_num_threads(1)
    layer_mib = tokens // 16 * BLOCK_BYTES / (1 << 20)
    print(f"p2pkv bench overlap: Llama-3-8B geometry ({layers} layers, 8 KV heads of 128, bfloat16), {tokens} tokens "
          f"({layer_mib:.1f} MiB a layer, {layer_mib * layers:.0f} MiB a request); on the prefill side a layer's copy "
          f"from the device is done every {layer_ms:g} ms; medians of {rounds} rounds")
    missed, results = [], []
    for transport in transports:
        result = run(transport, layers, tokens, layer_ms / 1000, rounds)
        results.append(result)
        tail_target = TAIL_TARGET * result.lag_ms
        print(f"{transport}: median layer lag: {result.lag_ms:.2f} ms (target <= {LAG_TARGET_MS:g}; each layer "
              "crosses alone: one layer's wire time)")
        print(f"{transport}: last layer landed {result.tail_ms:.2f} ms after the forward (target <= "
              f"{tail_target:.2f}: {TAIL_TARGET:g} x one layer's wire time)")
        if not result.met:
            missed.append(transport)
    if plot_to:
        plot(results, layer_ms, plot_to)
        print(f"plot: {plot_to}")
    if missed:
        print(f"targets missed: {', '.join(missed)}")
        return 1
    return 0
