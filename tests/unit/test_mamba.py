"""Mamba hybrids (vLLM's hybrid KV cache manager): full-attention and Mamba state groups laid out by vLLM's own
grouping, config and allocation code on CPU tensors (one page size for both; each group with its own block ids in
one buffer). The prefill side computes a prompt but its last token, in chunks; its push moves the full-attention
blocks and the one block of state, which lands in the decode request's state block, and nothing else lands."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the caches are built by vLLM's own grouping and allocation code")

from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from p2pkv.bench.cluster import free_ports
from p2pkv.config import parse_connector_config
from p2pkv.errors import UnsupportedCacheError
from p2pkv.params import Address, DecodeParams, PrefillParams, parse_transfer_params, prompt_digest
from p2pkv.vllm.groups import cache_groups, state_only
from p2pkv.vllm.metadata import LoadSpec, SaveSpec
from p2pkv.vllm.scheduler import SchedulerSide
from p2pkv.vllm.worker import WorkerSide
from tests.helpers.unit import Cached, Req, step
from tests.helpers.workers import LOCAL, push_once, settle, worker_side

BS, STATE_BS, LAYERS = 16, 256, 4
NAMES = [f"model.layers.{i}.self_attn.attn" if i % 2 else f"model.layers.{i}.mixer" for i in range(LAYERS)]
ATTN, MIXERS = NAMES[1::2], NAMES[0::2]  # layers 0 and 2 Mamba, 1 and 3 full attention
SHAPES = ((3, 24), (2, 4, 8))  # a conv state and an SSM state
STATE_KIND = "state mamba2 3x24 bfloat16, 2x4x8 float32"


def mamba(mode: str = "none", shapes: tuple[tuple[int, ...], ...] = SHAPES, spec_blocks: int = 0) -> MambaSpec:
    return MambaSpec(block_size=STATE_BS, shapes=shapes, dtypes=(torch.bfloat16, torch.float32),
                     mamba_cache_mode=mode, num_speculative_blocks=spec_blocks)


def hybrid_config(state: MambaSpec | None = None) -> KVCacheConfig:
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    specs: dict[str, KVCacheSpec] = {n: full if n in ATTN else (state or mamba()) for n in NAMES}
    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    groups = get_kv_cache_groups(vllm_config, specs)
    return get_kv_cache_config_from_groups(vllm_config, groups, full.page_size_bytes * LAYERS * 24)


def caches(config: KVCacheConfig, seed: int | None, kernel: int = BS) -> dict[str, torch.Tensor]:
    """`kernel`: the attention backend's block (FlashInfer's 16, 32 or 64 tokens under a larger vLLM block): vLLM's
    attention views then count kernel blocks."""
    sizes = [g.kv_cache_spec.block_size if isinstance(g.kv_cache_spec, MambaSpec) else kernel
             for g in config.kv_cache_groups]
    kv = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC, kernel_block_sizes=sizes)
    if seed is not None:
        raw = torch.empty(0, dtype=torch.uint8).set_(kv[NAMES[0]].untyped_storage())
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return kv


def page(kv: dict[str, torch.Tensor], name: str, block_id: int, page_bytes: int) -> torch.Tensor:
    """The bytes of one block of one layer: its whole page in the buffer the groups share."""
    t = kv[name]
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    start = t.storage_offset() * t.element_size() + block_id * page_bytes
    return raw[start : start + page_bytes]


class PrefillReq(Req):
    """A prefill request as vLLM's `Request` holds it: the prompt's tokens twice, their count, the answer's length."""

    def __init__(self, request_id: str, prompt: list[int], params: dict[str, object], max_tokens: int = 1) -> None:
        super().__init__(request_id, prompt, params)
        self._all_token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.max_tokens = max_tokens


def test_vllms_state_group_is_taken_and_told_apart_by_its_tensors() -> None:
    config = hybrid_config()
    groups = cache_groups(config)
    assert groups.kinds == (STATE_KIND, "full") and groups.states == (True, False) and groups.grouped
    other = cache_groups(hybrid_config(mamba(shapes=((3, 24), (2, 4, 16)))))
    assert other.factor != groups.factor and "2x4x16 float32" in other.kinds[0]


@pytest.mark.parametrize(("spec", "named"), [(mamba(mode="align"), "--no-enable-prefix-caching"),
                                             (mamba(spec_blocks=2), "speculative decoding")])
def test_states_p2pkv_cannot_move_are_refused_by_name(spec: MambaSpec, named: str) -> None:
    """Prefix caching keeps a state per block of the prompt (vLLM's `align` mode), speculative decoding a state per
    draft: refused at start-up, saying what to change."""
    with pytest.raises(UnsupportedCacheError, match=named):
        cache_groups(hybrid_config(spec))


def test_state_only_stands_the_state_block_in_the_last_place() -> None:
    assert state_only((9,), 5) == (0, 0, 0, 0, 9) and state_only((9,), 1) == (9,) and state_only((), 3) == ()


def test_a_prefill_request_computes_its_prompt_but_the_last_token_and_answers_for_the_whole() -> None:
    """The decode side computes the last prompt token from the state after the others: the prefill request's
    prompt is cut by one token (vLLM's request: its tokens, their count, one answer token) when it arrives, its
    save comes when the cut prompt completes, and its answer names the whole prompt, which the decode request
    carries."""
    side = SchedulerSide(parse_connector_config("kv_producer", 21001, "recompute", {"kv_host": LOCAL}), BS,
                         groups=cache_groups(hybrid_config()))
    prompt = list(range(100, 180))
    req = PrefillReq("cmpl-p-0-m", list(prompt), PrefillParams("m", Address(LOCAL, 22001)).to_dict(), max_tokens=3)
    side.on_new_request(req)
    assert req.prompt_token_ids == prompt[:-1] and req._all_token_ids == prompt[:-1]
    assert req.num_prompt_tokens == 79 and req.max_tokens == 1
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([9], [1, 2, 3])), 0)
    first = side.build_connector_meta(step([SimpleNamespace(req_id=req.request_id, block_ids=([9], [1, 2, 3]),
                                                            num_computed_tokens=0)],
                                           scheduled={req.request_id: 48}))
    assert first.saves == [], "the state is saved once, after the prompt's last chunk"
    last = side.build_connector_meta(step(cached=Cached([req.request_id], [([], [4, 5])], set(), [48]),
                                          scheduled={req.request_id: 31}))
    (save,) = last.saves
    assert save.groups == ((0, 0, 0, 0, 9), (1, 2, 3, 4, 5)) and save.block_ids == (1, 2, 3, 4, 5)
    assert not save.settle and save.prompt == prompt_digest(prompt)
    req.set_status("FINISHED_LENGTH_CAPPED")
    held, answer = side.request_finished(req, [1])
    assert held and answer is not None
    decode = parse_transfer_params(answer)
    assert isinstance(decode, DecodeParams)
    assert decode.num_prompt_tokens == 80 and decode.prompt == prompt_digest(prompt)


@pytest.mark.parametrize("kind", ["embeddings", "session", "prompt-logprobs"])
def test_a_prompt_that_cannot_be_cut_is_not_saved(kind: str) -> None:
    """Embeddings beside the token ids, a streaming-input session (its next input follows the prompt), prompt
    logprobs: cutting the last token would lose it, and a state after the whole prompt would take it in twice on
    the decode side. The prompt is left whole and nothing is saved or answered: the decode side computes it."""
    side = SchedulerSide(parse_connector_config("kv_producer", 21001, "recompute", {"kv_host": LOCAL}), BS,
                         groups=cache_groups(hybrid_config()))
    prompt = list(range(40))
    req = PrefillReq("cmpl-p-0-u", list(prompt), PrefillParams("u", Address(LOCAL, 22001)).to_dict())
    if kind == "embeddings":
        req.prompt_embeds = torch.zeros(40, 8)  # type: ignore[attr-defined]
    elif kind == "session":
        req.resumable = True  # type: ignore[attr-defined]
    else:
        req.get_skip_reading_prefix_cache = lambda: True  # type: ignore[attr-defined]
    side.on_new_request(req)
    assert req.prompt_token_ids == prompt and req.num_prompt_tokens == 40
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([9], [1, 2, 3])), 0)
    meta = side.build_connector_meta(step([SimpleNamespace(req_id=req.request_id, block_ids=([9], [1, 2, 3]),
                                                           num_computed_tokens=0)], scheduled={req.request_id: 40}))
    assert meta.saves == []
    assert side.request_finished(req, [1]) == (False, None)


@pytest.mark.parametrize("kernel", [BS, BS // 2], ids=["whole-blocks", "kernel-blocks"])
def test_a_chunked_prompt_moves_the_attention_blocks_and_the_state_and_nothing_else(sides: list[WorkerSide],
                                                                                     mode: str, kernel: int) -> None:
    """80 tokens: the prefill computes 79 (5 blocks, in chunks of 48 and 31) and the decode side loads them, the
    state into its request's state block. The attention layers' 5 blocks land, the Mamba layers' state page lands
    (the layer's own view of the state equal to the prefill's), every other page of the decode cache stays as it
    was, and the prefill worker's host buffers (a GPU's cache) are all released. Also where the attention
    backend splits each block into two kernel blocks."""
    config = hybrid_config()
    groups = cache_groups(config)
    page_bytes = config.kv_cache_groups[1].kv_cache_spec.page_size_bytes
    assert config.kv_cache_groups[0].kv_cache_spec.page_size_bytes == page_bytes
    prompt = list(range(80))
    p_port, d_port = free_ports(2)
    prefill_side = SchedulerSide(parse_connector_config("kv_producer", p_port, "recompute", {"kv_host": LOCAL}), BS,
                                 groups=groups)
    req = PrefillReq("cmpl-p-0-h", list(prompt), PrefillParams("hy", Address(LOCAL, d_port)).to_dict())
    prefill_side.on_new_request(req)
    prefill_side.get_num_new_matched_tokens(req, 0)
    prefill_side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([9], [1, 2, 3])), 0)
    new = SimpleNamespace(req_id=req.request_id, block_ids=([9], [1, 2, 3]), num_computed_tokens=0)
    prefill_side.build_connector_meta(step([new], scheduled={req.request_id: 48}))
    (save,) = prefill_side.build_connector_meta(step(cached=Cached([req.request_id], [([], [7, 8])], set(), [48]),
                                                     scheduled={req.request_id: 31})).saves
    req.set_status("FINISHED_LENGTH_CAPPED")
    answer = prefill_side.request_finished(req, [1])[1]
    assert answer is not None

    decode_side = SchedulerSide(parse_connector_config("kv_consumer", d_port, "recompute", {"kv_host": LOCAL}), BS,
                                groups=groups)
    dreq = Req("cmpl-d-0-h", list(prompt), answer)
    assert decode_side.get_num_new_matched_tokens(dreq, 0) == (79, True)
    decode_side.update_state_after_alloc(dreq, SimpleNamespace(get_block_ids=lambda: ([20], [11, 12, 13, 14, 15])),
                                         79)
    (load,) = decode_side.build_connector_meta(step()).loads
    assert load.groups == ((0, 0, 0, 0, 20), (11, 12, 13, 14, 15)) and load.block_ids == (11, 12, 13, 14, 15)

    p_kv, d_kv = caches(config, 7, kernel), caches(config, None, kernel)
    before = torch.empty(0, dtype=torch.uint8).set_(d_kv[NAMES[0]].untyped_storage()).clone()
    prefill = worker_side("kv_producer", p_port, p_kv, BS, num_blocks=config.num_blocks, groups=groups)
    decode = worker_side("kv_consumer", d_port, d_kv, BS, num_blocks=config.num_blocks, groups=groups)
    sides += [prefill, decode]
    # vLLM calls the layer hook for attention layers; the state goes with the step's end
    push_once(prefill, decode, save, load, ATTN)
    assert decode.take_failed_loads() == set() and decode.take_load_errors() == set()
    settle(prefill, save.req_id, sending=True)
    pool = prefill.engine.pool.stats() if prefill.engine.pool is not None else None
    assert pool is None or pool.bytes_in_use == 0, "a host buffer of the transfer was kept"

    moved = {(name, dst): src for name in ATTN for src, dst in zip((1, 2, 3, 7, 8), (11, 12, 13, 14, 15),
                                                                     strict=True)}
    moved |= {(name, 20): 9 for name in MIXERS}
    for name in MIXERS:
        assert torch.equal(d_kv[name][20], p_kv[name][9]), "the state, seen as the model sees it"
    after = torch.empty(0, dtype=torch.uint8).set_(d_kv[NAMES[0]].untyped_storage())
    written = torch.zeros_like(after, dtype=torch.bool)
    for (name, dst), src in moved.items():
        assert torch.equal(page(d_kv, name, dst, page_bytes), page(p_kv, name, src, page_bytes)), (name, dst)
        start = d_kv[name].storage_offset() * d_kv[name].element_size() + dst * page_bytes
        written[start : start + page_bytes] = True
    assert int(written.sum()) == page_bytes * (2 * 5 + 2), "5 attention pages and a state page per layer pair"
    assert torch.equal(after[~written], before[~written]), "a page outside the load was written"


def test_peers_whose_states_differ_are_refused_at_the_handshake(sides: list[WorkerSide]) -> None:
    """Another state shape (another model's mixer) over the same page size: the push is refused with both groups
    named, and the load fails by its request."""
    config, other = hybrid_config(), hybrid_config(mamba(shapes=((3, 24), (2, 4, 16))))
    p_port, d_port = free_ports(2)
    prefill = worker_side("kv_producer", p_port, caches(config, 1), BS, num_blocks=config.num_blocks,
                          groups=cache_groups(config))
    decode = worker_side("kv_consumer", d_port, caches(other, None), BS, num_blocks=other.num_blocks,
                         groups=cache_groups(other))
    sides += [prefill, decode]
    save = SaveSpec(req_id="p-req", transfer_id="other", peer=Address(LOCAL, d_port), block_ids=(1, 2),
                    groups=((0, 9), (1, 2)))
    load = LoadSpec(req_id="d-req", transfer_id="other", first_block=0, block_ids=(5, 6),
                    groups=((0, 20), (5, 6)), fallback_from=Address(LOCAL, p_port))
    push_once(prefill, decode, save, load)
    assert decode.take_failed_loads() == {"d-req"}
    refusal = decode.engine.refusal(Address(LOCAL, p_port))
    assert refusal is not None and "kv_groups" in refusal and "2x4x16 float32" in refusal, refusal
