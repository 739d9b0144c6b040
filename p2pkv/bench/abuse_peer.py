"""The two child processes of `p2pkv bench abuse`: the engine under attack, and the good traffic.

The attacked engine runs alone in its process, so its descriptors, threads and memory are its own; the good traffic
runs in another, so the attacker's threads in the bench's own process never slow the client that measures.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue

import httpx
import numpy as np

from p2pkv.config import ExtraConfig, Transport
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.sender import OutState
from p2pkv.engine.store import StageState
from p2pkv.params import Address
from p2pkv.protocol import LayoutDigest

LAYERS = 4
BLOCKS = 4
BLOCK_BYTES = 16 << 10  # 256 KiB a transfer
PUSH_EVERY_S = 0.02
REQUEST_EVERY_S = 0.01


def layout() -> LayoutDigest:
    return LayoutDigest(LAYERS, 16, BLOCK_BYTES, "uint8", (BLOCK_BYTES,), "abuse")


def engine(secret: str, max_connections: int = 256) -> TransferEngine:
    """An engine on loopback as an instance with `auth_secret` runs one."""
    extra = ExtraConfig(kv_host="127.0.0.1", transport=Transport.TCP, kv_buffer_size=float(64 << 20),
                        mem_pool_size_gb=0.0, transfer_timeout_s=10.0, auth_secret=secret,
                        max_connections=max_connections)
    started = TransferEngine(EngineSettings.from_config(extra, 0, 0), layout())
    started.start()
    return started


def usage(pid: int) -> tuple[int, int, int]:
    """Open descriptors, threads and resident MiB of a process on this host."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = len(os.listdir(f"/proc/{pid}/task"))
    with open(f"/proc/{pid}/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
    return fds, threads, rss


def receive_run(pipe: Connection, landed: Queue[str | None], secret: str, max_connections: int) -> None:
    """Child: the attacked engine. Takes the good transfers it is told of as they complete (as a decode worker
    loads them), and at the end reports how many of them never completed."""
    attacked = engine(secret, max_connections)
    lost: list[str] = []
    try:
        pipe.send((attacked.address, os.getpid()))
        while True:
            try:
                tid = landed.get(timeout=300)
            except queue.Empty:
                break
            if tid is None:
                break
            state = attacked.wait_staged(tid, 10.0)
            if state is not StageState.COMPLETE:
                lost.append(f"{tid}: {state.value if state else 'never arrived'} {attacked.staged_reason(tid)}")
            item = attacked.take_staged(tid)
            if item is not None:
                attacked.release_staged(item)
        pipe.send((lost, attacked.store.bytes_in_use))
    finally:
        attacked.close()


@dataclass(frozen=True)
class Sample:
    kind: str  # "request" or "transfer"
    started: float  # monotonic, shared by the processes of one host
    ms: float
    ok: bool


def good_run(pipe: Connection, landed: Queue[str | None], proxy_url: str, client_key: str, kv_address: str,
             secret: str, transfer_ids: Queue[str]) -> None:
    """Child: requests through the proxy and pushes to the attacked engine, each at its fixed pace, until told to
    stop; then every sample goes back. Each transfer id is published once the engine accepted it
    (`transfer_ids`), for the attacker to name ids another connection owns."""
    stop = threading.Event()
    samples: list[Sample] = []
    lock = threading.Lock()

    def requests() -> None:
        headers = {"authorization": f"Bearer {client_key}"} if client_key else {}
        body = {"model": "stub", "prompt": "hello", "max_tokens": 4}
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    ok = client.post(f"{proxy_url}/v1/completions", json=body, headers=headers).status_code == 200
                except httpx.HTTPError:
                    ok = False
                with lock:
                    samples.append(Sample("request", started, (time.monotonic() - started) * 1000, ok))
                stop.wait(max(0.0, started + REQUEST_EVERY_S - time.monotonic()))

    def transfers() -> None:
        sender = engine(secret)
        data = np.random.default_rng(0).integers(0, 256, (LAYERS, BLOCKS * BLOCK_BYTES), np.uint8)
        views = [(data[layer].data,) for layer in range(LAYERS)]
        peer = Address.parse(kv_address)
        try:
            while not stop.is_set():
                tid = f"good-{uuid.uuid4().hex[:12]}"
                landed.put(tid)
                started = time.monotonic()
                deadline = started + 10
                sender.push_layers(tid, peer, 0, BLOCKS, views, deadline)
                out = sender.wait_outgoing(tid, 10)
                ok = out is not None and out.state is OutState.DONE
                with lock:
                    samples.append(Sample("transfer", started, (time.monotonic() - started) * 1000, ok))
                sender.forget_outgoing(tid)
                transfer_ids.put(tid)  # once accepted: an attacker who learns an id learns it of a live transfer
                stop.wait(max(0.0, started + PUSH_EVERY_S - time.monotonic()))
        finally:
            sender.close()

    threads = [threading.Thread(target=requests, daemon=True), threading.Thread(target=transfers, daemon=True)]
    for thread in threads:
        thread.start()
    pipe.send("running")
    pipe.poll(1800)
    stop.set()
    for thread in threads:
        thread.join(30)
    landed.put(None)
    pipe.send(samples)
