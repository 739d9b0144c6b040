"""`p2pkv bench transfer --vs-nixl`: NIXL's UCX backend moving the same KV-shaped bytes between two processes on
this host, in the same run as p2pkv's figures. The initiator WRITEs each layer of a transfer into the target's
memory with one NIXL request (one descriptor per layer, as a KV connector describes a cache); a transfer counts as
done when NIXL reports the request DONE to the initiator.

Two UCX configurations: `tcp` (`UCX_TLS=tcp`), against p2pkv's tcp, and UCX's own choice on one host (its shared
memory and cross-memory-attach transports), against p2pkv's shm. Needs the `nixl` package (`pip install nixl`); its
processes are started with `spawn` and every wait has a deadline.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from p2pkv.bench.transfer_peer import WINDOW, Shape, kv_buffer, kv_like

_SPAWN = mp.get_context("spawn")
_WAIT_S = 120.0  # a step of the NIXL processes (start-up, metadata exchange, a measurement)
UCX_TLS = {"tcp": "tcp", "shm": ""}  # p2pkv transport -> UCX_TLS for the NIXL run it is compared with ("": UCX's pick)
NAMES = {"tcp": "NIXL UCX tcp", "shm": "NIXL UCX (its pick on one host)"}


def available() -> bool:
    return importlib.util.find_spec("nixl") is not None


@dataclass(frozen=True)
class NixlFigures:
    gbps: float  # WINDOW transfers in flight
    latency_us: float  # one transfer at a time, median


def _agent(name: str, tls: str):  # type: ignore[no-untyped-def]
    if tls:
        os.environ["UCX_TLS"] = tls  # read by UCX when the backend is created, in this process only
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # the benchmark's sockets stay on loopback, as p2pkv's do
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _layer_descs(base: int, shape: Shape) -> list[tuple[int, int, int]]:
    per = shape.blocks * shape.block_bytes
    return [(base + layer * per, per, 0) for layer in range(shape.layers)]


def target_run(pipe: Connection, tls: str, shape: Shape, slots: int) -> None:
    """Child process: registers `slots` KV-shaped destinations and waits while the initiator writes into them."""
    agent = _agent("p2pkv-bench-target", tls)
    dest = [kv_buffer(shape) for _ in range(slots)]
    regs = [agent.register_memory([(d.ctypes.data, d.nbytes, 0, "")], "DRAM") for d in dest]
    pipe.send((agent.get_agent_metadata(), [d.ctypes.data for d in dest]))
    if pipe.poll(_WAIT_S):
        agent.add_remote_agent(pipe.recv())
    pipe.poll(10 * _WAIT_S)  # until the initiator is done
    for reg in regs:
        agent.deregister_memory(reg)


def initiator_run(pipe: Connection, tls: str, shape: Shape, slots: int, count: int, latency_count: int,
                  repeats: int) -> None:
    """Child process: writes into the target; sends back (best GB/s of `repeats`, median latency in us) or an
    error string."""
    try:
        pipe.send(_initiate(pipe, tls, shape, slots, count, latency_count, repeats))
    except Exception as exc:  # reported to the parent, which says what failed
        pipe.send(f"{type(exc).__name__}: {exc}")


def _initiate(pipe: Connection, tls: str, shape: Shape, slots: int, count: int, latency_count: int,
              repeats: int) -> tuple[float, float]:
    agent = _agent("p2pkv-bench-initiator", tls)
    src = kv_like(shape)
    agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    if not pipe.poll(_WAIT_S):
        raise TimeoutError("the target's metadata did not come")
    metadata, addresses = pipe.recv()
    remote = agent.add_remote_agent(metadata)
    pipe.send(agent.get_agent_metadata())
    local = agent.get_xfer_descs(_layer_descs(src.ctypes.data, shape), "DRAM")
    handles = []
    for address in addresses:
        dest = agent.get_xfer_descs(_layer_descs(address, shape), "DRAM")
        until = time.monotonic() + _WAIT_S
        while True:  # the target's side of the connection may still be coming up
            try:
                handles.append(agent.initialize_xfer("WRITE", local, dest, remote))
                break
            except Exception:
                if time.monotonic() > until:
                    raise
                time.sleep(0.01)

    def finish(handle: object, until: float) -> None:
        while (state := agent.check_xfer_state(handle)) != "DONE":
            if state == "ERR" or time.monotonic() > until:
                raise RuntimeError(f"NIXL transfer ended as {state}")

    def once(handle: object) -> None:
        until = time.monotonic() + _WAIT_S
        if agent.transfer(handle) == "ERR":
            raise RuntimeError("NIXL could not post the transfer")
        finish(handle, until)

    for handle in handles:  # warm-up: every destination written once (its pages faulted in)
        once(handle)
    latencies = []
    for _ in range(latency_count):
        started = time.perf_counter()
        once(handles[0])
        latencies.append(time.perf_counter() - started)
    best = 0.0
    for _ in range(repeats):
        until = time.monotonic() + 10 * _WAIT_S
        in_flight: list[object] = []
        started = time.perf_counter()
        for i in range(count):
            if len(in_flight) == len(handles):
                finish(in_flight.pop(0), until)
            if agent.transfer(handles[i % len(handles)]) == "ERR":
                raise RuntimeError("NIXL could not post the transfer")
            in_flight.append(handles[i % len(handles)])
        for handle in in_flight:
            finish(handle, until)
        best = max(best, count * shape.nbytes / (time.perf_counter() - started) / 1e9)
    for handle in handles:
        agent.release_xfer_handle(handle)
    return best, statistics.median(latencies) * 1e6


def measure(shape: Shape, transport: str, count: int, repeats: int, latency_count: int = 40) -> NixlFigures:
    """NIXL's figures for `shape` in the UCX configuration compared with p2pkv's `transport`."""
    tls = UCX_TLS[transport]
    slots = max(1, min(WINDOW, count))
    target_end, target_child = _SPAWN.Pipe()
    init_end, init_child = _SPAWN.Pipe()
    target = _SPAWN.Process(target=target_run, args=(target_child, tls, shape, slots), daemon=True)
    initiator = _SPAWN.Process(target=initiator_run, args=(init_child, tls, shape, slots, count, latency_count,
                                                           repeats), daemon=True)
    target.start()
    initiator.start()
    try:
        if not target_end.poll(_WAIT_S):
            raise RuntimeError("NIXL's target process did not start")
        init_end.send(target_end.recv())
        if not init_end.poll(_WAIT_S):
            raise RuntimeError("NIXL's initiator process did not start")
        metadata = init_end.recv()
        if isinstance(metadata, str):
            raise RuntimeError(f"NIXL ({NAMES[transport]}) failed: {metadata}")
        target_end.send(metadata)
        if not init_end.poll(10 * _WAIT_S * max(1, repeats)):
            raise RuntimeError("NIXL's initiator did not finish")
        result = init_end.recv()
        if isinstance(result, str):
            raise RuntimeError(f"NIXL ({NAMES[transport]}) failed: {result}")
        return NixlFigures(*result)
    finally:
        try:
            target_end.send("done")
        except OSError:  # the target ended already
            pass
        for proc in (initiator, target):
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
