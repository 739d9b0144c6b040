"""Engines in helper processes (tests/helpers/peer.py), driven line by line from a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HELPER = Path(__file__).resolve().parent / "peer.py"
ROOT = Path(__file__).resolve().parents[2]
LAYERS, BLOCKS, BLOCK_BYTES = 3, 5, 4096


class Peer:
    """A long-lived sending engine in another process, driven line by line."""

    def __init__(self, secret: str = "", layers: int = LAYERS, block_bytes: int = BLOCK_BYTES,
                 blocks: int = BLOCKS, env: dict[str, str] | None = None) -> None:
        env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, str(HELPER), "serve", str(layers), str(block_bytes), secret],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.blocks = blocks

    def push(self, address: str, tid: str, seed: int = 1) -> dict[str, object]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"push {address} {tid} {seed} {self.blocks}\n")
        self.proc.stdin.flush()
        result: dict[str, object] = json.loads(self.proc.stdout.readline())
        return result

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Offerer:
    """A prefill-side engine in another process holding one transfer for pulling (GET mode)."""

    def __init__(self, tid: str, seed: int, lease_s: float) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        args = ["offer", str(LAYERS), str(BLOCKS), str(BLOCK_BYTES), str(lease_s), tid, str(seed)]
        self.proc = subprocess.Popen([sys.executable, str(HELPER), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        self.address = json.loads(self.proc.stdout.readline())["address"]

    def state(self, tid: str) -> str | None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(tid + "\n")
        self.proc.stdin.flush()
        state: str | None = json.loads(self.proc.stdout.readline())["state"]
        return state

    def wait_state(self, tid: str, want: str, timeout_s: float = 5) -> str | None:
        """The offer's state once it is `want`, or whatever it is at the deadline (the offerer marks an offer
        served on its own thread, just after the puller may have seen the last byte)."""
        deadline = time.monotonic() + timeout_s
        while (state := self.state(tid)) != want and time.monotonic() < deadline:
            time.sleep(0.01)
        return state

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=20)
