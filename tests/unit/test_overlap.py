"""PUT_ASYNC overlap: each layer leaves for the decode side as soon as its own copy from the device is done (not
once every queued layer's is), and lands in the decode side's blocks as it arrives (not once the whole push has);
a push that fails after some layers landed is reported only once those copies are done."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from p2pkv.bench.cluster import free_ports
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.sender import OutState
from p2pkv.engine.store import StageState
from p2pkv.kv.staging import STAGE_ENV
from p2pkv.params import Address
from p2pkv.vllm.metadata import LoadSpec, P2pkvMetadata
from p2pkv.vllm.worker import WorkerSide
from tests.helpers.device_ops import SlowOps
from tests.helpers.peer import TRANSPORT_ENV, engine_config, layout, payload, start_engine
from tests.helpers.workers import LOCAL, worker_side

LAYERS, BLOCKS, BLOCK_BYTES = 8, 4, 64 << 10
STEP_S = 0.1  # layer L's copy from the device is done (L + 1) * STEP_S after the forward began


def ready_at(when: float) -> Callable[[float], bool]:
    """A layer's copy from the device that is done at `when` (as `PushJob.ready`: waits to the deadline)."""
    def ready(deadline: float) -> bool:
        time.sleep(max(0.0, min(when, deadline) - time.monotonic()))
        return time.monotonic() >= when

    return ready


@pytest.fixture(params=["tcp", "shm"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(TRANSPORT_ENV, request.param)
    return str(request.param)


@pytest.fixture
def engines(transport: str) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    settings = EngineSettings.from_config(engine_config(kv_host="127.0.0.1", transfer_timeout_s=10), 0, 0)
    receiver = TransferEngine(settings, layout(LAYERS, BLOCK_BYTES))
    receiver.start()
    sender = start_engine(LAYERS, BLOCK_BYTES)
    yield sender, receiver
    sender.close()
    receiver.close()


def test_each_layer_leaves_as_soon_as_its_own_copy_is_done(engines: tuple[TransferEngine, TransferEngine]) -> None:
    """vLLM's thread queues every layer's copy within moments of the forward's start (on a GPU the forward runs
    later); the copies finish one by one as the forward reaches them. Each layer must arrive right after its copy,
    not after the last one."""
    sender, receiver = engines
    peer = Address.parse(receiver.address)
    data = payload(4, LAYERS, BLOCKS, BLOCK_BYTES)
    deadline = time.monotonic() + 10
    sender.push_layer("warm", peer, 0, BLOCKS, (data[0].data,), deadline)  # the link's handshake, before timing
    start = time.monotonic()
    ready = [start + (layer + 1) * STEP_S for layer in range(LAYERS)]
    for layer in range(LAYERS):
        sender.push_layer("t", peer, layer, BLOCKS, (data[layer].data,), deadline, ready_at(ready[layer]))
    assert receiver.wait_staged("t", 10) is StageState.COMPLETE
    item = receiver.take_staged("t")
    assert item is not None
    lags = [(item.arrived[layer] - ready[layer]) * 1000 for layer in range(LAYERS)]
    assert max(lags) < 0.6 * STEP_S * 1000, f"arrival after each layer's copy (ms): {lags}"
    for layer in range(LAYERS):
        assert bytes(item.layer_view(layer)) == data[layer].tobytes()
    receiver.release_staged(item)
    out = sender.wait_outgoing("t", 5)
    assert out is not None and out.state is OutState.DONE


def test_layers_ready_together_still_go_in_one_frame(engines: tuple[TransferEngine, TransferEngine]) -> None:
    """Layers whose copies are all done when the sender looks go out together (one frame per run of layers)."""
    sender, receiver = engines
    peer = Address.parse(receiver.address)
    data = payload(5, LAYERS, BLOCKS, BLOCK_BYTES)
    deadline = time.monotonic() + 10
    done_now = ready_at(0.0)
    for layer in range(LAYERS):
        sender.push_layer("t2", peer, layer, BLOCKS, (data[layer].data,), deadline, done_now)
    assert receiver.wait_staged("t2", 10) is StageState.COMPLETE
    item = receiver.take_staged("t2")
    assert item is not None
    assert all(bytes(item.layer_view(layer)) == data[layer].tobytes() for layer in range(LAYERS))
    receiver.release_staged(item)


def cache(seed: int | None) -> dict[str, torch.Tensor]:
    """Layers of 4 blocks of [2 heads, 16 tokens, 1024 bytes] (64 KiB a block)."""
    g = torch.Generator().manual_seed(seed or 0)
    make: Callable[[], torch.Tensor] = (lambda: torch.randint(0, 256, (BLOCKS, 2, 16, 1024), dtype=torch.uint8,
                                                               generator=g)) if seed is not None else \
        (lambda: torch.zeros(BLOCKS, 2, 16, 1024, dtype=torch.uint8))
    return {f"model.layers.{i}.self_attn.attn": make() for i in range(LAYERS)}


def bytes_of(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def wait_for(what: Callable[[], bool], step: Callable[[], object], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        step()
        if what():
            return True
        time.sleep(0.005)
    return False


@contextlib.contextmanager
def decode_and_sender(sides: list[WorkerSide], device_ops: SlowOps | None = None
                      ) -> Iterator[tuple[WorkerSide, dict[str, torch.Tensor], TransferEngine, Address]]:
    """A decode worker side with an empty cache, and a bare engine that pushes to it layer by layer as a test says:
    the side, its cache, the engine and the side's address."""
    (d_port,) = free_ports(1)
    d_kv = cache(None)
    decode = worker_side("kv_consumer", d_port, d_kv, 16, keys={"transport": "tcp"}, device_ops=device_ops)
    sides.append(decode)
    sender = TransferEngine(EngineSettings.from_config(engine_config(kv_host=LOCAL), 0, 0), decode.engine.layout)
    sender.start()
    try:
        yield decode, d_kv, sender, Address(LOCAL, d_port)
    finally:
        sender.close()


def test_pushed_layers_land_in_the_blocks_as_they_arrive(sides: list[WorkerSide], mode: str) -> None:
    """The first layer of a push is in the decode side's blocks while the others are still to come; the load is
    reported once the last has landed, every byte in place."""
    with decode_and_sender(sides) as (decode, d_kv, sender, peer):
        src = cache(9)
        names = list(src)
        dst = (3, 1)
        data = [np.ascontiguousarray(src[name].numpy()[[0, 1]]).reshape(-1) for name in names]
        decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="L1", first_block=0, block_ids=dst)]))
        deadline = time.monotonic() + 10
        sender.push_layer("L1", peer, 0, 2, (data[0].data,), deadline)
        reports: list[set[str]] = []

        def step() -> None:
            reports.append(decode.get_finished(set())[1] or set())

        landed = wait_for(lambda: bytes_of(d_kv[names[0]][list(dst)]) == data[0].tobytes(), step)
        assert landed, "layer 0 did not land before the rest of the push came"
        assert not any(reports), "the load was reported before its last layer came"
        assert not d_kv[names[1]].any()
        for layer in range(1, LAYERS):
            sender.push_layer("L1", peer, layer, 2, (data[layer].data,), deadline)
        assert wait_for(lambda: any("d-req" in r for r in reports), step), "the load was not reported"
        assert decode.take_load_errors() == set()
        for name, expected in zip(names, data, strict=True):
            assert bytes_of(d_kv[name][list(dst)]) == expected.tobytes(), name


def test_a_push_that_fails_after_layers_landed_is_reported_once_their_copies_are_done(
        sides: list[WorkerSide], monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM may give a failed load's blocks to another request at once: the copies of the layers landed early must
    be done before the failure is reported (the device runs them late here)."""
    monkeypatch.setenv(STAGE_ENV, "1")
    slow = SlowOps(delay_s=0.4)
    try:
        with decode_and_sender(sides, slow) as (decode, d_kv, sender, peer):
            src = cache(3)
            names = list(src)
            data = np.ascontiguousarray(src[names[0]].numpy()[[2]]).reshape(-1)
            decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="L2", first_block=0,
                                                      block_ids=(0,))]))
            deadline = time.monotonic() + 10
            sender.push_layer("L2", peer, 0, 1, (data.data,), deadline)
            assert wait_for(lambda: len(slow.of("copy", "scatter")) > 0, lambda: decode.get_finished(set())), \
                "layer 0's copy was not issued as it arrived"

            def broken(_deadline: float) -> bool:
                raise RuntimeError("device lost (injected)")

            sender.push_layer("L2", peer, 1, 1, (), deadline, broken)  # the sender fails the rest and aborts
            reported = wait_for(lambda: decode.take_load_errors() == {0}, lambda: decode.get_finished(set()))
            assert reported, "the failed load was not reported"
            assert bytes_of(d_kv[names[0]][[0]]) == data.tobytes(), "reported before the copy that wrote its block ran"
    finally:
        slow.close()


def gated(gate: threading.Event) -> Callable[[float], bool]:
    """A layer's copy from the device that is done once `gate` is set."""
    return lambda deadline: gate.wait(max(0.0, deadline - time.monotonic()))


def test_a_push_past_its_deadline_sends_nothing_more_and_its_bytes_stay_read_until_its_jobs_are_handled(
        engines: tuple[TransferEngine, TransferEngine]) -> None:
    """vLLM's thread fails a push whose deadline passed (`housekeeping`) while the sender's thread has its layers in
    hand, waiting for an earlier layer's copy: none of them is sent after (its host buffer may be given to the next
    request once the prefill side sees it failed), and the prefill side is told its bytes are read until the
    sender's thread has let go of them."""
    sender, receiver = engines
    peer = Address.parse(receiver.address)
    data = payload(6, LAYERS, BLOCKS, BLOCK_BYTES)
    first, second = threading.Event(), threading.Event()
    far = time.monotonic() + 10
    sender.push_layer("c", peer, 0, BLOCKS, (data[0].data,), far, gated(first))  # holds the sender's thread
    time.sleep(0.05)
    sender.push_layer("a", peer, 0, BLOCKS, (data[1].data,), far, gated(second))
    sender.push_layer("b", peer, 0, BLOCKS, (data[2].data,), time.monotonic() + 0.3)  # copied already
    first.set()  # the sender's thread now takes a and b together, and waits for a's copy
    time.sleep(0.4)
    sender.housekeeping()  # b's deadline passed
    b = sender.outgoing("b")
    assert b is not None and b.state is OutState.FAILED
    assert sender.push_reads("b"), "b's bytes are still in the sender's hands"
    second.set()
    receiver.wait_arrival("a", 0, 5)
    assert receiver.staged_arrivals("a")[0] is StageState.RECEIVING
    deadline = time.monotonic() + 5
    while sender.push_reads("b") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sender.push_reads("b")
    assert receiver.staged_state("b") is None, "b was sent after it failed"
