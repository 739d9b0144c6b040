"""Hybrid KV caches (vLLM's hybrid KV cache manager): full-attention and sliding-window groups laid out by vLLM's own
grouping, config and allocation code on CPU tensors (the groups overlay one buffer, each with its own block ids).
The scheduler side hands each group's block ids to the workers for a prompt computed in chunks; a push moves the
full-attention blocks and the sliding window's, and nothing else lands; a load that needs a block the prefill
worker no longer held fails, reported by its request."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the caches are built by vLLM's own grouping and allocation code")

from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from p2pkv.bench.cluster import free_ports
from p2pkv.config import parse_connector_config
from p2pkv.params import Address, DecodeParams, PrefillParams
from p2pkv.vllm.groups import cache_groups, frees_soon, window_start
from p2pkv.vllm.metadata import LoadSpec, SaveSpec
from p2pkv.vllm.scheduler import SchedulerSide
from p2pkv.vllm.worker import WorkerSide
from tests.helpers.unit import Cached, Req, step
from tests.helpers.workers import LOCAL, push_once, settle, worker_side

BS, WINDOW, LAYERS, NUM_BLOCKS = 16, 32, 4, 24
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
FULL = NAMES[0::2]  # layers 0 and 2 full attention, 1 and 3 a sliding window of 32 tokens
ADJACENT = NAMES[:2]  # layers 0 and 1 full attention, 2 and 3 the window: each group's layers side by side


def hybrid_config(hybrid: bool = True, full_layers: list[str] = FULL) -> KVCacheConfig:
    """vLLM's groups and config for the model: one group per attention kind, overlaying one buffer; or, with the
    hybrid manager off (`--disable-hybrid-kv-cache-manager`), one group: the window layers as full attention."""
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    window = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16,
                               sliding_window=WINDOW)
    specs: dict[str, KVCacheSpec] = {n: full if n in full_layers else window for n in NAMES}
    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid
    groups = get_kv_cache_groups(vllm_config, specs)
    return get_kv_cache_config_from_groups(vllm_config, groups, full.page_size_bytes * LAYERS * NUM_BLOCKS)


def caches(config: KVCacheConfig, seed: int | None) -> dict[str, torch.Tensor]:
    kv = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC, kernel_block_sizes=[BS, BS])
    if seed is not None:
        raw = torch.empty(0, dtype=torch.uint8).set_(kv[NAMES[0]].untyped_storage())
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return kv


def block(kv: dict[str, torch.Tensor], name: str, block_id: int) -> torch.Tensor:
    return kv[name][block_id].view(torch.int16)


def test_vllms_groups_are_taken_and_layers_that_overlay_are_not_aliases() -> None:
    config = hybrid_config()
    groups = cache_groups(config)
    assert groups.kinds == ("full", f"window {WINDOW}") and groups.grouped
    kv = caches(config, None)
    assert kv[NAMES[0]].data_ptr() == kv[NAMES[1]].data_ptr(), "vLLM overlays the groups in one buffer"


def test_the_window_read_and_what_vllm_frees_follow_its_sliding_window_manager() -> None:
    """The first block the last prompt token's window reads (what the decode side holds), and whether the window
    moving on by up to two tokens as the request finishes frees a block from there: only then does the prefill
    step wait for its push."""
    assert [window_start(n, WINDOW, BS) for n in (20, 32, 47, 48, 80, 81)] == [0, 0, 0, 1, 3, 3]
    assert [frees_soon(n, WINDOW, BS) for n in (20, 46, 47, 48, 80, 94)] == [False, True, True, False, False, True]
    assert not frees_soon(80, 0, BS), "full attention frees nothing"
    retained = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16,
                                 sliding_window=WINDOW, extra_retained_tokens=3)
    groups = cache_groups(KVCacheConfig(num_blocks=4, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(NAMES, retained)]))
    assert groups.kinds == (f"window {WINDOW}+3",) and groups.windows == (WINDOW + 3,)


def test_kv_that_would_be_pulled_is_computed_here_and_counted() -> None:
    """A prefill instance of another tensor-parallel size: its KV would be pulled by heads, which p2pkv does not do
    for a grouped cache yet. The decode request loads nothing, and is counted as computed here."""
    side = SchedulerSide(parse_connector_config("kv_consumer", 21001, "recompute", {"kv_host": LOCAL}), BS,
                         groups=cache_groups(hybrid_config()))
    req = Req("cmpl-d-0-p", list(range(80)), DecodeParams("p", 80, Address(LOCAL, 22001), prefill_tp=2).to_dict())
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = side.build_connector_meta(step())
    assert meta.loads == [] and meta.computed_here == ["grouped_pull"]


@pytest.mark.parametrize(("n", "max_tokens", "settle"), [(80, 1, False), (94, 1, True), (80, 16, True)])
def test_a_prefill_step_waits_for_its_push_only_where_vllm_may_free_what_it_reads(n: int, max_tokens: int,
                                                                                  settle: bool) -> None:
    side = SchedulerSide(parse_connector_config("kv_producer", 21001, "recompute", {"kv_host": LOCAL}), BS,
                         groups=cache_groups(hybrid_config()))
    req = Req("cmpl-p-0-s", list(range(n)), PrefillParams("s", Address(LOCAL, 22001)).to_dict())
    req.max_tokens = max_tokens  # type: ignore[attr-defined]
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1], [2])), 0)
    blocks = -(-n // BS)
    ids = (list(range(10, 10 + blocks)), list(range(30, 30 + blocks)))
    (save,) = prompt_steps(side, req, [(n, ids)])
    assert save.settle is settle
    assert save.groups[1][: window_start(n, WINDOW, BS)] == (0,) * window_start(n, WINDOW, BS)


def prompt_steps(side: SchedulerSide, req: Req, chunks: list[tuple[int, tuple[list[int], list[int]]]]
                 ) -> list[SaveSpec]:
    """The prefill scheduler side over a prompt computed in chunks: (tokens, each group's new block ids) a step, as
    vLLM's hybrid manager gives them (the sliding window's blocks behind the window turned null, id 0)."""
    saves: list[SaveSpec] = []
    done = 0
    for i, (tokens, new_ids) in enumerate(chunks):
        if i == 0:
            new = SimpleNamespace(req_id=req.request_id, block_ids=new_ids, num_computed_tokens=0)
            meta = side.build_connector_meta(step([new], scheduled={req.request_id: tokens}))
        else:
            cached = Cached([req.request_id], [new_ids], set(), [done])
            meta = side.build_connector_meta(step(cached=cached, scheduled={req.request_id: tokens}))
        saves += meta.saves
        done += tokens
    return saves


@pytest.mark.parametrize("full_layers", [FULL, ADJACENT], ids=["alternating", "adjacent"])
def test_a_chunked_prompt_moves_each_groups_blocks_and_nothing_else(sides: list[WorkerSide], mode: str,
                                                                     full_layers: list[str]) -> None:
    """80 tokens (5 blocks) prefilled in chunks of 48 and 32: when the last chunk is scheduled, the prefill side's
    window group has let go of block 0 (its table says null); the decode side, which computes only the last
    token, holds the window's last blocks only. The full-attention layers' 5 blocks land; the window layers'
    blocks the decode side holds land; every other block of the decode cache stays as it was, and the prefill
    worker's host buffers (a GPU's cache) are all released."""
    config = hybrid_config(full_layers=full_layers)
    groups = cache_groups(config)
    assert groups.kinds == ("full", f"window {WINDOW}")
    swa = [n for n in NAMES if n not in full_layers]
    n = 80
    tokens = list(range(n))
    p_port, d_port = free_ports(2)
    prefill_side = SchedulerSide(parse_connector_config("kv_producer", p_port, "recompute", {"kv_host": LOCAL}), BS,
                                 groups=groups)
    req = Req("cmpl-p-0-h", tokens, PrefillParams("hy", Address(LOCAL, d_port)).to_dict())
    prefill_side.get_num_new_matched_tokens(req, 0)
    prefill_side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3], [4, 5, 6])), 0)
    # The second chunk: full attention gets blocks 7 and 8, the window group 9 and 10 (vLLM has freed its block 4
    # by then, which the new block ids do not say). The window of the last token reads blocks 3 and 4 only.
    saves = prompt_steps(prefill_side, req, [(48, ([1, 2, 3], [4, 5, 6])), (32, ([7, 8], [9, 10]))])
    (save,) = saves
    assert save.block_ids == (1, 2, 3, 7, 8) and save.groups == ((1, 2, 3, 7, 8), (0, 0, 0, 9, 10))

    decode_side = SchedulerSide(parse_connector_config("kv_consumer", d_port, "recompute", {"kv_host": LOCAL}), BS,
                                groups=groups)
    dreq = Req("cmpl-d-0-h", tokens, DecodeParams("hy", n, Address(LOCAL, p_port)).to_dict())
    assert decode_side.get_num_new_matched_tokens(dreq, 0) == (n - 1, True)
    # The decode side's window group: 79 tokens computed, the next token's window (32) reads tokens 48..79: vLLM
    # holds blocks 3 and 4 of it.
    decode_side.update_state_after_alloc(
        dreq, SimpleNamespace(get_block_ids=lambda: ([11, 12, 13, 14, 15], [0, 0, 0, 17, 18])), n - 1)
    (load,) = decode_side.build_connector_meta(step()).loads
    assert load.block_ids == (11, 12, 13, 14, 15) and load.groups == ((11, 12, 13, 14, 15), (0, 0, 0, 17, 18))

    p_kv, d_kv = caches(config, 7), caches(config, None)
    before = {name: d_kv[name].clone() for name in NAMES}
    prefill = worker_side("kv_producer", p_port, p_kv, BS, num_blocks=config.num_blocks, groups=groups)
    decode = worker_side("kv_consumer", d_port, d_kv, BS, num_blocks=config.num_blocks, groups=groups)
    sides += [prefill, decode]
    push_once(prefill, decode, save, load, NAMES)
    assert decode.take_failed_loads() == set() and decode.take_load_errors() == set()
    settle(prefill, save.req_id, sending=True)
    pool = prefill.engine.pool.stats() if prefill.engine.pool is not None else None
    assert pool is None or pool.bytes_in_use == 0, "a host buffer of the transfer was kept"

    # A full-attention layer and a window layer overlay each buffer, each group using its own blocks of it.
    moved = {(name, dst): src for name in full_layers
             for src, dst in zip((1, 2, 3, 7, 8), load.groups[0], strict=True)}
    moved |= {(name, dst): src for name in swa for src, dst in zip((9, 10), (17, 18), strict=True)}
    written = {(d_kv[name].storage_offset(), b) for name, b in moved}
    for name in NAMES:
        for b in range(config.num_blocks):
            if (name, b) in moved:
                assert torch.equal(block(d_kv, name, b), block(p_kv, name, moved[name, b])), (name, b)
            elif (d_kv[name].storage_offset(), b) not in written:
                assert torch.equal(block(d_kv, name, b), before[name][b].view(torch.int16)), (name, b)
    assert len(written) == 2 * 7, "5 full-attention and 2 window blocks in each buffer, nothing else"


def test_a_load_that_needs_a_block_the_prefill_no_longer_held_fails_by_its_request(sides: list[WorkerSide]) -> None:
    """The prefill side's window had moved on (its table: null up to block 3) while the decode side holds blocks
    from block 2: that block was never sent. The load fails, reported by request (block ids name no block in a
    cache of several groups), and nothing lands in the blocks."""
    config = hybrid_config()
    groups = cache_groups(config)
    p_port, d_port = free_ports(2)
    p_kv, d_kv = caches(config, 3), caches(config, None)
    prefill = worker_side("kv_producer", p_port, p_kv, BS, num_blocks=config.num_blocks, groups=groups)
    decode = worker_side("kv_consumer", d_port, d_kv, BS, num_blocks=config.num_blocks, groups=groups)
    sides += [prefill, decode]
    save = SaveSpec(req_id="p-req", transfer_id="late", peer=Address(LOCAL, d_port), block_ids=(1, 2, 3, 4, 5),
                    groups=((1, 2, 3, 4, 5), (0, 0, 0, 9, 10)))
    load = LoadSpec(req_id="d-req", transfer_id="late", first_block=0, block_ids=(11, 12, 13, 14, 15),
                    groups=((11, 12, 13, 14, 15), (0, 0, 16, 17, 18)))
    push_once(prefill, decode, save, load)
    assert decode.take_failed_loads() == {"d-req"} and decode.take_load_errors() == set()
    assert not any(d_kv[name].view(torch.int16).any() for name in NAMES), "nothing may land in a failed load"
    settle(prefill, "p-req", sending=True)


def test_peers_whose_groups_differ_are_refused_at_the_handshake(sides: list[WorkerSide]) -> None:
    """A decode instance run with the hybrid manager off (one group) and a prefill instance with it on hold the
    same bytes in other blocks: the push is refused, named, and the load fails."""
    config, off = hybrid_config(), hybrid_config(hybrid=False)
    assert not cache_groups(off).grouped
    p_port, d_port = free_ports(2)
    prefill = worker_side("kv_producer", p_port, caches(config, 1), BS, num_blocks=config.num_blocks,
                          groups=cache_groups(config))
    decode = worker_side("kv_consumer", d_port, caches(off, None), BS, num_blocks=off.num_blocks,
                         groups=cache_groups(off))
    sides += [prefill, decode]
    save = SaveSpec(req_id="p-req", transfer_id="other", peer=Address(LOCAL, d_port), block_ids=(1, 2),
                    groups=((1, 2), (3, 4)))
    load = LoadSpec(req_id="d-req", transfer_id="other", first_block=0, block_ids=(5, 6),
                    fallback_from=Address(LOCAL, p_port))
    push_once(prefill, decode, save, load)
    assert decode.take_load_errors() == {5, 6}
    refusal = decode.engine.refusal(Address(LOCAL, p_port))
    assert refusal is not None and "kv_groups: ours '', peer 'full:0,2|window 32:1,3'" in refusal, refusal
