"""A sending engine in its own process, for engine tests that need two real processes.

    python tests/helpers/peer.py push HOST:PORT TRANSFER_ID SEED LAYERS BLOCKS BLOCK_BYTES
    python tests/helpers/peer.py stall HOST:PORT TRANSFER_ID BLOCK_BYTES   (sends half a payload, then waits)
    python tests/helpers/peer.py offer LAYERS BLOCKS BLOCK_BYTES LEASE_S TRANSFER_ID SEED   (GET mode: holds the
        blocks; stdin lines "TRANSFER_ID" are answered with the offer's state)
    python tests/helpers/peer.py serve LAYERS BLOCK_BYTES SECRET   (one engine; stdin lines
        "push HOST:PORT TRANSFER_ID SEED BLOCKS" each answered with a JSON line)

Prints one JSON line with the outcome of the push.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

from p2pkv.config import ExtraConfig, Transport
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.handshake import client_handshake
from p2pkv.engine.sender import OutState
from p2pkv.params import Address
from p2pkv.protocol import FrameLimits, Hello, LayoutDigest, PushBlocks
from p2pkv.transport.tcp import TcpConnection

TRANSPORT_ENV = "P2PKV_TEST_TRANSPORT"
SCRIBBLE_ENV = "P2PKV_TEST_SCRIBBLE"  # a transfer id whose bytes the sender changes after taking their digest


def engine_config(**keys: Any) -> ExtraConfig:
    """Extra config for test engines, with the transport the test run asks for (env P2PKV_TEST_TRANSPORT)."""
    return ExtraConfig(transport=Transport(os.environ.get(TRANSPORT_ENV, "auto")), **keys)


def layout(layers: int, block_bytes: int) -> LayoutDigest:
    return LayoutDigest(layers, 16, block_bytes, "uint8", (block_bytes,), "test")


def payload(seed: int, layers: int, blocks: int, block_bytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(layers, blocks * block_bytes), dtype=np.uint8)


def start_engine(layers: int, block_bytes: int, secret: str = "") -> TransferEngine:
    settings = EngineSettings.from_config(engine_config(kv_host="127.0.0.1", auth_secret=secret), 0, 0)
    engine = TransferEngine(settings, layout(layers, block_bytes))
    engine.start()
    return engine


def push_with(engine: TransferEngine, peer: Address, transfer_id: str, seed: int, blocks: int) -> dict[str, object]:
    layers, block_bytes = engine.layout.num_layers, engine.layout.block_bytes
    data = payload(seed, layers, blocks, block_bytes)
    deadline = time.monotonic() + 20
    for layer in range(layers):
        engine.push_layer(transfer_id, peer, layer, blocks, (data[layer].data,), deadline)
    out = engine.wait_outgoing(transfer_id, deadline - time.monotonic())
    assert out is not None
    if out.state is OutState.SENDING:
        return {"state": "timeout"}
    return {"state": out.state.value, "reason": out.reason, "bytes": out.nbytes}


def push(peer: Address, transfer_id: str, seed: int, layers: int, blocks: int, block_bytes: int) -> dict[str, object]:
    engine = start_engine(layers, block_bytes)
    try:
        return push_with(engine, peer, transfer_id, seed, blocks)
    finally:
        engine.close()


def scribble_after_digest(transfer_id: str) -> None:
    """Fault injection for the integrity tests: the first byte of each frame of `transfer_id` changes right after
    the sender takes the frame's digest (a prefill block overwritten while its push is on the way)."""
    from p2pkv.engine import sender

    frames = sender._frames

    def scribbled(jobs: list[sender.PushJob], digests: bool = False) -> list[tuple[PushBlocks, tuple[memoryview, ...]]]:
        out = frames(jobs, digests)
        for push, views in out:
            if push.transfer_id == transfer_id:
                views[0][0] ^= 0xFF
        return out

    sender._frames = scribbled


def serve(layers: int, block_bytes: int, secret: str) -> None:
    if os.environ.get(SCRIBBLE_ENV):
        scribble_after_digest(os.environ[SCRIBBLE_ENV])
    engine = start_engine(layers, block_bytes, secret)
    try:
        for line in sys.stdin:
            words = line.split()
            if not words:
                continue
            _, address, tid, seed, blocks = words
            result = push_with(engine, Address.parse(address), tid, int(seed), int(blocks))
            print(json.dumps(result), flush=True)
    finally:
        engine.close()


def stall(peer: Address, transfer_id: str, block_bytes: int) -> None:
    conn = TcpConnection.connect(peer, time.monotonic() + 5, b"", FrameLimits())
    assert client_handshake(conn, Hello("stall", 0, layout(1, block_bytes)), time.monotonic() + 5) is conn
    half = memoryview(bytes(2 * block_bytes))[: block_bytes]
    frame = conn.encode(PushBlocks(transfer_id, 0, 0, 2, 2, 1), 2 * block_bytes)
    conn._sock.sendall(frame + bytes(half))
    print(json.dumps({"state": "stalled"}), flush=True)
    time.sleep(600)


def offer(layers: int, blocks: int, block_bytes: int, lease_s: float, tid: str, seed: int) -> None:
    engine = start_engine(layers, block_bytes)
    data = payload(seed, layers, blocks, block_bytes)

    def views(layer: int, first: int, count: int) -> tuple[memoryview, ...]:
        return (data[layer].data[first * block_bytes : (first + count) * block_bytes],)

    engine.offer(tid, blocks, views, lease_s)
    print(json.dumps({"address": engine.address}), flush=True)
    try:
        for line in sys.stdin:
            engine.housekeeping()
            state = engine.offer_state(line.strip())
            print(json.dumps({"state": None if state is None else state.value}), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "offer":
        offer(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6], int(sys.argv[7]))
        sys.exit(0)
    if mode == "serve":
        serve(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "")
        sys.exit(0)
    address = Address.parse(sys.argv[2])
    if mode == "push":
        tid, seed, layers, blocks, block_bytes = sys.argv[3], *map(int, sys.argv[4:8])
        print(json.dumps(push(address, tid, seed, layers, blocks, block_bytes)), flush=True)
    elif mode == "stall":
        stall(address, sys.argv[3], int(sys.argv[4]))
