"""The GPU path's ordering and stalls, run on CPU through device layers that record or delay what they are asked:
fences are recorded on vLLM's thread only, in the connector's hooks, and every copy out of or into the blocks waits
on one (pushes, pulls, head slices, pulls by reference); landing never waits on the host (`get_finished` returns
at once while the copies run, and the request is reported loaded later, with the right bytes); on the forward's
path no page-locked memory is made, and without free pinned memory the blocks are held for a pull."""

from __future__ import annotations

import ast
import socket
import statistics
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="the worker side's metadata is vLLM's connector metadata class")

from p2pkv.bench.cluster import free_ports
from p2pkv.engine.sender import OutState
from p2pkv.kv.staging import STAGE_ENV
from p2pkv.params import Address
from p2pkv.vllm.metadata import LoadSpec, P2pkvMetadata, SaveSpec
from p2pkv.vllm.worker import WorkerSide
from tests.helpers.device_ops import Call, FailingOps, RecordingOps, SlowOps
from tests.helpers.workers import LOCAL, offer_and_pull, push_and_load, settle, worker_side

LAYERS, BLOCKS, HEADS, TOKENS = 3, 8, 2, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
MAIN = threading.main_thread().name


def caches(seed: int | None, heads: int = HEADS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed or 0)
    return {n: torch.rand(BLOCKS, heads, TOKENS, 16, generator=g) if seed is not None
            else torch.zeros(BLOCKS, heads, TOKENS, 16) for n in NAMES}


@pytest.fixture(autouse=True)
def staged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Caches in host memory handled as a GPU's: every copy goes through the device layer."""
    monkeypatch.setenv(STAGE_ENV, "1")


def moves(ops: RecordingOps) -> list[Call]:
    return ops.of("copy", "gather", "scatter")


def check_fenced(calls: list[Call], fences: list[Call]) -> None:
    """Every call was issued after at least one fence, each recorded on vLLM's thread by this layer."""
    recorded = {id(f.after[0]) for f in fences}
    assert calls
    for call in calls:
        assert call.after, f"{call.kind} on {call.thread} waited on nothing"
        assert all(f.thread == MAIN and id(f) in recorded for f in call.after), call


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_fences_are_recorded_on_vllms_thread_and_every_copy_waits_on_one(sides: list[WorkerSide],
                                                                          transport: str) -> None:
    """tcp: pulls carry bytes, copied out by the prefill engine's serving thread. auto: pulled by reference
    (host_ipc, cuda_ipc's stand-in): the serving thread asks whether the forward's fence has passed before it
    says where the blocks lie."""
    p_ops, d_ops = RecordingOps(), RecordingOps()
    p_port, d_port = free_ports(2)
    keys = {"transport": transport}
    p_kv, d_kv = caches(1), caches(None)
    prefill = worker_side("kv_producer", p_port, p_kv, TOKENS, keys=keys, device_ops=p_ops)
    decode = worker_side("kv_consumer", d_port, d_kv, TOKENS, keys=keys, device_ops=d_ops)
    sides += [prefill, decode]
    push_and_load(prefill, decode, "put", (1, 4), (0, 3), NAMES, p_port, d_port)
    offer_and_pull(prefill, decode, "get", (2, 6), (5, 7), p_port)
    for name in NAMES:
        assert torch.equal(d_kv[name][[0, 3, 5, 7]], p_kv[name][[1, 4, 2, 6]])
    p_fences, d_fences = p_ops.of("fence"), d_ops.of("fence")
    assert {f.thread for f in p_fences + d_fences} == {MAIN}, "only vLLM's thread records fences"
    # Pushes: each layer's copy is issued in its own hook, after the fence recorded there.
    pushed = [c for c in moves(p_ops) if c.thread == MAIN]
    check_fenced(pushed, p_fences)
    calls = p_ops.calls
    for call in pushed:
        latest = next(c for c in reversed(calls[: calls.index(call)]) if c.kind == "fence")
        assert call.after == latest.after, "a layer's copy waits on the fence of its own hook"
    served = [c for c in p_ops.calls if c.thread != MAIN]
    if transport == "tcp":
        check_fenced([c for c in served if c.kind in ("copy", "gather")], p_fences)
    else:
        asked = [c for c in served if c.kind == "passed"]
        assert asked and all(c.after[0].thread == MAIN for c in asked), "the serving thread waited for the forward"
    if transport == "tcp":
        # The decode side's copies into its blocks (landing a push, a pull's bytes) wait on the fence of the step
        # that bound the load.
        check_fenced([c for c in d_ops.calls if c.kind in ("scatter", "copy")], d_fences)
    else:  # copied by the decode engine's puller straight from the prefill side's memory
        received = decode.engine.metrics.registry.get_sample_value("p2pkv_bytes_received_total",
                                                                   {"transport": "host_ipc"})
        assert received == 2 * sum(t[[1, 4]].nbytes for t in p_kv.values())


def test_head_slices_are_copied_out_after_the_forwards_fence(sides: list[WorkerSide]) -> None:
    """A TP 1 prefill worker serves two TP 2 decode ranks their halves of its heads, from its serving thread."""
    p_ops = RecordingOps()
    p_port, d_port = free_ports(2, run=2)
    keys = {"transport": "tcp"}
    p_kv = caches(3)
    d_kv = [caches(None, heads=1) for _ in range(2)]
    prefill = worker_side("kv_producer", p_port, p_kv, TOKENS, total_heads=HEADS, keys=keys, device_ops=p_ops)
    decode = [worker_side("kv_consumer", d_port, d_kv[r], TOKENS, rank=r, tp_size=2, total_heads=HEADS, keys=keys,
                          device_ops=RecordingOps()) for r in range(2)]
    sides += [prefill, *decode]
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="slice", peer=None, block_ids=(1, 5))]))
    prefill.wait_for_save()
    for d in decode:
        d.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="slice", first_block=0, block_ids=(2, 3),
                                             pull_from=Address(LOCAL, p_port),
                                             prefill_tp=1)]))
    for d in decode:
        settle(d, "d-req", sending=False)
        assert d.take_load_errors() == set()
    for r in range(2):
        for name in NAMES:
            assert torch.equal(d_kv[r][name][[2, 3]], p_kv[name][[1, 5], r : r + 1])
    served = [c for c in moves(p_ops) if c.thread != MAIN]
    assert len({c.nbytes for c in served}) >= 1
    check_fenced(served, p_ops.of("fence"))


@pytest.mark.parametrize("send", ["PUT", "GET"])
def test_landing_never_waits_for_the_device(sides: list[WorkerSide], send: str) -> None:
    """The decode side's device is busy: its copies run half a second after they are issued. `get_finished`
    issues them and returns at once, and again at every step while they run; the request is reported loaded only
    once they are done, with the right bytes."""
    slow = SlowOps(delay_s=0.5)
    p_port, d_port = free_ports(2)
    p_kv, d_kv = caches(5), caches(None)
    prefill = worker_side("kv_producer", p_port, p_kv, TOKENS, keys={"transport": "tcp"})
    decode = worker_side("kv_consumer", d_port, d_kv, TOKENS, keys={"transport": "tcp"}, device_ops=slow)
    sides += [prefill, decode]
    try:
        if send == "PUT":
            decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="t", first_block=0, block_ids=(0, 3),
                                                      fallback_from=Address(LOCAL, p_port))]))
            prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="t", peer=Address(LOCAL, d_port),
                                                       block_ids=(1, 4))]))
            for name in NAMES:
                prefill.save_layer(name)
        else:
            prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="t", peer=None, block_ids=(1, 4))]))
        prefill.wait_for_save()
        if send == "GET":
            decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="t", first_block=0, block_ids=(0, 3),
                                                      pull_from=Address(LOCAL, p_port))]))
        durations: list[float] = []
        deadline = time.monotonic() + 10
        loaded_at = None
        while loaded_at is None:
            assert time.monotonic() < deadline, "the load was never reported"
            prefill.get_finished(set())
            started = time.monotonic()
            _, loaded = decode.get_finished(set())
            durations.append(time.monotonic() - started)
            if loaded and "d-req" in loaded:
                loaded_at = time.monotonic()
                # Reported only once every copy issued for it has run (checked as it is reported: a check while
                # it is not would race with the copies finishing).
                assert slow.mark()(), "reported loaded while its copies still ran"
            time.sleep(0.002)
        issued = slow.of("scatter")
        assert issued, "the landing was issued"
        assert decode.take_load_errors() == set()
        for name in NAMES:
            assert torch.equal(d_kv[name][[0, 3]], p_kv[name][[1, 4]])
        assert len(durations) > 20, "get_finished was called again and again while the copies ran"
        assert max(durations) < 0.1, f"get_finished waited for the device: {max(durations):.3f} s"
        assert statistics.median(durations) < 1e-3, statistics.median(durations)
    finally:
        slow.close()


def test_a_landing_that_fails_part_way_is_reported_once_what_it_issued_is_done(sides: list[WorkerSide]) -> None:
    """The second layer's copy cannot be issued (the device is out of memory): the first layer's copy, already
    queued, still writes into the blocks and reads the staged bytes. The load is reported failed (vLLM recomputes)
    only once that copy is done, and the staged bytes are freed only then; `get_finished` never waits for it."""
    failing = FailingOps(delay_s=0.5, fail_at=2)
    p_port, d_port = free_ports(2)
    prefill = worker_side("kv_producer", p_port, caches(5), TOKENS, keys={"transport": "tcp"})
    decode = worker_side("kv_consumer", d_port, caches(None), TOKENS, keys={"transport": "tcp"}, device_ops=failing)
    sides += [prefill, decode]
    try:
        decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="t", first_block=0, block_ids=(0, 3),
                                                  fallback_from=Address(LOCAL, p_port))]))
        prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="t", peer=Address(LOCAL, d_port),
                                                   block_ids=(1, 4))]))
        for name in NAMES:
            prefill.save_layer(name)
        prefill.wait_for_save()
        deadline, slowest, loaded = time.monotonic() + 10, 0.0, set()
        while not loaded:
            assert time.monotonic() < deadline, "the load was never reported"
            prefill.get_finished(set())
            started = time.monotonic()
            loaded = decode.get_finished(set())[1] or set()
            slowest = max(slowest, time.monotonic() - started)
            if failing.of("scatter") and not loaded:
                assert decode.engine.store.bytes_in_use > 0, "the staged bytes are kept while a copy reads them"
            time.sleep(0.005)
        assert failing.mark()(), "reported only once the copy it had issued was done"
        assert decode.take_load_errors() == {0, 3}
        assert decode.engine.store.bytes_in_use == 0
        assert slowest < 0.1, slowest
    finally:
        failing.close()


def test_without_free_pinned_memory_the_blocks_are_held_for_a_pull(sides: list[WorkerSide]) -> None:
    """A GPU cache (its layer pins host memory), a host pool too small for the transfer: the push copies nothing
    on the forward's path and leaves the blocks for the decode side, which pulls them; the bytes land."""
    p_ops = RecordingOps(pins_host=True)
    p_port, d_port = free_ports(2)
    p_kv, d_kv = caches(7), caches(None)
    keys = {"transport": "tcp", "mem_pool_size_gb": 0}
    prefill = worker_side("kv_producer", p_port, p_kv, TOKENS, keys=keys, device_ops=p_ops)
    decode = worker_side("kv_consumer", d_port, d_kv, TOKENS, keys=keys)
    sides += [prefill, decode]
    push_and_load(prefill, decode, "held", (2, 5), (1, 6), NAMES, p_port, d_port)
    out = prefill.engine.outgoing("held")
    assert out is None or out.state is not OutState.DONE, "nothing was pushed"
    assert not [c for c in moves(p_ops) if c.thread == MAIN], "no copy out on the forward's path"
    assert [c for c in moves(p_ops) if c.thread != MAIN], "copied out when the pull was served"
    for name in NAMES:
        assert torch.equal(d_kv[name][[1, 6]], p_kv[name][[2, 5]])


def test_nothing_but_the_device_layer_asks_for_a_current_stream_or_pins_memory() -> None:
    """Where the package names CUDA's current stream, page-locked allocation or host registration: only in the
    device layer's fence, its index ring (made once, at registration) and the pool's pinning."""
    allowed = {("device_copy.py", "current_stream"), ("device_copy.py", "pin_memory"),
               ("pool.py", "cudaHostRegister")}
    found = set()
    root = Path(__file__).parents[2] / "p2pkv"
    for path in root.rglob("*.py"):
        if "bench" in path.parts:
            continue  # the GPU check's baselines
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else node.arg if isinstance(node, ast.keyword) \
                else None
            if name in ("current_stream", "pin_memory", "cudaHostRegister"):
                found.add((path.name, name))
    assert found <= allowed, found - allowed
    assert ("device_copy.py", "current_stream") in found


def test_a_preempted_request_waits_for_its_copies_out_not_for_the_network(sides: list[WorkerSide]) -> None:
    """A GPU cache's push reads the host buffers its layers were copied into: once those copies are done (the device
    runs them late here), vLLM may reuse the preempted request's blocks. The push to a peer that never answers goes
    on, to its deadline, without holding vLLM's thread."""
    silent = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(silent.accept()[0]), daemon=True).start()
    slow = SlowOps(delay_s=0.3)
    (p_port,) = free_ports(1)
    prefill = worker_side("kv_producer", p_port, caches(1), TOKENS, keys={"transport": "tcp"}, device_ops=slow)
    sides.append(prefill)
    try:
        quiet = Address(LOCAL, silent.getsockname()[1])
        prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="pre", peer=quiet, block_ids=(1, 2))]))
        for name in NAMES:
            prefill.save_layer(name)
        prefill.wait_for_save()
        copied = prefill.blocks.copied_out("pre")
        assert copied is not None and not copied(), "the device has not run the copies yet"
        started = time.monotonic()
        prefill.handle_preemptions(["pre"])
        assert copied(), "vLLM's thread went on before the copies out of the blocks were done"
        assert time.monotonic() - started < 2.0, "vLLM's thread waited for the network"
        out = prefill.engine.outgoing("pre")
        assert out is not None and out.state is OutState.SENDING  # still trying, from its host buffers
    finally:
        silent.close()
        for conn in accepted:
            conn.close()
        slow.close()


def test_releasing_a_transfer_whose_copies_still_run_does_not_wait_for_them(sides: list[WorkerSide]) -> None:
    """A push that failed at once (its peer is gone) is released on vLLM's thread while the copies of its layers
    still wait for the forward: its buffer goes back once they are done, at a later step, without a wait now."""
    slow = SlowOps(delay_s=1.0)
    (p_port,) = free_ports(1)
    prefill = worker_side("kv_producer", p_port, caches(2), TOKENS, keys={"transport": "tcp"}, device_ops=slow)
    sides.append(prefill)
    try:
        gone = Address(LOCAL, free_ports(1)[0])  # nothing listens there
        prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="dead", peer=gone, block_ids=(3,))]))
        for name in NAMES:
            prefill.save_layer(name)
        prefill.wait_for_save()
        pool = prefill.engine.pool
        assert pool is not None and (stats := pool.stats()) is not None and stats.bytes_in_use > 0
        started = time.monotonic()
        prefill.blocks.release("dead")
        assert time.monotonic() - started < 0.3, "release waited for the copies"
        assert (stats := pool.stats()) is not None and stats.bytes_in_use > 0, "freed while copies ran into it"
        deadline = time.monotonic() + 5
        while (stats := pool.stats()) is not None and stats.bytes_in_use and time.monotonic() < deadline:
            prefill.get_finished(set())  # each step collects what finished
            time.sleep(0.05)
        assert stats is not None and stats.bytes_in_use == 0
    finally:
        slow.close()
