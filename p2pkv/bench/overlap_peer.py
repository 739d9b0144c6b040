"""The prefill side of `p2pkv bench overlap`, in a child process: a connector worker side whose KV sits behind a
device layer (`PacedDevice`) that finishes the forward's layers one by one, as a GPU does after vLLM's thread has
queued them all."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection

import torch

from p2pkv.config import parse_connector_config
from p2pkv.engine.device import Fence
from p2pkv.kv.device_copy import HostOps, Marker
from p2pkv.params import Address
from p2pkv.vllm.metadata import P2pkvMetadata, SaveSpec
from p2pkv.vllm.worker import WorkerSide


class _Forward:
    """One forward: when it started (None until vLLM's thread has queued it all), and a layer's time."""

    def __init__(self, layer_s: float, layers: int) -> None:
        self.layer_s, self.layers, self.fences = layer_s, layers, 0
        self.start: float | None = None

    def reached(self, layer: int) -> bool:
        return self.start is not None and time.monotonic() >= self.start + (layer + 1) * self.layer_s


class PacedDevice(HostOps):
    """A device whose forward reaches its layer L at `start + (L + 1) * layer_s`, `start` being when vLLM's thread
    has queued it all (`go`). vLLM's thread records one fence per layer hook during a forward: the k-th stands for
    layer k (the one of `wait_for_save`, for the last). A copy issued after a fence is done once the forward has
    passed it; its bytes move when it is issued (the copy itself takes no time on this device)."""

    def __init__(self) -> None:
        super().__init__()
        self._forward = _Forward(0.0, 1)
        self._after = threading.local()

    def begin(self, layer_s: float, layers: int) -> None:
        self._forward = _Forward(layer_s, layers)

    def go(self) -> float:
        """The forward starts now (returned)."""
        self._forward.start = time.monotonic()
        return self._forward.start

    def fence(self) -> Fence:
        forward = self._forward
        layer = min(forward.fences, forward.layers - 1)
        forward.fences += 1
        return Fence((forward, layer), threading.current_thread().name)

    def passed(self, fence: Fence) -> bool:
        if not isinstance(fence.event, tuple):
            return True
        forward, layer = fence.event
        return bool(forward.reached(layer))

    @contextlib.contextmanager
    def issue(self, after: Sequence[Fence], stream: object | None = None) -> Iterator[None]:
        self._after.fences = [f for f in after if isinstance(f.event, tuple)]
        try:
            yield
        finally:
            self._after.fences = []

    def mark(self) -> Marker:
        fences: list[Fence] = list(getattr(self._after, "fences", []))
        return lambda: all(self.passed(f) for f in fences)


def llama_cache(layers: int, blocks: int, fill: bool) -> dict[str, torch.Tensor]:
    """Llama-3-8B's KV as vLLM gives it to a connector (LBHNC: one buffer, a layer's blocks after another's): blocks
    of 16 tokens of 8 KV heads of 128, K and V, bfloat16 (64 KiB)."""
    make = torch.randn if fill else torch.zeros
    buffer = make(layers, blocks, 8, 16, 256, dtype=torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(layers)}


def side(role: str, port: int, transport: str, kv: dict[str, torch.Tensor],
         ops: HostOps | None = None) -> WorkerSide:
    """A worker side of `role` on `port`, its KV handled as a GPU's (through host buffers and `ops`)."""
    extra = {"kv_host": "127.0.0.1", "transport": transport, "metrics_port": 0, "transfer_timeout_s": 60}
    config = parse_connector_config(role, port, "recompute", extra, "")
    worker = WorkerSide(config, rank=0, block_size=16, num_blocks=next(iter(kv.values())).shape[0], device_ops=ops)
    worker.register_kv_caches(kv)
    return worker


def prefill_run(conn: Connection, port: int, transport: str, layers: int, blocks: int, decode: str) -> None:
    """Serve `(transfer_id, block_ids, layer_s)`: a forward that pushes those blocks to `decode` layer by layer as
    the device finishes them; answers its start at once, then the push's outcome."""
    torch.set_num_threads(1)  # as the decode side (`p2pkv.bench.overlap.main`)
    ops = PacedDevice()
    kv = llama_cache(layers, blocks, True)
    prefill = side("kv_producer", port, transport, kv, ops)
    peer = Address.parse(decode)
    try:
        conn.send("ready")
        while (job := conn.recv()) is not None:
            tid, block_ids, layer_s = job
            ops.begin(layer_s, layers)
            prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id=tid, transfer_id=tid, peer=peer, block_ids=block_ids)]))
            for name in kv:
                prefill.save_layer(name)
            prefill.wait_for_save()
            start = ops.go()
            conn.send(start)
            # vLLM's thread would go on with its next steps, on a core of its own: here it waits for the push,
            # off the two cores' way, then steps until the push is reported sent.
            out = prefill.engine.wait_outgoing(tid, 60)
            state = out.state.value if out is not None else "unknown"
            deadline = time.monotonic() + 60
            sent: set[str] = set()
            while tid not in sent and time.monotonic() < deadline:
                prefill.bind(P2pkvMetadata(idle=True))
                sent = prefill.get_finished({tid})[0] or set()
            conn.send(state)
    finally:
        prefill.shutdown()
