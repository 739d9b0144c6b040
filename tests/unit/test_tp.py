"""Prefill and decode of different tensor-parallel sizes: which heads each rank pulls from where, and pulls of head
slices between real engines over real sockets, into and out of caches shaped as vLLM's CPU build shapes them."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest
import torch

from p2pkv.config import ExtraConfig, Transport
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.offers import OfferState
from p2pkv.engine.puller import HeadSlice, PullState
from p2pkv.engine.sender import OutState
from p2pkv.errors import ConfigError
from p2pkv.kv.layout import KvBlocks
from p2pkv.kv.slices import HeadSlices
from p2pkv.kv.tp import heads_of, plan_pulls
from p2pkv.params import Address
from p2pkv.way import WhyPull

LAYERS, BLOCKS, TOKENS, DIM = 3, 6, 16, 32  # blocks of [heads, tokens, 2 * head_dim] float32, as on CPU
TOTAL_HEADS = 4


def test_heads_of_splits_evenly_or_replicates() -> None:
    assert [heads_of(r, 2, 4) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [heads_of(r, 4, 2) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert heads_of(0, 1, 1) == range(0, 1)  # MLA: one latent, held whole
    for tp, total in ((3, 4), (4, 6), (0, 2)):
        with pytest.raises(ConfigError):
            heads_of(0, tp, total)


def test_decode_ranks_pull_their_heads_from_the_prefill_ranks_that_hold_them() -> None:
    # decode TP 2 from prefill TP 1: both ranks pull one half of rank 0's heads; rank 0 expects two pulls.
    assert [(p.prefill_rank, p.prefill_heads, p.decode_heads, p.pullers) for p in plan_pulls(1, 2, 1, 4)] == \
        [(0, (2, 4), (0, 2), 2)]
    # decode TP 1 from prefill TP 2: one rank gathers from both.
    assert [(p.prefill_rank, p.prefill_heads, p.decode_heads) for p in plan_pulls(0, 1, 2, 4)] == \
        [(0, (0, 2), (0, 2)), (1, (0, 2), (2, 4))]
    # prefill TP 4 over 2 heads (each held twice): ranks 1 and 3 are not needed, only told their blocks may go.
    parts = plan_pulls(0, 1, 4, 2)
    assert [(p.prefill_rank, p.release_only) for p in parts] == [(0, False), (2, False), (1, True), (3, True)]


@pytest.mark.parametrize(("decode_tp", "prefill_tp", "total"),
                         [(d, p, t) for d, p, t in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8))])
def test_every_plan_covers_each_head_once_and_tells_every_prefill_rank(decode_tp: int, prefill_tp: int,
                                                                      total: int) -> None:
    pulls: dict[int, int] = {}
    for d in range(decode_tp):
        got: list[int] = []
        for part in plan_pulls(d, decode_tp, prefill_tp, total):
            theirs = heads_of(part.prefill_rank, prefill_tp, total)
            got += [theirs.start + h for h in range(*part.prefill_heads)]
            assert part.prefill_heads[1] - part.prefill_heads[0] == part.decode_heads[1] - part.decode_heads[0]
            pulls[part.prefill_rank] = pulls.get(part.prefill_rank, 0) + 1
            assert part.pullers >= 1
        mine = heads_of(d, decode_tp, total)
        assert got == list(mine)
    assert sorted(pulls) == list(range(prefill_tp))  # every prefill rank hears from someone
    for p, count in pulls.items():  # and each expects exactly the pulls it gets
        assert {part.pullers for d in range(decode_tp) for part in plan_pulls(d, decode_tp, prefill_tp, total)
                if part.prefill_rank == p} == {count}


def cache(heads: int, seed: int) -> torch.Tensor:
    """A CPU-shaped cache `[blocks, heads, tokens, 2 * dim]` with a storage offset, as torch lays out KV views."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.rand(16 + BLOCKS * heads * TOKENS * 2 * DIM, generator=g)
    return flat[16:].view(BLOCKS, heads, TOKENS, 2 * DIM)


class Worker:
    """One rank's cache (every layer), its head slices and its engine."""

    def __init__(self, heads: int, seed: int, transport: str) -> None:
        self.layers = [cache(heads, seed * 10 + i) for i in range(LAYERS)]
        blocks = KvBlocks.from_tensors(self.layers, TOKENS, "test", TOTAL_HEADS)
        from p2pkv.kv.blocks import InPlaceBlocks

        self.whole = InPlaceBlocks(blocks)
        self.slices = HeadSlices(self.layers, TOKENS, "test", self.whole)
        extra = ExtraConfig(kv_host="127.0.0.1", transport=Transport(transport), transfer_timeout_s=5)
        self.engine = TransferEngine(EngineSettings.from_config(extra, 0, 0), blocks.digest)
        self.engine.start()

    @property
    def address(self) -> Address:
        return Address.parse(self.engine.address)

    def offer(self, tid: str, ids: tuple[int, ...]) -> None:
        self.engine.offer(tid, len(ids), self.whole.source(tid, ids), 10,
                          slicer=lambda heads, layers: self.slices.get(heads, layers).source(tid, ids))

    def pull(self, tid: str, peers: list[Address], rank: int, tp: int, prefill_tp: int,
             ids: tuple[int, ...]) -> None:
        keys = []
        for part in plan_pulls(rank, tp, prefill_tp, TOTAL_HEADS):
            key = f"{tid}@{part.prefill_rank}"
            access = self.slices.get(part.decode_heads)
            self.engine.pull(tid, peers[part.prefill_rank], 0, len(ids), access.sink(key, ids),
                             time.monotonic() + 5, None,
                             HeadSlice(heads=part.prefill_heads, block_bytes=access.digest.block_bytes,
                                       pullers=part.pullers, puller=rank, key=key))
            keys.append(key)
        for key in keys:
            result = self.engine.wait_pull(key, 10)
            assert result is not None and result.state is PullState.DONE, result


@pytest.fixture(params=["tcp", "shm"])
def transport(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def workers(transport: str) -> Iterator[list[Worker]]:
    made: list[Worker] = []
    yield made
    for w in made:
        w.engine.close()


def served(worker: Worker, tid: str, timeout_s: float = 5.0) -> bool:
    """The offer is served once the offerer has every puller's confirmation, which may trail the puller's result
    by a moment (shm: the copy confirmation is read on the offerer's own thread)."""
    deadline = time.monotonic() + timeout_s
    while worker.engine.offer_state(tid) is not OfferState.SERVED:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def heads(worker: Worker, ids: tuple[int, ...], first: int, end: int) -> torch.Tensor:
    return torch.stack([layer[list(ids), first:end] for layer in worker.layers])


def test_two_decode_ranks_pull_their_halves_from_one_prefill_rank(workers: list[Worker], transport: str) -> None:
    prefill = Worker(4, 1, transport)
    decode = [Worker(2, 2 + d, transport) for d in range(2)]
    workers += [prefill, *decode]
    src, dst = (0, 2, 3), (5, 1, 4)
    prefill.offer("t1", src)
    decode[0].pull("t1", [prefill.address], 0, 2, 1, dst)
    assert prefill.engine.offer_state("t1") is OfferState.SERVING  # one of its two pullers has pulled
    decode[1].pull("t1", [prefill.address], 1, 2, 1, dst)
    assert served(prefill, "t1")
    for d in range(2):
        assert torch.equal(heads(decode[d], dst, 0, 2), heads(prefill, src, 2 * d, 2 * d + 2))
    untouched = [b for b in range(BLOCKS) if b not in dst]
    assert not torch.equal(heads(decode[0], tuple(untouched), 0, 2), heads(prefill, tuple(untouched), 0, 2))


def test_one_decode_rank_gathers_its_heads_from_two_prefill_ranks(workers: list[Worker], transport: str) -> None:
    prefill = [Worker(2, 7 + p, transport) for p in range(2)]
    decode = Worker(4, 9, transport)
    workers += [*prefill, decode]
    src, dst = (1, 2), (4, 0)
    for p in prefill:
        p.offer("t2", src)
    decode.pull("t2", [p.address for p in prefill], 0, 1, 2, dst)
    assert torch.equal(heads(decode, dst, 0, 2), heads(prefill[0], src, 0, 2))
    assert torch.equal(heads(decode, dst, 2, 4), heads(prefill[1], src, 0, 2))
    assert all(served(p, "t2") for p in prefill)


def test_whole_blocks_of_other_heads_are_refused(workers: list[Worker], transport: str) -> None:
    prefill, decode = Worker(4, 11, transport), Worker(2, 12, transport)
    workers += [prefill, decode]
    # A push of whole blocks from a rank that holds other heads: refused, so the sender holds them for a pull.
    deadline = time.monotonic() + 5
    for layer in range(LAYERS):
        prefill.engine.push_layer("t3", decode.address, layer, 1, tuple(prefill.whole.kv.block_views(layer, [0])),
                                  deadline)
    out = prefill.engine.wait_outgoing("t3", 5)
    assert out is not None and out.state is OutState.REFUSED and out.reason == WhyPull.HEADS_DIFFER.value, out
    assert decode.engine.store.reason("t3") == WhyPull.HEADS_DIFFER.value
    # A pull of whole blocks from a rank that holds other heads: refused, not landed as the wrong bytes.
    prefill.offer("t4", (0,))
    before = heads(decode, (0,), 0, 2).clone()
    decode.engine.pull("t4", prefill.address, 0, 1, decode.whole.sink("t4", (0,)), time.monotonic() + 5)
    result = decode.engine.wait_pull("t4", 10)
    assert result is not None and result.state is PullState.FAILED and "tensor-parallel" in result.reason
    assert torch.equal(heads(decode, (0,), 0, 2), before)


def test_peers_of_other_models_are_still_refused() -> None:
    a = KvBlocks.from_tensors([cache(4, 1)], TOKENS, "test", TOTAL_HEADS).digest
    b = KvBlocks.from_tensors([cache(2, 1)], TOKENS, "test", TOTAL_HEADS).digest
    assert a.slices_with(b) and a.differences(b) == []
    unknown = KvBlocks.from_tensors([cache(2, 1)], TOKENS, "test").digest  # total heads not said: whole blocks
    assert not a.slices_with(unknown) and a.differences(unknown)
    other_model = KvBlocks.from_tensors([cache(2, 1)], TOKENS, "test", 8).digest
    assert a.differences(other_model)
    wider = KvBlocks.from_tensors([torch.zeros(BLOCKS, 2, TOKENS, 4 * DIM)], TOKENS, "test", TOTAL_HEADS).digest
    assert a.differences(wider)


def test_a_pull_of_no_heads_only_counts_toward_serving_the_offer(workers: list[Worker], transport: str) -> None:
    prefill, decode = Worker(4, 21, transport), Worker(4, 22, transport)
    workers += [prefill, decode]
    prefill.offer("t5", (1,))
    # Any empty range, as the plan's (0, 0).
    release = HeadSlice(heads=(3, 3), block_bytes=0, pullers=2, puller=1, key="t5@release")
    decode.engine.pull("t5", prefill.address, 0, 1, lambda *_: (), time.monotonic() + 5, None, release)
    result = decode.engine.wait_pull("t5@release", 10)
    assert result is not None and result.state is PullState.DONE and result.nbytes == 0, result
    assert prefill.engine.offer_state("t5") is OfferState.SERVING  # one of two pullers
    access = decode.slices.get((0, 2))
    # The other puller: two of the heads.
    part = HeadSlice(heads=(2, 4), block_bytes=access.digest.block_bytes, pullers=2, puller=0, key="t5@0")
    decode.engine.pull("t5", prefill.address, 0, 1, access.sink("t5@0", (2,)), time.monotonic() + 5, None, part)
    result = decode.engine.wait_pull("t5@0", 10)
    assert result is not None and result.state is PullState.DONE, result
    assert served(prefill, "t5")
    assert torch.equal(heads(decode, (2,), 0, 2), heads(prefill, (1,), 2, 4))
