"""The sending side of `p2pkv bench transfer`, run in a child process, and the baselines' second process."""

from __future__ import annotations

import mmap
import os
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from p2pkv.config import ExtraConfig, Transport
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.sender import OutState
from p2pkv.memory.huge import HUGE, back_with_huge_pages
from p2pkv.params import Address
from p2pkv.protocol import LayoutDigest
from p2pkv.transport import cma
from p2pkv.transport.tcp import tune_socket

WINDOW = 8  # transfers in flight at once in a throughput run: a prefill batch of 8 requests pushing together
_SLACK = 2 * HUGE
_TORCH_OFFSET = 64


@dataclass(frozen=True)
class Shape:
    """A transfer shaped like KV: `layers` layers of `blocks` blocks of `block_bytes`."""

    layers: int
    blocks: int
    block_bytes: int
    huge_pages: bool = True  # the sending side's KV backed as the connector backs vLLM's (its `huge_pages` key)

    @classmethod
    def of(cls, nbytes: int, layers: int = 8, max_block: int = 256 << 10, huge_pages: bool = True) -> Shape:
        per_layer = max(1, nbytes // layers)
        blocks = max(1, -(-per_layer // max_block))
        return cls(layers, blocks, max(1, per_layer // blocks), huge_pages)

    @property
    def nbytes(self) -> int:
        return self.layers * self.blocks * self.block_bytes

    def layout(self) -> LayoutDigest:
        return LayoutDigest(self.layers, 16, self.block_bytes, "uint8", (self.block_bytes,), "bench")


def kv_buffer(shape: Shape) -> np.ndarray:
    """Zeroed bytes laid out as `layers` rows, placed as a transfer's blocks lie in vLLM's KV cache: inside a larger
    buffer (a cache holds many transfers; this one has 4 MiB more), 64 bytes past a 2 MiB boundary, as torch's CPU
    allocator places a large buffer 64 bytes into a page (numpy's malloc-backed arrays sit 16 bytes in, which made
    the kernel's copy between processes up to a third slower against page-aligned staging, or a real KV cache, than
    between two KV caches). Its pages are faulted in by writing zeros, as `torch.zeros` does vLLM's cache: 4 KiB
    pages where THP is `madvise` (numpy advises its own large arrays for huge pages, torch does not). With
    `huge_pages`, the buffer is then backed as the connector backs vLLM's cache."""
    region = mmap.mmap(-1, shape.nbytes + _SLACK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(region, np.uint8)  # keeps the mapping alive
    raw[:] = 0
    if shape.huge_pages:
        back_with_huge_pages(raw.ctypes.data, raw.nbytes)
    start = (-raw.ctypes.data) % HUGE + _TORCH_OFFSET
    return raw[start : start + shape.nbytes].reshape(shape.layers, shape.blocks * shape.block_bytes)


def kv_like(shape: Shape) -> np.ndarray:
    """Random bytes placed as `kv_buffer` places them."""
    data = kv_buffer(shape)
    data[:] = np.random.default_rng(0).integers(0, 256, data.shape, np.uint8)
    return data


def engine_for(shape: Shape, transport: str, buffer_bytes: int, checks: bool = False) -> TransferEngine:
    """`checks`: integrity_check, which the link then agrees with the peer (so the peer need not set it)."""
    extra = ExtraConfig(kv_host="127.0.0.1", transport=Transport(transport), kv_buffer_size=float(buffer_bytes),
                        mem_pool_size_gb=0.0, transfer_timeout_s=120.0, integrity_check=checks)
    engine = TransferEngine(EngineSettings.from_config(extra, 0, 0), shape.layout())
    engine.start()
    return engine


def _wait(engine: TransferEngine, tid: str, deadline: float) -> str:
    out = engine.wait_outgoing(tid, max(0.0, deadline - time.monotonic()))
    if out is None:
        return "missing"
    return "timeout" if out.state is OutState.SENDING else out.state.value


def push_run(pipe: Connection, shape: Shape, transport: str, peer: str, tids: list[str], sequential: bool,
             warmup: int) -> None:
    """Child process: push one transfer per id, in order, as the connector does (over shm all layers at once);
    report the start time of each and their outcomes.
    The first `warmup` transfers all finish before the next one starts."""
    engine = engine_for(shape, transport, shape.nbytes)
    data = kv_like(shape)
    views = [(data[layer].data,) for layer in range(shape.layers)]
    address = Address.parse(peer)
    started: list[float] = []
    states: list[str] = []
    deadline = time.monotonic() + 300
    lag = 1 if sequential else WINDOW  # transfers that may be in flight when the next one starts
    try:
        for i, tid in enumerate(tids):
            if i == warmup:
                states.extend(_wait(engine, t, deadline) for t in tids[len(states) : warmup])
            elif i >= lag and i - lag >= len(states):
                states.append(_wait(engine, tids[i - lag], deadline))
            started.append(time.monotonic())
            if transport == "shm":  # as the connector pushes host KV to a peer that reads it in place: at once
                engine.push_layers(tid, address, 0, shape.blocks, views, deadline)
            else:  # layer by layer, as the connector pushes while the forward computes them
                for layer in range(shape.layers):
                    engine.push_layer(tid, address, layer, shape.blocks, views[layer], deadline)
        for tid in tids[len(states) :]:
            states.append(_wait(engine, tid, deadline))
    finally:
        engine.close()
    pipe.send((started, states))


def offer_run(pipe: Connection, shape: Shape, transport: str, tids: list[str]) -> None:
    """Child process: hold one transfer per id for pulls (GET mode), report the address, wait to be told to stop."""
    engine = engine_for(shape, transport, shape.nbytes)
    data = kv_like(shape)
    per = shape.block_bytes
    try:
        for tid in tids:
            engine.offer(tid, shape.blocks, lambda layer, first, count: (
                data[layer][first * per : (first + count) * per].data,), lease_s=300)
        pipe.send(engine.address)
        pipe.poll(300)
    finally:
        engine.close()


def hold_run(pipe: Connection, shape: Shape) -> None:
    """Child process: the kernel-copy reference's source; KV-like bytes for another process to read, until told."""
    cma.allow_readers()
    data = kv_like(shape)
    pipe.send((os.getpid(), [(int(data[layer].ctypes.data), data[layer].nbytes) for layer in range(shape.layers)]))
    pipe.poll(300)


def stream_run(pipe: Connection, port: int, nbytes: int, count: int) -> None:
    """Child process: the socket baseline's sender; one plain stream of `count` x `nbytes`."""
    data = memoryview(np.random.default_rng(0).integers(0, 256, nbytes, np.uint8).data)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        tune_socket(sock)
        pipe.recv()
        pipe.send(time.monotonic())
        for _ in range(count):
            sock.sendall(data)
        pipe.recv()


def ping_run(pipe: Connection, port: int, nbytes: int, count: int) -> None:
    """Child process: the socket latency baseline's sender; `count` messages of `nbytes`, each sent once the
    previous one's one-byte answer is in; reports the start time of each."""
    data = memoryview(np.random.default_rng(0).integers(0, 256, nbytes, np.uint8).data)
    started: list[float] = []
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        tune_socket(sock)
        for _ in range(count):
            started.append(time.monotonic())
            sock.sendall(data)
            if not sock.recv(1):
                raise RuntimeError("the receiving process closed the connection early")
    pipe.send(started)
