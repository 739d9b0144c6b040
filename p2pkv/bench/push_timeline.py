"""(h) of the GPU check: PUT_ASYNC's timeline on real CUDA streams. A forward of 32 layers runs on a non-default
stream (as vLLM's does), each layer a `torch.cuda._sleep` of `layer_ms` after which vLLM's thread's fence is
recorded; each layer's copy to pinned memory is issued after its fence and pushed by a real engine over tcp to
another as soon as it is done. A thread notes when each layer's compute finished (its fence's event, asked every
50 us); the receiving engine notes each layer's arrival. Targets: the median layer arrives <= 10 ms after its
compute, the last <= 2 x that median after the forward's end; the bytes staged are the cache's."""

from __future__ import annotations

import statistics
import threading
import time

import torch

from p2pkv.bench.gpu_rows import sleep_cycles
from p2pkv.bench.plan import Geometry, vllm_like_cache
from p2pkv.config import ExtraConfig, Transport
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.sender import OutState
from p2pkv.engine.store import StageState
from p2pkv.kv.buffers import TransferBuffers
from p2pkv.kv.staging import DeviceKv
from p2pkv.memory import HostPool
from p2pkv.params import Address

LAG_TARGET_MS = 10.0


def _watch(events: list[torch.cuda.Event], count: int, done: list[float], deadline: float) -> None:
    """When each of `count` events (appended as the forward is queued) completes, in order."""
    for at in range(count):
        while at >= len(events) or not events[at].query():
            if time.monotonic() >= deadline:
                return  # the caller finds fewer times than layers
            time.sleep(50e-6)
        done.append(time.monotonic())


def _forward(kv: DeviceKv, buffers: TransferBuffers, sender: TransferEngine, peer: Address, tid: str,
             ids: tuple[int, ...], cycles: int) -> list[float]:
    """One forward pushing `ids` layer by layer; when each layer's compute was done."""
    events: list[torch.cuda.Event] = []
    done: list[float] = []
    deadline = time.monotonic() + 60
    watcher = threading.Thread(target=_watch, args=(events, kv.num_layers, done, deadline), daemon=True)
    watcher.start()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for layer in range(kv.num_layers):
            if cycles:
                torch.cuda._sleep(cycles)
            fence = kv.fence()  # vLLM's thread in the layer's hook: its current stream is the forward's
            assert isinstance(fence.event, torch.cuda.Event)
            events.append(fence.event)
            views, ready = buffers.push_views(tid, layer, ids, fence)
            sender.push_layer(tid, peer, layer, len(ids), views, deadline, ready)
    watcher.join(60)
    if len(done) != kv.num_layers:
        raise AssertionError("the forward's layers did not finish in 60 s")
    return done


def push_timeline(layer_ms: float = 20.0) -> str:
    g = Geometry(layers=32, blocks=128)  # Llama-3-8B, a 2,048-token prompt: 8 MiB a layer
    views = vllm_like_cache(g, 160, "cuda", fill=True)
    torch.cuda.synchronize()
    kv = DeviceKv(views, g.block_size, "cuda", 60)
    kv.pool = HostPool(1 << 30)
    kv.pool.prepare(1 << 30)
    buffers = TransferBuffers(kv)
    extra = ExtraConfig(kv_host="127.0.0.1", transport=Transport.TCP, transfer_timeout_s=60)
    sender, receiver = (TransferEngine(EngineSettings.from_config(extra, 0, 0), kv.digest) for _ in range(2))
    receiver.start()
    sender.start()
    peer = Address.parse(receiver.address)
    ids = tuple(range(150, 150 - g.blocks, -1))
    try:
        cycles = sleep_cycles(layer_ms / 1000)
        lags: list[float] = []
        tail = 0.0
        for tid, paced in (("warm", False), ("paced", True)):
            done = _forward(kv, buffers, sender, peer, tid, ids, cycles if paced else 0)
            if receiver.wait_staged(tid, 60) is not StageState.COMPLETE:
                raise AssertionError(f"{tid}: the push did not arrive")
            out = sender.wait_outgoing(tid, 60)
            if out is None or out.state is not OutState.DONE:
                raise AssertionError(f"{tid}: {out}")
            item = receiver.take_staged(tid)
            assert item is not None
            for layer in (0, g.layers - 1):
                expected = views[layer][list(ids)].contiguous().view(torch.uint8).cpu().numpy().tobytes()
                if bytes(item.layer_view(layer)) != expected:
                    raise AssertionError(f"{tid}: layer {layer}: the staged bytes are not the cache's")
            lags = [(item.arrived[layer] - done[layer]) * 1000 for layer in range(g.layers)]
            tail = lags[-1]
            receiver.release_staged(item)
            buffers.release(tid)
    finally:
        sender.close()
        receiver.close()
        kv.pool.close()
    median = statistics.median(lags)
    detail = (f"a layer every {layer_ms:g} ms, 8 MiB each over tcp: median arrival {median:.2f} ms after its compute "
              f"(max {max(lags):.2f}), the last {tail:.2f} ms after the forward")
    print(f"per-layer arrival after compute (ms): {' '.join(f'{lag:.1f}' for lag in lags)}")
    if median > LAG_TARGET_MS or tail > 2 * median:
        raise AssertionError(detail + f"; targets median <= {LAG_TARGET_MS:g} ms, last <= 2 x median")
    return detail
