"""The transfer engine on its own, without vLLM: one process offers KV-shaped blocks, another pushes and pulls.

    python examples/engine_direct.py [--transport auto|tcp|shm]

The receiving engine runs in this process; the sending engine runs in a child process and pushes one transfer
(PUT), then holds a second one for this process to pull (GET). Both transfers are checked byte for byte.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np

from p2pkv.config import ExtraConfig, Transport
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.offers import OfferState
from p2pkv.engine.puller import PullState
from p2pkv.engine.sender import OutState
from p2pkv.engine.store import StageState
from p2pkv.params import Address
from p2pkv.protocol import LayoutDigest

LAYERS, BLOCKS, BLOCK_BYTES = 4, 6, 64 << 10
LAYOUT = LayoutDigest(num_layers=LAYERS, block_size=16, block_bytes=BLOCK_BYTES, dtype="uint8",
                      block_shape=(BLOCK_BYTES,), kernel="example")


def kv(seed: int) -> np.ndarray:
    """Stand-in for a KV cache: LAYERS x (BLOCKS blocks of BLOCK_BYTES)."""
    return np.random.default_rng(seed).integers(0, 256, (LAYERS, BLOCKS * BLOCK_BYTES), dtype=np.uint8)


def wait_until(done: Callable[[], bool], deadline: float, what: str) -> None:
    """Poll `done` until it holds; every wait here has a deadline."""
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen in time")
        time.sleep(0.01)


def start(transport: str) -> TransferEngine:
    extra = ExtraConfig(kv_host="127.0.0.1", transport=Transport(transport), transfer_timeout_s=10)
    engine = TransferEngine(EngineSettings.from_config(extra, port=0, metrics_port=0), LAYOUT)
    engine.start()
    return engine


def sender(pipe: Connection, transport: str, peer: str) -> None:
    engine = start(transport)
    cache = kv(seed=1)
    deadline = time.monotonic() + 10
    # PUT: push every layer of blocks 0..BLOCKS-1 to the receiver.
    for layer in range(LAYERS):
        engine.push_layer("put-1", Address.parse(peer), layer, BLOCKS, (cache[layer].data,), deadline)
    out = engine.wait_outgoing("put-1", timeout_s=deadline - time.monotonic())  # done, failed or refused
    if out is not None and out.state is OutState.SENDING:
        raise TimeoutError("the push did not finish in time")
    # GET: hold the blocks of a second transfer under a lease, for the receiver to pull.
    held = kv(seed=2)
    engine.offer("get-1", BLOCKS, lambda layer, first, count: (
        held[layer][first * BLOCK_BYTES : (first + count) * BLOCK_BYTES].data,), lease_s=10)
    pipe.send((out.state.value if out else "missing", engine.address))
    wait_until(lambda: engine.offer_state("get-1") not in (OfferState.OFFERED, OfferState.SERVING),
               time.monotonic() + 20, "the pull of the held blocks")
    final = engine.offer_state("get-1")
    pipe.send(final.value if final is not None else "missing")
    engine.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", default="auto", choices=["auto", "tcp", "shm"])
    args = parser.parse_args()
    receiver = start(args.transport)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=sender, args=(child, args.transport, receiver.address))
    proc.start()
    try:
        if not parent.poll(30):
            raise TimeoutError("the sending process did not report")
        pushed, sender_address = parent.recv()
        if receiver.wait_staged("put-1", timeout_s=10) not in (StageState.COMPLETE, StageState.FAILED):
            raise TimeoutError("the pushed transfer did not arrive in time")
        item = receiver.take_staged("put-1")
        assert item is not None and item.state is StageState.COMPLETE, "the push did not arrive"
        assert bytes(item.buffer) == kv(seed=1).tobytes(), "pushed bytes differ"
        print(f"PUT: {item.buffer.nbytes} bytes over {item.transport}; sender says {pushed}")
        receiver.release_staged(item)

        # Pull blocks 2..5 of the held transfer straight into our own "cache".
        mine = np.zeros((LAYERS, 4 * BLOCK_BYTES), dtype=np.uint8)
        receiver.pull("get-1", Address.parse(sender_address), 2, 4, lambda layer, first, count: (
            mine[layer][first * BLOCK_BYTES : (first + count) * BLOCK_BYTES].data,), time.monotonic() + 10)
        result = receiver.wait_pull("get-1", timeout_s=15)  # done, failed, or still pending at the timeout
        assert result is not None and result.state is PullState.DONE, f"pull failed: {result}"
        assert np.array_equal(mine, kv(seed=2)[:, 2 * BLOCK_BYTES :]), "pulled bytes differ"
        if not parent.poll(30):
            raise TimeoutError("the sending process did not report its offer")
        print(f"GET: {result.nbytes} bytes over {result.transport}; sender's offer is {parent.recv()}")
        return 0
    finally:
        proc.join(10)
        receiver.close()


if __name__ == "__main__":
    raise SystemExit(main())
