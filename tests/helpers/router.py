"""`python -m p2pkv.bench.router` (vLLM's standard disaggregation protocol, no p2pkv fields) as a process of its
own, for tests that drive instances the way llm-d's sidecar or vLLM's NIXL test proxy does."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from p2pkv.bench.cluster import free_port


@contextmanager
def router(prefill: list[str], decode: list[str]) -> Iterator[str]:
    """`python -m p2pkv.bench.router` as a process of its own, serving once its /health answers."""
    port = free_port()
    argv = [sys.executable, "-m", "p2pkv.bench.router", "--port", str(port), "--prefill", *prefill,
            "--decode", *decode]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the router did not start"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
