"""The worker side between ranks of different tensor-parallel sizes, without vLLM's processes: a TP 1 prefill worker
holds a finished prompt's blocks, two TP 2 decode workers each pull their half of its heads into their own caches,
over real sockets; a load whose heads cannot be split fails at once, with nothing pulled."""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable

import pytest
import torch

pytest.importorskip("vllm", reason="the worker side's metadata is vLLM's connector metadata class")

from p2pkv.bench.cluster import free_ports
from p2pkv.config import launch_of, parse_connector_config
from p2pkv.engine.offers import OfferState
from p2pkv.engine.sender import OutState
from p2pkv.engine.store import StageState
from p2pkv.kv.pipes import PIPE_ENV
from p2pkv.kv.staging import STAGE_ENV
from p2pkv.memory.huge import HUGE, thp_mode
from p2pkv.memory.huge import _huge_bytes as huge_bytes
from p2pkv.params import Address
from p2pkv.vllm.metadata import Discard, LoadSpec, P2pkvMetadata, SaveSpec, Wanted
from p2pkv.vllm.worker import WorkerSide
from p2pkv.way import WhyPull

LAYERS, BLOCKS, TOKENS, DIM, HEADS = 2, 5, 16, 8, 2


def caches(heads: int, seed: int, stage: int = 0, layers: int = LAYERS) -> dict[str, torch.Tensor]:
    """A worker's KV: pipeline stage `stage` holds `layers` of the model's layers from layers * stage on (vLLM's
    names)."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{layers * stage + i}.self_attn.attn": torch.rand(BLOCKS, heads, TOKENS, 2 * DIM,
                                                                             generator=g) for i in range(layers)}


MODEL_LAYERS = 2 * LAYERS


def halves(stage: int, pp: int) -> range:
    """How these tests' model splits over pipeline stages (as vLLM's default does for 4 layers)."""
    per = MODEL_LAYERS // pp
    return range(stage * per, (stage + 1) * per)


def worker(role: str, port: int, rank: int, tp: int, total: int, kv: dict[str, torch.Tensor],
           pp_rank: int = 0, pp_size: int = 2, transport: str = "auto",
           keys: dict[str, object] | None = None, engine_id: str = "") -> WorkerSide:
    """With gloo pipes asked for (the `piped` mode), the transport is nccl's: pulls by pipe, no export. `keys`: more
    kv_connector_extra_config; `engine_id`: vLLM's for the instance (its start, `launch`)."""
    extra: dict[str, object] = {"kv_host": "127.0.0.1", "transfer_timeout_s": 10, "metrics_port": 0,
                                "transport": transport, **(keys or {})}
    if os.environ.get(PIPE_ENV) == "gloo":
        extra["transport"] = "nccl"
    config = parse_connector_config(role, port, "recompute", extra, engine_id)
    side = WorkerSide(config, rank=rank, block_size=TOKENS, tp_size=tp, total_heads=total, pp_rank=pp_rank,
                      pp_size=pp_size, total_layers=MODEL_LAYERS, stage_layers=halves)
    side.register_kv_caches(kv)
    return side


@pytest.fixture(params=["host-cache", "staged", "piped"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Caches in host memory (pulls carry bytes); or handled as GPU caches are (`P2PKV_STAGE_KV`): exported and
    opened across processes, so that each slice is copied by reference (host_ipc, cuda_ipc's CPU stand-in); or,
    `piped`, not exported but moved through a pipe made per link (gloo, nccl's CPU stand-in)."""
    mode: str = request.param
    if mode != "host-cache":
        monkeypatch.setenv(STAGE_ENV, "1")
    if mode == "piped":
        monkeypatch.setenv(PIPE_ENV, "gloo")
    return mode


def counter(side: WorkerSide, name: str, labels: dict[str, str]) -> float:
    return side.engine.metrics.registry.get_sample_value(name, labels) or 0.0


def check_moved(decode: list[WorkerSide], kvs: list[dict[str, torch.Tensor]], dst: tuple[int, ...],
                mode: str) -> None:
    """Staged: every byte each decode rank loaded was copied from the prefill side's cache by reference; piped:
    received through pipes (the round after the warm-up, `warm_pipes`)."""
    transport = {"staged": "host_ipc", "piped": "gloo"}.get(mode, "host_ipc")
    moved = sum(counter(d, "p2pkv_bytes_received_total", {"transport": transport}) for d in decode)
    assert moved == (sum(t[list(dst)].nbytes for kv in kvs for t in kv.values()) if mode != "host-cache" else 0)


def warm_pipes(mode: str, decode: list[WorkerSide], peers: int, pull: Callable[[str], None]) -> None:
    """Piped: a first round of pulls carries bytes while each link's pipe is made (off the request path); wait
    until every decode rank has a pipe with each of its `peers` prefill ranks, so the next round goes by pipe."""
    if mode != "piped":
        return
    pull("warm")
    deadline = time.monotonic() + 10
    ready = {"kind": "gloo", "outcome": "ready"}
    while any(counter(d, "p2pkv_pipes_total", ready) < peers for d in decode):
        assert time.monotonic() < deadline, "the pipes were not made"
        time.sleep(0.02)
    assert sum(counter(d, "p2pkv_bytes_received_total", {"transport": "gloo"}) for d in decode) == 0


def settle(side: WorkerSide, req: str, sending: bool, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sent, loaded = side.get_finished({req} if sending else set())
        if req in ((sent if sending else loaded) or ()):
            return
        time.sleep(0.01)
    raise AssertionError(f"{req} did not finish")


def offer_and_pull(prefill: list[WorkerSide], decode: list[WorkerSide], tid: str, src: tuple[int, ...],
                   dst: tuple[int, ...], p_port: int, prefill_tp: int = 0, prefill_pp: int = 0) -> None:
    """GET: every prefill worker offers blocks `src`, every decode worker pulls them into `dst`; all settle, with
    no load errors."""
    for p in prefill:
        p.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id=tid, peer=None, block_ids=src)]))
        p.wait_for_save()
    load = LoadSpec(req_id="d-req", transfer_id=tid, first_block=0, block_ids=dst,
                    pull_from=Address("127.0.0.1", p_port), prefill_tp=prefill_tp, prefill_pp=prefill_pp)
    for d in decode:
        d.bind(P2pkvMetadata(loads=[load]))
    for d in decode:
        settle(d, "d-req", sending=False)
        assert d.take_load_errors() == set()
    for p in prefill:
        settle(p, "p-req", sending=True)  # served to every rank that pulls it: its blocks may go


def test_decode_ranks_of_tp_2_load_their_heads_from_a_tp_1_prefill_worker(sides: list[WorkerSide],
                                                                           mode: str) -> None:
    p_port, d_port = free_ports(2, run=2)
    p_kv = caches(HEADS, 1)
    prefill = worker("kv_producer", p_port, 0, 1, HEADS, p_kv)
    d_kv = [caches(1, 2 + r) for r in range(2)]
    decode = [worker("kv_consumer", d_port, r, 2, HEADS, d_kv[r]) for r in range(2)]
    sides += [prefill, *decode]
    src, dst = (3, 0, 4), (1, 2, 0)
    warm_pipes(mode, decode, 1, lambda tid: offer_and_pull([prefill], decode, tid, src, dst, p_port, prefill_tp=1))
    offer_and_pull([prefill], decode, "tid1", src, dst, p_port, prefill_tp=1)
    for r in range(2):
        for name in p_kv:
            assert torch.equal(d_kv[r][name][list(dst)], p_kv[name][list(src), r : r + 1])
    check_moved(decode, d_kv, dst, mode)


def test_a_load_whose_heads_cannot_be_split_fails_without_pulling(sides: list[WorkerSide]) -> None:
    (d_port,) = free_ports(1, run=2)
    decode = worker("kv_consumer", d_port, 0, 2, 3, caches(1, 5))  # 3 heads over TP 2: no such model
    sides.append(decode)
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="tid2", first_block=0, block_ids=(1, 2),
                                              pull_from=Address("127.0.0.1", 9),
                                              prefill_tp=1)]))
    assert decode.take_load_errors() == {1, 2}
    assert decode.get_finished(set()) == (None, {"d-req"})
    assert decode.engine.pull_result("tid2@0") is None  # nothing was submitted


def test_pipeline_stages_pull_their_heads_from_the_same_stage(sides: list[WorkerSide], mode: str) -> None:
    # Prefill PP 2 x TP 2 (ranks at kv_port + stage * 2 + rank), decode PP 2 x TP 1 (kv_port + stage): decode
    # stage s gathers both heads of its layers from prefill stage s's two ranks. A stage that pulled from the
    # other stage would be refused (its peer holds other layers) and its load would fail.
    p_port, d_port = free_ports(2, run=4)
    p_kv = {(s, r): caches(1, 10 + 2 * s + r, s) for s in range(2) for r in range(2)}
    prefill = [worker("kv_producer", p_port, r, 2, HEADS, p_kv[s, r], s) for s in range(2) for r in range(2)]
    d_kv = [caches(HEADS, 20 + s, s) for s in range(2)]
    decode = [worker("kv_consumer", d_port, 0, 1, HEADS, d_kv[s], s) for s in range(2)]
    sides += [*prefill, *decode]
    assert [p.engine.address for p in prefill] == [f"127.0.0.1:{p_port + i}" for i in range(4)]
    assert [d.engine.address for d in decode] == [f"127.0.0.1:{d_port + s}" for s in range(2)]
    src, dst = (2, 4), (0, 3)
    warm_pipes(mode, decode, 2, lambda tid: offer_and_pull(prefill, decode, tid, src, dst, p_port, prefill_tp=2))
    offer_and_pull(prefill, decode, "tid3", src, dst, p_port, prefill_tp=2)
    for s in range(2):
        for name in d_kv[s]:
            for r in range(2):
                assert torch.equal(d_kv[s][name][list(dst), r : r + 1], p_kv[s, r][name][list(src)])
    check_moved(decode, d_kv, dst, mode)


def test_pipeline_stages_push_to_the_same_stage(sides: list[WorkerSide]) -> None:
    p_port, d_port = free_ports(2, run=2)
    p_kv = [caches(HEADS, 30 + s, s) for s in range(2)]
    d_kv = [caches(HEADS, 40 + s, s) for s in range(2)]
    prefill = [worker("kv_producer", p_port, 0, 1, HEADS, p_kv[s], s) for s in range(2)]
    decode = [worker("kv_consumer", d_port, 0, 1, HEADS, d_kv[s], s) for s in range(2)]
    sides += [*prefill, *decode]
    src, dst = (1, 3), (4, 0)
    for d in decode:
        d.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="tid4", first_block=0, block_ids=dst)]))
    for p, kv in zip(prefill, p_kv, strict=True):
        p.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="tid4", peer=Address("127.0.0.1", d_port),
                                             block_ids=src)]))
        for name in kv:
            p.save_layer(name)
        p.wait_for_save()
    for d in decode:
        settle(d, "d-req", sending=False)
        assert d.take_load_errors() == set()
    for s in range(2):
        for name in d_kv[s]:
            assert torch.equal(d_kv[s][name][list(dst)], p_kv[s][name][list(src)])


def push_once(prefill: WorkerSide, decode: WorkerSide, names: list[str], tid: str, p_port: int, d_port: int,
              first: Callable[[], None]) -> None:
    """Push blocks (1, 3) to (4, 0) as a forward pass does, layer (`names`) by layer, then `wait_for_save`; `first`
    runs after the first layer's hook. The decode side loads them (both sides step on, as vLLM's do: a push left
    for a pull is offered in the prefill side's `get_finished`)."""
    src, dst = (1, 3), (4, 0)
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id=tid, first_block=0, block_ids=dst,
                                              fallback_from=Address("127.0.0.1", p_port))]))
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id=tid, peer=Address("127.0.0.1", d_port),
                                               block_ids=src)]))
    prefill.save_layer(names[0])
    first()
    for name in names[1:]:
        prefill.save_layer(name)
    prefill.wait_for_save()
    deadline = time.monotonic() + 10
    loaded: set[str] = set()
    while "d-req" not in loaded and time.monotonic() < deadline:
        prefill.get_finished(set())
        loaded |= decode.get_finished(set())[1] or set()
        time.sleep(0.01)
    assert "d-req" in loaded and decode.take_load_errors() == set()
    settle(prefill, "p-req", sending=True)


@pytest.mark.parametrize("case", ["host-cache-shm", "host-cache-tcp", "staged"])
def test_host_kv_read_in_place_is_pushed_when_the_forward_ends(sides: list[WorkerSide], case: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # With KV in host memory and a peer on this host reading it in place (shm), the transfer's threads would share
    # the cores and the GIL with the forward: nothing goes out per layer, every layer at `wait_for_save`. Over tcp
    # (a peer on another host: the wire is worth overlapping) and with KV handled as a GPU's (staged: the device
    # copy is), each layer goes as it is done.
    if case == "staged":
        monkeypatch.setenv(STAGE_ENV, "1")
    p_port, d_port = free_ports(2, run=1)
    p_kv, d_kv = caches(HEADS, 90, 0, MODEL_LAYERS), caches(HEADS, 91, 0, MODEL_LAYERS)
    transport = "tcp" if case == "host-cache-tcp" else "auto"
    prefill = worker("kv_producer", p_port, 0, 1, HEADS, p_kv, 0, 1, transport)
    decode = worker("kv_consumer", d_port, 0, 1, HEADS, d_kv, 0, 1, transport)
    sides += [prefill, decode]
    push_once(prefill, decode, list(p_kv), "tid7", p_port, d_port, lambda: None)  # the link is up from here on
    d_kv[next(iter(d_kv))].zero_()
    seen: list[bool] = []
    jobs: list[tuple[str, int]] = []  # (how, layers) of each call that queued layers of tid8
    one, many = prefill.engine.push_layer, prefill.engine.push_layers
    monkeypatch.setattr(prefill.engine, "push_layer", lambda tid, *a, **k: (
        jobs.append(("push_layer", 1)), one(tid, *a, **k))[1])
    monkeypatch.setattr(prefill.engine, "push_layers", lambda tid, peer, first, blocks, views, deadline, **k: (
        jobs.append(("push_layers", len(views))), many(tid, peer, first, blocks, views, deadline, **k))[1])
    push_once(prefill, decode, list(p_kv), "tid8", p_port, d_port,
              lambda: seen.append(prefill.engine.outgoing("tid8") is not None))
    assert seen == [case != "host-cache-shm"]
    # Read in place: the whole transfer queued as one job (one frame, one wake-up of the sender); else layer by layer.
    assert jobs == ([("push_layers", len(p_kv))] if case == "host-cache-shm" else [("push_layer", 1)] * len(p_kv))
    assert prefill.engine.peer_reads_in_place(Address("127.0.0.1", d_port)) == (case != "host-cache-tcp")
    for name in d_kv:
        assert torch.equal(d_kv[name][[4, 0]], p_kv[name][[1, 3]])


def test_a_decode_stage_gathers_its_layers_from_two_prefill_stages(sides: list[WorkerSide], mode: str) -> None:
    # Prefill PP 2 x TP 2 (one head and two layers per rank) to decode PP 1 x TP 1 (both heads of all four
    # layers): the decode rank makes four pulls, one per prefill rank, each of one head of two layers.
    p_port, d_port = free_ports(2, run=4)
    p_kv = {(st, r): caches(1, 50 + 2 * st + r, st) for st in range(2) for r in range(2)}
    prefill = [worker("kv_producer", p_port, r, 2, HEADS, p_kv[st, r], st) for st in range(2) for r in range(2)]
    d_kv = caches(HEADS, 60, 0, MODEL_LAYERS)
    decode = worker("kv_consumer", d_port, 0, 1, HEADS, d_kv, 0, 1)
    sides += [*prefill, decode]
    src, dst = (0, 3), (2, 1)
    warm_pipes(mode, [decode], 4, lambda tid: offer_and_pull(prefill, [decode], tid, src, dst, p_port,
                                                               prefill_tp=2, prefill_pp=2))
    offer_and_pull(prefill, [decode], "tid5", src, dst, p_port, prefill_tp=2, prefill_pp=2)
    for layer in range(MODEL_LAYERS):
        name = f"model.layers.{layer}.self_attn.attn"
        for r in range(2):
            assert torch.equal(d_kv[name][list(dst), r : r + 1], p_kv[layer // LAYERS, r][name][list(src)])
    check_moved([decode], [d_kv], dst, mode)


def test_two_decode_stages_pull_their_layers_from_one_prefill_stage(sides: list[WorkerSide], mode: str) -> None:
    # Prefill PP 1 to decode PP 2: each decode stage pulls its two layers; the prefill rank holds its blocks until
    # both stages have pulled.
    p_port, d_port = free_ports(2, run=2)
    p_kv = caches(HEADS, 70, 0, MODEL_LAYERS)
    prefill = worker("kv_producer", p_port, 0, 1, HEADS, p_kv, 0, 1)
    d_kv = [caches(HEADS, 80 + st, st) for st in range(2)]
    decode = [worker("kv_consumer", d_port, 0, 1, HEADS, d_kv[st], st) for st in range(2)]
    sides += [prefill, *decode]
    src, dst = (4, 0, 2), (1, 2, 3)

    def pull(tid: str) -> None:
        prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id=tid, peer=None, block_ids=src)]))
        prefill.wait_for_save()
        load = LoadSpec(req_id="d-req", transfer_id=tid, first_block=0, block_ids=dst,
                        pull_from=Address("127.0.0.1", p_port), prefill_pp=1)
        decode[0].bind(P2pkvMetadata(loads=[load]))
        settle(decode[0], "d-req", sending=False)
        assert prefill.get_finished({"p-req"}) == (None, None)  # one of its two pullers so far
        decode[1].bind(P2pkvMetadata(loads=[load]))
        settle(decode[1], "d-req", sending=False)
        settle(prefill, "p-req", sending=True)

    warm_pipes(mode, decode, 1, pull)
    pull("tid6")
    for st in range(2):
        assert decode[st].take_load_errors() == set()
        for name in d_kv[st]:
            assert torch.equal(d_kv[st][name][list(dst)], p_kv[name][list(src)])
    check_moved(decode, d_kv, dst, mode)


def test_a_fallback_pull_that_cannot_be_planned_fails_the_load_not_the_step(sides: list[WorkerSide]) -> None:
    # The push to this decode rank was refused (the sender holds other heads); the fallback pull by heads cannot
    # be planned (3 heads over TP 2: no such model). get_finished reports load errors and the load as finished.
    (d_port,) = free_ports(1, run=2)
    decode = worker("kv_consumer", d_port, 0, 2, 3, caches(1, 6))
    sides.append(decode)
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="tid7", first_block=0, block_ids=(1, 2),
                                              fallback_from=Address("127.0.0.1", 9),
                                              prefill_tp=1)]))
    decode.engine.store.fail("tid7", WhyPull.HEADS_DIFFER.value)
    assert decode.get_finished(set()) == (None, None)  # the fallback failed to start: reported at the next check
    assert decode.take_load_errors() == {1, 2}
    assert decode.get_finished(set()) == (None, {"d-req"})
    assert decode.engine.pull_result("tid7@0") is None  # nothing was submitted


def test_a_push_left_for_a_pull_is_pulled_cache_to_cache_from_the_load_start(sides: list[WorkerSide],
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Caches handled as GPU caches are (`P2PKV_STAGE_KV`): the decode worker can open the prefill worker's export,
    so a PUT_ASYNC save is left for a pull (PullInstead). The load starts its pull as it is bound, by reference,
    straight into the blocks; once the link is up, the prefill worker copies nothing to the host for the next."""
    monkeypatch.setenv(STAGE_ENV, "1")
    p_port, d_port = free_ports(2, run=2)
    p_kv, d_kv = caches(HEADS, 11, layers=MODEL_LAYERS), caches(HEADS, 12, layers=MODEL_LAYERS)
    prefill = worker("kv_producer", p_port, 0, 1, HEADS, p_kv, pp_size=1)
    decode = worker("kv_consumer", d_port, 0, 1, HEADS, d_kv, pp_size=1)
    sides += [prefill, decode]
    to_host = 'p2pkv_device_copy_bytes_total'
    for round_, (src, dst) in enumerate((((3, 0), (1, 2)), ((4, 1), (0, 3)))):
        tid, copied = f"left{round_}", prefill.engine.metrics.registry.get_sample_value(
            to_host, {"direction": "to_host"})
        prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id=tid, peer=Address("127.0.0.1", d_port),
                                                   block_ids=src)]))
        prefill.wait_for_save()
        assert decode.engine.wait_staged(tid, 10) is StageState.FAILED
        assert decode.engine.store.reason(tid) == WhyPull.DEVICE_PATH.value
        out = prefill.engine.wait_outgoing(tid, 10)  # the notice may arrive before its sender marks the push
        assert out is not None and out.state is OutState.REFUSED
        prefill.get_finished(set())  # the push ended refused: the prefill worker offers the blocks
        decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id=tid, first_block=0, block_ids=dst,
                                                  fallback_from=Address("127.0.0.1", p_port))]))
        assert decode.engine.pull_result(tid) is not None, "the pull started with the load, not a step later"
        settle(decode, "d-req", sending=False)
        assert decode.take_load_errors() == set()
        settle(prefill, "p-req", sending=True)
        for name in p_kv:
            assert torch.equal(d_kv[name][list(dst)], p_kv[name][list(src)])
        if round_:  # the first round copied its layers before the link was up; this one copies none
            assert copied
            assert prefill.engine.metrics.registry.get_sample_value(to_host, {"direction": "to_host"}) == copied
    received = decode.engine.metrics.registry.get_sample_value("p2pkv_bytes_received_total",
                                                               {"transport": "host_ipc"})
    assert received == 2 * 2 * MODEL_LAYERS * p_kv["model.layers.0.self_attn.attn"][0].nbytes


def one_to_one(sides: list[WorkerSide], seed: int) -> tuple[WorkerSide, WorkerSide, dict[str, torch.Tensor],
                                                                dict[str, torch.Tensor], int, int]:
    """A TP 1 prefill worker and a TP 1 decode worker (one stage each): both, their caches and their ports."""
    p_port, d_port = free_ports(2, run=2)
    p_kv, d_kv = caches(HEADS, seed), caches(HEADS, seed + 1)
    prefill = worker("kv_producer", p_port, 0, 1, HEADS, p_kv, pp_size=1)
    decode = worker("kv_consumer", d_port, 0, 1, HEADS, d_kv, pp_size=1)
    sides += [prefill, decode]
    return prefill, decode, p_kv, d_kv, p_port, d_port


@pytest.mark.parametrize("load_first", [False, True])
def test_a_load_pushed_by_a_refused_prefill_worker_fails_at_once(sides: list[WorkerSide], load_first: bool) -> None:
    """The decode worker refused the prefill worker at its hello (another KV layout: float64 blocks here, float32
    there), as it refuses each of its pushes: a load of KV that worker pushes fails as soon as the refusal is
    known, bound before it or after, not once its deadline (60 s) has passed. The control: a load pushed by
    another prefill worker, not refused, waits."""
    p_port, d_port = free_ports(2, run=2)
    keys: dict[str, object] = {"transfer_timeout_s": 60}
    prefill = worker("kv_producer", p_port, 0, 1, HEADS, caches(HEADS, 30), pp_size=1, keys=keys)
    decode = worker("kv_consumer", d_port, 0, 1, HEADS,
                    {name: t.double() for name, t in caches(HEADS, 31).items()}, pp_size=1, keys=keys)
    sides += [prefill, decode]
    load = LoadSpec(req_id="d-req", transfer_id="tid30", first_block=0, block_ids=(1, 2),
                    fallback_from=Address("127.0.0.1", p_port))

    def push() -> None:
        prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="tid30",
                                                   peer=Address("127.0.0.1", d_port), block_ids=(3, 4))]))
        prefill.wait_for_save()
        out = prefill.engine.wait_outgoing("tid30", 10)
        assert out is not None and out.state is OutState.FAILED and "KV layout mismatch" in out.reason, out

    if load_first:
        decode.bind(P2pkvMetadata(loads=[load]))
        assert decode.get_finished(set()) == (None, None)  # nothing is known of the push yet: it waits
    push()
    if not load_first:
        decode.bind(P2pkvMetadata(loads=[load]))
    settle(decode, "d-req", sending=False)
    assert decode.take_load_errors() == {1, 2}
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req2", transfer_id="tid31", first_block=0, block_ids=(3,),
                                              fallback_from=Address("127.0.0.1", p_port + 50))]))
    time.sleep(0.2)
    assert decode.get_finished(set()) == (None, None)
    assert decode.take_load_errors() == set()


def test_a_load_from_a_prefill_instance_restarted_since_its_refusal_waits_for_its_push(
        sides: list[WorkerSide]) -> None:
    """The decode worker refused the prefill worker (float32 blocks against its float64); that prefill instance
    then restarts on the same port with float64 blocks (vLLM gives it another engine id). Its first push is on
    the way, and its hello will be accepted: a load that names the new start (`DecodeParams.prefill_launch`) waits
    for it and lands its bytes, though the refusal is still noted (no hello from the new start yet). The controls:
    loads that name the refused start, or none, fail at once as before."""
    p_port, d_port = free_ports(2, run=2)
    keys: dict[str, object] = {"transfer_timeout_s": 60}
    d_kv = {name: t.double() for name, t in caches(HEADS, 61).items()}
    decode = worker("kv_consumer", d_port, 0, 1, HEADS, d_kv, pp_size=1, keys=keys, engine_id="decode-start")
    before = worker("kv_producer", p_port, 0, 1, HEADS, caches(HEADS, 60), pp_size=1, keys=keys,
                    engine_id="prefill-start-1")
    sides += [decode, before]
    before.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="old", peer=Address("127.0.0.1", d_port),
                                              block_ids=(3, 4))]))
    before.wait_for_save()
    out = before.engine.wait_outgoing("old", 10)
    assert out is not None and out.state is OutState.FAILED and "KV layout mismatch" in out.reason, out
    before.shutdown()
    sides.remove(before)
    prefill_at = Address("127.0.0.1", p_port)
    old, new = launch_of("prefill-start-1"), launch_of("prefill-start-2")
    for req, launch in (("refused-start", old), ("unnamed", "")):
        decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id=req, transfer_id=f"t-{req}", first_block=0, block_ids=(1,),
                                                  fallback_from=prefill_at,
                                                  prefill_launch=launch)]))
        settle(decode, req, sending=False)
        assert decode.take_load_errors() == {1}
    p_kv = {name: t.double() for name, t in caches(HEADS, 62).items()}
    after = worker("kv_producer", p_port, 0, 1, HEADS, p_kv, pp_size=1, keys=keys, engine_id="prefill-start-2")
    sides.append(after)
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="new", first_block=0, block_ids=(1, 2),
                                              fallback_from=prefill_at,
                                              prefill_launch=new)]))
    time.sleep(0.2)
    assert decode.get_finished(set()) == (None, None), "it waits for the push"
    assert decode.take_load_errors() == set()
    assert decode.engine.refusal(prefill_at) is not None, "the refusal is still noted: no hello from there yet"
    after.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="new", peer=Address("127.0.0.1", d_port),
                                             block_ids=(3, 4))]))
    after.wait_for_save()
    settle(decode, "d-req", sending=False)
    assert decode.take_load_errors() == set()
    assert decode.engine.refusal(prefill_at) is None, "the new start's hello was accepted"
    for name in d_kv:
        assert torch.equal(d_kv[name][1:3], p_kv[name][3:5]), name


def test_a_get_transfer_is_not_held_for_a_decode_worker_this_worker_refused(sides: list[WorkerSide]) -> None:
    """GET: the decode worker's pull was refused at its hello (float64 blocks against float32), so its load failed,
    and the blocks held for it are freed then. The next transfer that decode instance is to pull is not held (its
    pull would be refused alike): the request is reported sent at once, its blocks free, instead of held until the
    lease runs out (60 s). The control: one for another decode instance is held."""
    p_port, d_port = free_ports(2, run=2)
    keys: dict[str, object] = {"transfer_timeout_s": 60, "lease_s": 60}
    prefill = worker("kv_producer", p_port, 0, 1, HEADS, caches(HEADS, 40), pp_size=1, keys=keys)
    decode = worker("kv_consumer", d_port, 0, 1, HEADS,
                    {name: t.double() for name, t in caches(HEADS, 41).items()}, pp_size=1, keys=keys)
    sides += [prefill, decode]
    by_decode, by_other = Address("127.0.0.1", d_port), Address("127.0.0.1", d_port + 50)

    def save(req: str, tid: str, pulled_by: Address) -> None:
        prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id=req, transfer_id=tid, peer=None, block_ids=(3, 4),
                                                   pulled_by=pulled_by, pullers=1)]))
        prefill.wait_for_save()

    save("p-req", "g1", by_decode)
    assert prefill.engine.offer_state("g1") is not None  # nothing known of that decode instance yet: held
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="g1", first_block=0, block_ids=(1, 2),
                                              pull_from=Address("127.0.0.1", p_port))]))
    settle(decode, "d-req", sending=False)
    assert decode.take_load_errors() == {1, 2}
    assert "KV layout mismatch" in str(prefill.engine.refusal(by_decode))
    assert prefill.engine.offer_state("g1") is OfferState.EXPIRED, "freed at the refusal, not by its lease"
    assert prefill.get_finished({"p-req"})[0] == {"p-req"}
    save("p-req2", "g2", by_decode)
    assert prefill.engine.offer_state("g2") is None
    assert prefill.get_finished({"p-req2"})[0] == {"p-req2"}
    save("p-req3", "g3", by_other)
    assert prefill.engine.offer_state("g3") is not None
    assert prefill.get_finished({"p-req3"})[0] is None


def test_a_get_transfer_is_held_for_a_decode_instance_restarted_since_its_refusal(sides: list[WorkerSide]) -> None:
    """GET: the prefill worker refused the decode worker's pull (float64 blocks against its float32); the decode
    instance then restarts on the same port with float32 blocks (another engine id). A save whose decode instance
    the proxy names by its new start (`PrefillParams.decode_launch`) is held for it, though the refusal is still
    noted (no hello from the new start yet), and its pull lands the bytes. The controls: saves naming the refused
    start, or none, are not held."""
    p_port, d_port = free_ports(2, run=2)
    keys: dict[str, object] = {"transfer_timeout_s": 60, "lease_s": 60}
    p_kv = caches(HEADS, 70)
    prefill = worker("kv_producer", p_port, 0, 1, HEADS, p_kv, pp_size=1, keys=keys, engine_id="prefill-start")
    before = worker("kv_consumer", d_port, 0, 1, HEADS, {name: t.double() for name, t in caches(HEADS, 71).items()},
                    pp_size=1, keys=keys, engine_id="decode-start-1")
    sides += [prefill, before]
    prefill_at, decode_at = Address("127.0.0.1", p_port), Address("127.0.0.1", d_port)

    def save(req: str, tid: str, launch: str) -> None:
        prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id=req, transfer_id=tid, peer=None, block_ids=(3, 4),
                                                   pulled_by=decode_at, pullers=1,
                                                   puller_launch=launch)]))
        prefill.wait_for_save()

    save("p-req", "g1", launch_of("decode-start-1"))
    before.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="g1", first_block=0, block_ids=(1, 2),
                                              pull_from=prefill_at)]))
    settle(before, "d-req", sending=False)
    assert before.take_load_errors() == {1, 2}
    before.shutdown()
    sides.remove(before)
    assert prefill.get_finished({"p-req"})[0] == {"p-req"}
    for req, launch in (("refused-start", launch_of("decode-start-1")), ("unnamed", "")):
        save(req, f"g-{req}", launch)
        assert prefill.engine.offer_state(f"g-{req}") is None, "not held: the refused start, or none named"
        assert prefill.get_finished({req})[0] == {req}
    d_kv = caches(HEADS, 72)
    after = worker("kv_consumer", d_port, 0, 1, HEADS, d_kv, pp_size=1, keys=keys, engine_id="decode-start-2")
    sides.append(after)
    save("p-req2", "g2", launch_of("decode-start-2"))
    assert prefill.engine.offer_state("g2") is OfferState.OFFERED, "held for the new start"
    assert prefill.engine.refusal(decode_at) is not None, "the refusal is still noted: no hello from there yet"
    after.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req2", transfer_id="g2", first_block=0, block_ids=(1, 2),
                                             pull_from=prefill_at)]))
    settle(after, "d-req2", sending=False)
    assert after.take_load_errors() == set()
    assert prefill.engine.refusal(decode_at) is None, "the new start's hello was accepted"
    for name in d_kv:
        assert torch.equal(d_kv[name][1:3], p_kv[name][3:5]), name


@pytest.mark.parametrize("discarded", [True, False])
def test_a_discarded_push_is_freed_when_it_arrives_and_never_reported(sides: list[WorkerSide],
                                                                      discarded: bool) -> None:
    """A decode request that loads nothing (its prompt was in the decode instance's own cache) frees the push made
    for it once it arrives, and no load is reported for it: vLLM asserts that a reported request waits for KV.
    Without the discard (the control) the staged push stays until expiry."""
    prefill, decode, p_kv, d_kv, _, d_port = one_to_one(sides, 50)
    before = {name: t.clone() for name, t in d_kv.items()}
    decode.bind(P2pkvMetadata(discards=[Discard("tid8")] if discarded else []))  # before the push arrives, as in vLLM
    push(prefill, p_kv, "tid8", d_port, (1, 3))
    deadline = time.monotonic() + 10
    while decode.engine.staged_state("tid8") is not StageState.COMPLETE and time.monotonic() < deadline:
        if decode.engine.staged_state("tid8") is None and discarded and decode.engine.store.bytes_in_use == 0:
            break
        assert decode.get_finished(set()) == (None, None)
        time.sleep(0.01)
    assert decode.get_finished(set()) == (None, None)
    if discarded:
        assert decode.engine.staged_state("tid8") is None and decode.engine.store.bytes_in_use == 0
    else:
        assert decode.engine.staged_state("tid8") is StageState.COMPLETE and decode.engine.store.bytes_in_use > 0
    assert all(torch.equal(d_kv[name], before[name]) for name in d_kv)
    assert decode.take_load_errors() == set()


def test_a_discarded_push_is_freed_on_an_idle_instance_without_another_step(sides: list[WorkerSide]) -> None:
    """The client left while its push was on the way and the decode instance then went idle: vLLM calls no
    worker hook again, and the push is freed by the time it has landed all the same."""
    prefill, decode, p_kv, _, _, d_port = one_to_one(sides, 50)
    decode.bind(P2pkvMetadata(discards=[Discard("tid9")]))
    assert decode.get_finished(set()) == (None, None)  # the last step this instance takes
    push(prefill, p_kv, "tid9", d_port, (1, 3))
    assert decode.engine.staged_state("tid9") is StageState.FAILED
    assert decode.engine.store.bytes_in_use == 0


@pytest.mark.parametrize("released", [True, False])
def test_a_discarded_pull_releases_the_blocks_the_prefill_side_holds(sides: list[WorkerSide], released: bool) -> None:
    """GET mode, a decode request that loads nothing: its worker tells the prefill worker to free the blocks held
    for its pull at once (a pull of no heads), instead of their lease running out; nothing lands, nothing is
    reported. The control, without the release, holds them."""
    prefill, decode, _, d_kv, p_port, _ = one_to_one(sides, 60)
    before = {name: t.clone() for name, t in d_kv.items()}
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="tid9", peer=None, block_ids=(1, 3))]))
    prefill.wait_for_save()
    assert prefill.get_finished({"p-req"}) == (None, None)  # held for the pull, for up to lease_s
    held_at = Address("127.0.0.1", p_port) if released else None
    decode.bind(P2pkvMetadata(discards=[Discard("tid9", held_at)]))
    deadline, sent = time.monotonic() + 3, None
    while sent is None and time.monotonic() < deadline:
        assert decode.get_finished(set()) == (None, None)
        sent = prefill.get_finished(set())[0]
        time.sleep(0.01)
    assert (sent == {"p-req"}) is released
    assert all(torch.equal(d_kv[name], before[name]) for name in d_kv)
    assert decode.take_load_errors() == set()


@pytest.mark.parametrize("preempted", [True, False])
def test_blocks_of_a_preempted_request_are_no_longer_offered(sides: list[WorkerSide], preempted: bool) -> None:
    """GET: the prefill request holding blocks for a pull is preempted (vLLM frees its blocks; the next forward may
    write other KV into them). Its offer is withdrawn, so the decode side's pull fails (its blocks are load errors:
    vLLM recomputes) instead of reading other KV. The control, not preempted, pulls the blocks."""
    prefill, decode, p_kv, d_kv, p_port, _ = one_to_one(sides, 70)
    src, dst = (1, 3), (4, 0)
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="tid10", peer=None, block_ids=src)]))
    prefill.wait_for_save()
    if preempted:
        prefill.handle_preemptions(["tid10"])
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="tid10", first_block=0, block_ids=dst,
                                              pull_from=Address("127.0.0.1", p_port))]))
    settle(decode, "d-req", sending=False)
    errors = decode.take_load_errors()
    if preempted:
        assert errors == set(dst)
    else:
        assert errors == set() and all(torch.equal(d_kv[n][list(dst)], p_kv[n][list(src)]) for n in d_kv)
    settle(prefill, "p-req", sending=True)  # once finished, the request's blocks go back to vLLM either way


@pytest.mark.parametrize("again", [True, False])
def test_a_preempted_request_that_computes_its_prompt_again_holds_its_transfer_again(sides: list[WorkerSide],
                                                                                     again: bool) -> None:
    """GET: a prefill request that goes on decoding is preempted after its save, its offer withdrawn; resumed, vLLM
    computes its prompt again into other blocks, and the scheduler side saves it again (`again`). The transfer is
    then offered from the new blocks, and the decode side's pull gets them. The control, not saved again, is
    refused ("withdrawn")."""
    prefill, decode, p_kv, d_kv, p_port, _ = one_to_one(sides, 150)
    old, new, dst = (1, 3), (4, 2), (4, 0)
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="tid18", peer=None, block_ids=old)]))
    prefill.wait_for_save()
    prefill.handle_preemptions(["tid18"])
    for t in p_kv.values():
        t[list(old)] = 0  # other KV in the freed blocks
    if again:
        prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="tid18", peer=None, block_ids=new,
                                                   again=True)]))
        prefill.wait_for_save()
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="tid18", first_block=0, block_ids=dst,
                                              pull_from=Address("127.0.0.1", p_port))]))
    settle(decode, "d-req", sending=False)
    errors = decode.take_load_errors()
    if again:
        assert errors == set() and all(torch.equal(d_kv[n][list(dst)], p_kv[n][list(new)]) for n in d_kv)
    else:
        assert errors == set(dst)
    settle(prefill, "p-req", sending=True)


def test_a_push_that_went_through_is_not_held_again_after_a_preemption(sides: list[WorkerSide]) -> None:
    """The decode side has a pushed transfer's bytes: saved again after a preemption, nothing is offered or sent."""
    prefill, decode, p_kv, d_kv, _, d_port = one_to_one(sides, 160)
    src, dst = (1, 3), (4, 0)
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="tid19", peer=Address("127.0.0.1", d_port),
                                               block_ids=src)]))
    prefill.wait_for_save()
    prefill.handle_preemptions(prefill.transfers_of({"p-req"}))
    for t in p_kv.values():
        t.zero_()  # other KV in every block: what the decode side loads must be what was pushed before
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="tid19", peer=None, block_ids=(4, 2),
                                               again=True)]))
    prefill.wait_for_save()
    assert prefill.engine.offer_state("tid19") is None
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="tid19", first_block=0, block_ids=dst)]))
    settle(decode, "d-req", sending=False)
    assert decode.take_load_errors() == set()
    assert all(torch.equal(d_kv[n][list(dst)], caches(HEADS, 160)[n][list(src)]) for n in d_kv)
    settle(prefill, "p-req", sending=True)


def test_a_refused_push_is_held_again_after_a_preemption(sides: list[WorkerSide],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode side refused the push; the request is preempted before its blocks were held for the pull, then
    computes its prompt again: the new blocks are held, and the pull gets them."""
    prefill, decode, p_port = refused_push(sides, monkeypatch, 170, "tid20")
    prefill.handle_preemptions(["tid20"])
    assert prefill.get_finished(set()) == (None, None) and prefill.engine.offer_state("tid20") is None
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="tid20", peer=None, block_ids=(4, 2),
                                               again=True)]))
    prefill.wait_for_save()
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="tid20", first_block=0, block_ids=(4, 0),
                                              pull_from=Address("127.0.0.1", p_port))]))
    settle(decode, "d-req", sending=False)
    assert decode.take_load_errors() == set()
    settle(prefill, "p-req", sending=True)


def test_a_push_of_a_preempted_request_is_waited_for(sides: list[WorkerSide]) -> None:
    """A push still reading a preempted request's blocks finishes before the next forward may overwrite them."""
    prefill, decode, p_kv, d_kv, _, d_port = one_to_one(sides, 80)
    src, dst = (1, 3), (4, 0)
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="tid11", first_block=0, block_ids=dst)]))
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="tid11", peer=Address("127.0.0.1", d_port),
                                               block_ids=src)]))
    for name in p_kv:
        prefill.save_layer(name)
    prefill.wait_for_save()
    prefill.handle_preemptions(prefill.transfers_of({"p-req"}))
    out = prefill.engine.outgoing("tid11")
    assert out is not None and out.state is OutState.DONE
    for t in p_kv.values():
        t.zero_()  # the next forward writes other KV into the freed blocks
    settle(decode, "d-req", sending=False)
    assert decode.take_load_errors() == set()
    assert all(torch.equal(d_kv[n][list(dst)], caches(HEADS, 80)[n][list(src)]) for n in d_kv)


@pytest.mark.parametrize("releasing", [2, 1])
def test_decode_ranks_of_tp_2_release_what_a_tp_1_prefill_worker_holds_for_them(sides: list[WorkerSide],
                                                                                 releasing: int) -> None:
    """The prefill worker's offer awaits a pull from each of the two decode ranks (each wants half the heads). A
    decode request that loads nothing: each rank sends its release, and once both have, the blocks go. The
    control: one rank's release alone leaves them held."""
    p_port, d_port = free_ports(2, run=2)
    prefill = worker("kv_producer", p_port, 0, 1, HEADS, caches(HEADS, 90), pp_size=1)
    decode = [worker("kv_consumer", d_port, r, 2, HEADS, caches(1, 91 + r), pp_size=1) for r in range(2)]
    sides += [prefill, *decode]
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="tid12", peer=None, block_ids=(1, 3))]))
    prefill.wait_for_save()
    assert prefill.get_finished({"p-req"}) == (None, None)
    for d in decode[:releasing]:
        d.bind(P2pkvMetadata(discards=[Discard("tid12", Address("127.0.0.1", p_port), prefill_tp=1)]))
    deadline, sent = time.monotonic() + 3, None
    while sent is None and time.monotonic() < deadline:
        for d in decode:
            assert d.get_finished(set()) == (None, None)
        sent = prefill.get_finished(set())[0]
        time.sleep(0.01)
    assert (sent == {"p-req"}) is (releasing == 2)
    assert all(d.take_load_errors() == set() for d in decode)


def push(prefill: WorkerSide, p_kv: dict[str, torch.Tensor], tid: str, d_port: int, src: tuple[int, ...]) -> None:
    """The prefill worker saves blocks `src` and pushes them to the decode worker at `d_port`; waits until sent."""
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id=tid, peer=Address("127.0.0.1", d_port),
                                               block_ids=src)]))
    for name in p_kv:
        prefill.save_layer(name)
    prefill.wait_for_save()
    settle(prefill, "p-req", sending=True)


@pytest.mark.parametrize("ended", [True, False])
def test_a_load_whose_request_ended_is_reported_at_once_and_its_push_freed_on_arrival(sides: list[WorkerSide],
                                                                                      ended: bool) -> None:
    """vLLM ended a decode request while it waited for its push (its client went away): vLLM holds its blocks
    until the load is reported, so it is reported at once, with no load error, not at the transfer's deadline; the
    push, when it arrives, is freed and lands nowhere. The control, not ended, waits for the push and lands it."""
    prefill, decode, p_kv, d_kv, _, d_port = one_to_one(sides, 100)
    before = {name: t.clone() for name, t in d_kv.items()}
    src, dst = (1, 3), (4, 0)
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="tid13", first_block=0, block_ids=dst)]))
    assert decode.get_finished(set()) == (None, None)  # waiting for the push
    if ended:
        assert decode.get_finished({"d-req"}) == (None, {"d-req"})
        assert decode.get_finished(set()) == (None, None)  # reported once
    push(prefill, p_kv, "tid13", d_port, src)
    if not ended:
        settle(decode, "d-req", sending=False)
        assert all(torch.equal(d_kv[n][list(dst)], p_kv[n][list(src)]) for n in d_kv)
    else:
        deadline = time.monotonic() + 10
        while ((decode.engine.store.bytes_in_use or decode.engine.staged_state("tid13") is not None)
               and time.monotonic() < deadline):
            assert decode.get_finished(set()) == (None, None)
            time.sleep(0.01)
        assert decode.engine.store.bytes_in_use == 0 and decode.engine.staged_state("tid13") is None
        assert all(torch.equal(d_kv[name], before[name]) for name in d_kv)
    assert decode.take_load_errors() == set()


def test_a_pull_whose_request_ended_is_left_to_finish(sides: list[WorkerSide]) -> None:
    """A pull writes into the blocks as it goes: a request ended while its pull is in flight is reported only once
    the pull has settled (vLLM may reuse the blocks then)."""
    prefill, decode, p_kv, d_kv, p_port, _ = one_to_one(sides, 110)
    src, dst = (1, 3), (4, 0)
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="tid14", peer=None, block_ids=src)]))
    prefill.wait_for_save()
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="tid14", first_block=0, block_ids=dst,
                                              pull_from=Address("127.0.0.1", p_port))]))
    decode.engine.wait_pull("tid14", 10)
    assert decode.get_finished({"d-req"}) == (None, {"d-req"})  # reported as the pull it was: settled, landed
    assert decode.take_load_errors() == set()
    assert all(torch.equal(d_kv[n][list(dst)], p_kv[n][list(src)]) for n in d_kv)


@pytest.mark.parametrize("aborted", [True, False])
def test_blocks_of_an_aborted_prefill_request_are_no_longer_held_for_a_pull(sides: list[WorkerSide],
                                                                           aborted: bool) -> None:
    """GET: the prefill request was aborted after its blocks were offered (its client went away, so nobody has
    its parameters): the offer is withdrawn and the blocks go back to vLLM at once, not when the lease runs out.
    The control, finished as usual, holds them for the pull."""
    prefill, decode, _, _, p_port, _ = one_to_one(sides, 120)
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="tid15", peer=None, block_ids=(1, 3))]))
    prefill.wait_for_save()
    assert prefill.get_finished({"p-req"}) == (None, None)
    prefill.bind(P2pkvMetadata(abandoned=["tid15"] if aborted else []))
    deadline, sent = time.monotonic() + 2, None
    while sent is None and time.monotonic() < deadline:
        sent = prefill.get_finished(set())[0]
        time.sleep(0.01)
    assert (sent == {"p-req"}) is aborted
    if aborted:
        assert prefill.engine.offer_state("tid15") is None  # nothing is offered any more
    # A pull of it, should one come after all, is refused at once (it is not left waiting for an offer until its
    # 10-s deadline): its load fails, and vLLM computes the prompt. The control is held, and pulled.
    started = time.monotonic()
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="tid15", first_block=0, block_ids=(4, 0),
                                              pull_from=Address("127.0.0.1", p_port))]))
    settle(decode, "d-req", sending=False)
    assert time.monotonic() - started < 2
    assert decode.take_load_errors() == ({4, 0} if aborted else set())


def refused_push(sides: list[WorkerSide], monkeypatch: pytest.MonkeyPatch, seed: int,
                 tid: str) -> tuple[WorkerSide, WorkerSide, int]:
    """A prefill worker's push of blocks (1, 3) that the decode worker refused (it asks for a pull instead, as a
    staged cache does): both workers and the prefill worker's port."""
    monkeypatch.setenv(STAGE_ENV, "1")
    prefill, decode, _, _, p_port, d_port = one_to_one(sides, seed)
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id=tid, peer=Address("127.0.0.1", d_port),
                                               block_ids=(1, 3))]))
    prefill.wait_for_save()
    assert decode.engine.wait_staged(tid, 10) is StageState.FAILED
    out = prefill.engine.wait_outgoing(tid, 10)
    assert out is not None and out.state is OutState.REFUSED
    return prefill, decode, p_port


@pytest.mark.parametrize("fallback", [True, False])
def test_a_discarded_push_that_was_refused_releases_the_blocks_held_for_it(sides: list[WorkerSide],
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          fallback: bool) -> None:
    """The decode side refused a push (here it asks for a pull instead), so the prefill worker holds the blocks
    for a pull; the transfer is then discarded (nothing here loads it). Knowing where the prefill instance is, the
    decode worker releases them at once; the control, not knowing, leaves them held until the lease runs out."""
    prefill, decode, p_port = refused_push(sides, monkeypatch, 130, "tid16")
    assert prefill.get_finished({"p-req"}) == (None, None)  # held for a pull now
    decode.bind(P2pkvMetadata(discards=[Discard("tid16", fallback_from=Address("127.0.0.1", p_port) if fallback
                                                else None)]))
    deadline, sent = time.monotonic() + 3, None
    while sent is None and time.monotonic() < deadline:
        assert decode.get_finished(set()) == (None, None)
        sent = prefill.get_finished(set())[0]
        time.sleep(0.01)
    assert (sent == {"p-req"}) is fallback
    assert decode.take_load_errors() == set()


@pytest.mark.parametrize("abandoned_first", [True, False])
def test_a_refused_push_whose_transfer_is_abandoned_is_not_held_for_a_pull(sides: list[WorkerSide],
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           abandoned_first: bool) -> None:
    """The decode side refused a push (here it asks for a pull instead); then the transfer is abandoned on the
    prefill side (the client went away during the prefill, and the proxy told the prefill instance: the decode
    instance does not know where the blocks are). The blocks are not held for a pull, whether the abandon comes
    before the worker saw the refusal or after it offered the blocks; a pull that comes anyway is refused at once."""
    prefill, decode, p_port = refused_push(sides, monkeypatch, 140, "tid17")
    if abandoned_first:
        prefill.bind(P2pkvMetadata(abandoned=["tid17"]))
        assert prefill.get_finished({"p-req"}) == ({"p-req"}, None)
    else:
        assert prefill.get_finished({"p-req"}) == (None, None)  # held for a pull now
        assert prefill.engine.offer_state("tid17") is not None
        prefill.bind(P2pkvMetadata(abandoned=["tid17"]))
        assert prefill.get_finished(set()) == ({"p-req"}, None)
    assert prefill.engine.offer_state("tid17") is None
    started = time.monotonic()
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="tid17", first_block=0, block_ids=(4, 0),
                                              pull_from=Address("127.0.0.1", p_port))]))
    settle(decode, "d-req", sending=False)
    assert time.monotonic() - started < 2
    assert decode.take_load_errors() == {4, 0}


@pytest.mark.parametrize("wanted", [True, False])
def test_transfers_still_wanted_outlive_the_lease_and_the_staging_expiry(sides: list[WorkerSide],
                                                                          wanted: bool) -> None:
    """Two transfers whose decode requests wait for blocks for twice the prefill side's lease and this side's
    staging expiry (0.6 s each): one held for a pull (GET), one pushed and staged here. Told they are still wanted
    (every 0.15 s, as the scheduler side does every third of the lease), the decode worker keeps the staging and
    asks the prefill worker to keep the blocks: both then load, byte for byte. The control, not told, finds the
    offer expired and the staging dropped: both loads fail."""
    p_port, d_port = free_ports(2, run=2)
    keys: dict[str, object] = {"lease_s": 0.6, "staging_expiry_s": 0.6}
    p_kv, d_kv = caches(HEADS, 150), caches(HEADS, 151)
    prefill = worker("kv_producer", p_port, 0, 1, HEADS, p_kv, pp_size=1, keys=keys)
    decode = worker("kv_consumer", d_port, 0, 1, HEADS, d_kv, pp_size=1, keys=keys)
    sides += [prefill, decode]
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-get", transfer_id="tid20", peer=None, block_ids=(1, 2)),
                                      SaveSpec(req_id="p-push", transfer_id="tid21", peer=Address("127.0.0.1", d_port),
                                               block_ids=(3, 4))]))
    for name in p_kv:
        prefill.save_layer(name)
    prefill.wait_for_save()
    assert decode.engine.wait_staged("tid21", 10) is StageState.COMPLETE
    assert prefill.get_finished({"p-get", "p-push"})[0] in (None, {"p-push"})
    keep = [Wanted(Address("127.0.0.1", p_port), ("tid20", "tid21"))] if wanted else []
    for _ in range(8):
        decode.bind(P2pkvMetadata(wanted=keep))
        decode.get_finished(set())
        prefill.get_finished(set())
        time.sleep(0.15)
    assert (prefill.engine.offer_state("tid20") is OfferState.OFFERED) is wanted
    assert (decode.engine.staged_state("tid21") is StageState.COMPLETE) is wanted
    # (The control's dropped push would only fail at the load's deadline, as a push that never came: not loaded.)
    loads = [LoadSpec(req_id="d-get", transfer_id="tid20", first_block=0, block_ids=(0, 1),
                      pull_from=Address("127.0.0.1", p_port))]
    loads += [LoadSpec(req_id="d-push", transfer_id="tid21", first_block=0, block_ids=(2, 3))] if wanted else []
    decode.bind(P2pkvMetadata(loads=loads))
    loaded: set[str] = set()
    deadline = time.monotonic() + 10
    while loaded != {spec.req_id for spec in loads} and time.monotonic() < deadline:
        loaded |= decode.get_finished(set())[1] or set()
        time.sleep(0.01)
    assert loaded == {spec.req_id for spec in loads}
    if not wanted:
        assert decode.take_load_errors() == {0, 1}
        return
    assert decode.take_load_errors() == set()
    assert all(torch.equal(d_kv[n][[0, 1, 2, 3]], p_kv[n][[1, 2, 3, 4]]) for n in d_kv)
    assert prefill.engine.metrics.of(prefill.engine.metrics.lease_renewals, "renewed")._value.get() > 0


@pytest.mark.parametrize("running", [True, False])
def test_the_lease_of_an_offer_counts_from_when_its_request_finishes(sides: list[WorkerSide], running: bool) -> None:
    """GET, a lease of 0.6 s: a prefill request that goes on decoding for 1.2 s after its prompt was offered has
    its blocks held all along (nobody has its answer yet), and for a lease after it finishes: a pull 0.3 s after
    that is served. The control, finished at once, finds its offer expired after the same 1.5 s."""
    p_port, d_port = free_ports(2, run=2)
    p_kv, d_kv = caches(HEADS, 160), caches(HEADS, 161)
    prefill = worker("kv_producer", p_port, 0, 1, HEADS, p_kv, pp_size=1, keys={"lease_s": 0.6})
    decode = worker("kv_consumer", d_port, 0, 1, HEADS, d_kv, pp_size=1)
    sides += [prefill, decode]
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="tid22", peer=None, block_ids=(1, 2))]))
    prefill.wait_for_save()
    prefill.get_finished(set() if running else {"p-req"})
    for _ in range(8):
        prefill.bind(P2pkvMetadata())
        prefill.get_finished(set())
        time.sleep(0.15)
    if running:
        prefill.get_finished({"p-req"})
        time.sleep(0.3)
        prefill.get_finished(set())
    assert (prefill.engine.offer_state("tid22") is OfferState.OFFERED) is running
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="tid22", first_block=0, block_ids=(0, 1),
                                              pull_from=Address("127.0.0.1", p_port))]))
    settle(decode, "d-req", sending=False)
    assert decode.take_load_errors() == (set() if running else {0, 1})


@pytest.mark.skipif(thp_mode() in ("", "never"), reason="this host has no transparent huge pages")
@pytest.mark.parametrize("case", ["auto", "tcp", "huge_pages-off"])
def test_a_host_kv_cache_is_backed_by_huge_pages_where_peers_on_this_host_may_copy_it(sides: list[WorkerSide],
                                                                                        case: str) -> None:
    # vLLM's cache: one zeroed buffer (4 KiB pages where THP is `madvise`), a view of it per layer. Registered with
    # a transport that may read it across processes (auto, shm), it is faulted in again as 2 MiB pages; the bytes a
    # forward writes afterwards move as before. The buffer is a mapping of its own, written with zeros as torch.zeros
    # does: a torch.zeros buffer in this long-lived process may reuse memory already advised for huge pages by
    # another test, and come up huge with nothing to do.
    blocks = 1024  # 2 MiB a layer
    p_port, d_port = free_ports(2, run=1)
    transport = "tcp" if case == "tcp" else "auto"
    keys = {"huge_pages": False} if case == "huge_pages-off" else {}
    kvs = []
    for role, port in (("kv_producer", p_port), ("kv_consumer", d_port)):
        region = mmap.mmap(-1, MODEL_LAYERS * blocks * HEADS * TOKENS * 2 * DIM * 4,
                           flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf = torch.frombuffer(region, dtype=torch.float32)
        buf.zero_()
        if thp_mode() == "madvise":
            assert huge_bytes(buf.data_ptr(), buf.data_ptr() + len(region)) == 0
        kv = {f"model.layers.{i}.self_attn.attn": view.view(blocks, HEADS, TOKENS, 2 * DIM)
              for i, view in enumerate(buf.chunk(MODEL_LAYERS))}
        sides.append(worker(role, port, 0, 1, HEADS, kv, 0, 1, transport, keys))
        kvs.append(kv)
    prefill, decode = sides
    p_kv, d_kv = kvs
    for tensor in p_kv.values():  # a forward writes while the pages are still being faulted in
        tensor.copy_(torch.rand(tensor.shape))
    expected = {name: tensor.clone() for name, tensor in p_kv.items()}
    for side in sides:
        if case == "auto":
            assert side.huge_pages is not None
            result = side.huge_pages.wait(60)
            assert result is not None and result.advised >= 3 * HUGE
            assert result.huge >= result.refaulted >= 3 * HUGE
        else:
            assert side.huge_pages is None
    assert all(torch.equal(p_kv[name], expected[name]) for name in p_kv)
    push_once(prefill, decode, list(p_kv), "tid-huge", p_port, d_port, lambda: None)
    for name in d_kv:
        assert torch.equal(d_kv[name][[4, 0]], p_kv[name][[1, 3]])
