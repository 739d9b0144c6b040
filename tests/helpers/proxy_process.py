"""A real proxy process (`python -m p2pkv proxy`) on loopback for the attack tests, and ZMQ senders of raw discovery
messages, as an attacker on the network would send them."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import zmq

from p2pkv.bench.cluster import free_ports

ROOT = str(Path(__file__).resolve().parents[2])
START_TIMEOUT_S = 20.0


def proxy_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This checkout's package first; no key or secret but those given."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("P2PKV_AUTH_SECRET", "P2PKV_PROXY_API_KEY", "P2PKV_PROXY_ADMIN_KEY")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return {**env, **(extra or {})}


def proxy_argv(port: int, discovery_port: int, *args: str, host: str = "127.0.0.1") -> list[str]:
    return [sys.executable, "-m", "p2pkv", "proxy", "--host", host, "--port", str(port),
            "--discovery-port", str(discovery_port), *args]


@dataclass
class ProxyProcess:
    url: str  # http://127.0.0.1:PORT
    port: int
    discovery_port: int
    log_path: Path
    popen: subprocess.Popen[bytes]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=10, **kwargs)

    def listed(self) -> list[dict[str, Any]]:
        instances: list[dict[str, Any]] = self.get("/instances").json()["instances"]
        return instances

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.popen.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def metric(self, name: str) -> float:
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0


@contextmanager
def proxy_process(log_dir: Path, *args: str, env: dict[str, str] | None = None, host: str = "127.0.0.1",
                  open_files: int = 0) -> Iterator[ProxyProcess]:
    """A proxy started with `args` (after its ports), healthy, stopped after; `open_files`: its limit of open
    files, which it cannot raise."""
    port, discovery_port = free_ports(2)
    log_path = log_dir / f"proxy-{port}.log"
    with log_path.open("wb") as log:
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))) if open_files else None
        popen = subprocess.Popen(proxy_argv(port, discovery_port, *args, host=host), stdout=log,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=proxy_env(env),
                                 preexec_fn=limit)
    proxy = ProxyProcess(f"http://127.0.0.1:{port}", port, discovery_port, log_path, popen)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if popen.poll() is not None:
                raise RuntimeError(f"the proxy exited with {popen.returncode}:\n{proxy.log()}")
            try:
                if httpx.get(f"{proxy.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the proxy did not start:\n{proxy.log()}")
            time.sleep(0.1)
        yield proxy
    finally:
        popen.terminate()
        try:
            popen.wait(10)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(10)


class Dealer:
    """A ZMQ DEALER connected to a discovery port: what any instance, or anyone else, sends heartbeats with."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)

    def send(self, raw: bytes) -> None:
        self._sock.send(raw)

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


@contextmanager
def dealer(endpoint: str) -> Iterator[Dealer]:
    sock = Dealer(endpoint)
    try:
        yield sock
    finally:
        sock.close()


@contextmanager
def beating(endpoint: str, beats: Callable[[], Sequence[bytes]], every_s: float) -> Iterator[None]:
    """Real instances' heartbeats (`beats()` each time), sent every `every_s` on a socket of their own until the end
    of the block."""
    stop = threading.Event()

    def run() -> None:
        with dealer(endpoint) as sock:
            while not stop.is_set():
                for raw in beats():
                    sock.send(raw)
                stop.wait(every_s)

    thread = threading.Thread(target=run, name="test-beats", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
