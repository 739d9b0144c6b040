"""Which KV caches the connector takes, as vLLM builds them: the layout it asks vLLM for (through vLLM's own layout
selection), layers that share one cache (vLLM's KV sharing) moved once, and caches it cannot move refused at
start-up with one error that names the layer and what is unsupported."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM's own config, layout selection and cache specs")

from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    HiSparseHotSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from p2pkv.bench.cluster import free_ports
from p2pkv.config import parse_connector_config
from p2pkv.errors import UnsupportedCacheError
from p2pkv.tinymodel import write_tiny_model
from p2pkv.vllm.connector import P2pNcclConnector, check_batching, check_grouped
from p2pkv.vllm.groups import cache_groups
from p2pkv.vllm.worker import WorkerSide
from tests.helpers.workers import offer_and_pull, push_and_load, worker_side

FLASH_ATTENTION_LAYOUTS = ["LBNHC", "LBHNC"]  # what FlashAttention supports, its own preference first


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def vllm_config(model: Path, connector: bool) -> VllmConfig:
    transfer = KVTransferConfig(kv_connector="P2pNcclConnector", kv_connector_module_path="p2pkv.vllm",
                                kv_role="kv_both") if connector else None
    return VllmConfig(model_config=ModelConfig(model=str(model)), kv_transfer_config=transfer)


def test_vllms_layout_selection_takes_the_layout_the_connector_asks_for(tiny: Path) -> None:
    """Heads outside tokens: a slice of heads (instances of different TP sizes) is one run per block."""
    assert resolve_kv_cache_layout(vllm_config(tiny, True), [FLASH_ATTENTION_LAYOUTS]) is KVCacheLayout.LBHNC
    # Without the connector vLLM keeps the backend's own first choice, where a slice is one run per token.
    assert resolve_kv_cache_layout(vllm_config(tiny, False), [FLASH_ATTENTION_LAYOUTS]) is KVCacheLayout.LBNHC
    # A backend without that layout keeps its own (vLLM warns).
    assert resolve_kv_cache_layout(vllm_config(tiny, True), [["LBNHC"]]) is KVCacheLayout.LBNHC


def test_mla_models_leave_the_layout_to_vllm() -> None:
    """MLA's one latent head has nothing to slice."""
    mla: Any = SimpleNamespace(model_config=SimpleNamespace(use_mla=True))
    assert P2pNcclConnector.get_required_kvcache_layout(mla) is None
    mha: Any = SimpleNamespace(model_config=SimpleNamespace(use_mla=False))
    assert P2pNcclConnector.get_required_kvcache_layout(mha) == "LBHNC"


def shared_caches(seed: int | None) -> dict[str, torch.Tensor]:
    """Four layers, the last two reusing the caches of the first two (vLLM's KV sharing gives both names one
    tensor)."""
    g = torch.Generator().manual_seed(seed or 0)
    own = [torch.rand(6, 2, 16, 16, generator=g) if seed is not None else torch.zeros(6, 2, 16, 16)
           for _ in range(2)]
    return {f"model.layers.{i}.self_attn.attn": own[i % 2] for i in range(4)}


@pytest.mark.parametrize("send", ["GET", "PUT"])
def test_layers_that_share_a_cache_move_it_once(sides: list[WorkerSide], send: str) -> None:
    p_kv, d_kv = shared_caches(1), shared_caches(None)
    p_port, d_port = free_ports(2)
    prefill = worker_side("kv_producer", p_port, p_kv, 16, total_layers=4)
    decode = worker_side("kv_consumer", d_port, d_kv, 16, total_layers=4)
    sides += [prefill, decode]
    assert prefill.engine.layout.num_layers == 2
    if send == "GET":
        offer_and_pull(prefill, decode, "s1", (1, 4), (0, 3), p_port)
    else:
        push_and_load(prefill, decode, "s1", (1, 4), (0, 3), list(p_kv), p_port, d_port)
    for name in p_kv:
        assert torch.equal(d_kv[name][[0, 3]], p_kv[name][[1, 4]])
    moved = prefill.engine.metrics.registry.get_sample_value("p2pkv_bytes_sent_total", {"transport": "tcp"}) or \
        prefill.engine.metrics.registry.get_sample_value("p2pkv_bytes_sent_total", {"transport": "shm"})
    assert moved == 2 * 2 * p_kv["model.layers.0.self_attn.attn"][0].nbytes, "each shared cache once"


def test_a_raw_buffer_is_refused_naming_the_layer() -> None:
    """A layer vLLM hands over as its raw backing bytes (a cache the model lays out itself)."""
    kv = {"model.layers.0.self_attn.attn": torch.zeros(6, 2, 16, 16),
          "model.layers.1.mixer": torch.zeros(4096, dtype=torch.int8)}
    with pytest.raises(UnsupportedCacheError, match=r"model\.layers\.1\.mixer.*not a \[blocks, heads"):
        worker_side("kv_producer", free_ports(1)[0], kv, 16)


def test_layers_of_different_page_sizes_are_refused_naming_the_layer() -> None:
    kv = {"model.layers.0.self_attn.attn": torch.zeros(6, 2, 16, 16),
          "model.layers.1.self_attn.attn": torch.zeros(6, 4, 16, 16)}
    with pytest.raises(UnsupportedCacheError, match=r"model\.layers\.1\.self_attn\.attn .*different KV page sizes"):
        worker_side("kv_producer", free_ports(1)[0], kv, 16)


def _config(*groups: KVCacheGroupSpec) -> KVCacheConfig:
    names = [n for g in groups for n in g.layer_names]
    return KVCacheConfig(num_blocks=4, kv_cache_tensors=[KVCacheTensor(size=1 << 16, layers=names, layer_stride=1,
                                                                       block_stride=1)],
                         kv_cache_groups=list(groups))


def test_full_attention_and_sliding_window_groups_are_described_and_other_groups_refused() -> None:
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16, sliding_window=64)
    hybrid = cache_groups(_config(KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"],
                                                   full),
                                  KVCacheGroupSpec(["model.layers.1.self_attn.attn"], window)))
    assert hybrid.grouped and hybrid.kinds == ("full", "window 64")
    assert hybrid.of_layer["model.layers.1.self_attn.attn"] == 1
    assert hybrid.factor == "full:0,2|window 64:1"  # what peers compare at the hello
    alone = cache_groups(_config(KVCacheGroupSpec(["model.layers.0.self_attn.attn"], window)))
    assert alone.grouped, "a sliding window alone has null blocks in its tables"
    one = cache_groups(_config(KVCacheGroupSpec(["model.layers.0.self_attn.attn"], full)))
    assert not one.grouped and one.factor == ""
    local = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16,
                                      attention_chunk_size=64)
    with pytest.raises(UnsupportedCacheError, match=r"model\.layers\.1\.self_attn\.attn: a ChunkedLocalAttentionSpec"):
        cache_groups(_config(KVCacheGroupSpec(["model.layers.0.self_attn.attn"], full),
                             KVCacheGroupSpec(["model.layers.1.self_attn.attn"], local)))
    coarse = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedCacheError, match=r"different block sizes \(\[16, 32\] tokens\)"):
        cache_groups(_config(KVCacheGroupSpec(["model.layers.0.self_attn.attn"], coarse),
                             KVCacheGroupSpec(["model.layers.1.self_attn.attn"], window)))


def test_a_group_of_state_that_is_neither_attention_kv_nor_mambas_is_refused() -> None:
    hot = HiSparseHotSpec(block_size=16, page_size=1024, blocks_per_request=2)
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedCacheError, match=r"model\.layers\.0\.hot: its cache is a HiSparseHotSpec, "
                                                    r"neither attention KV nor one Mamba state"):
        cache_groups(_config(KVCacheGroupSpec(["model.layers.1.self_attn.attn"], full),
                             KVCacheGroupSpec(["model.layers.0.hot"], hot)))


def test_pulls_of_a_grouped_cache_are_refused_at_start_up() -> None:
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16, sliding_window=64)
    groups = cache_groups(_config(KVCacheGroupSpec(["model.layers.0.self_attn.attn"], window)))
    get = parse_connector_config("kv_consumer", 14579, "recompute", {"send_type": "GET"}, "")
    with pytest.raises(UnsupportedCacheError, match=r"send_type GET with a KV cache of 1 groups \(window 64\)"):
        check_grouped(groups, get, cast(Any, None))
    check_grouped(groups, parse_connector_config("kv_consumer", 14579, "recompute", {}, ""), cast(Any, None))


def test_micro_batching_is_refused_at_start_up() -> None:
    """vLLM's dual-batch overlap runs each micro-batch's layer hooks on a thread and stream of its own."""
    dbo: Any = SimpleNamespace(parallel_config=SimpleNamespace(use_ubatching=True))
    with pytest.raises(UnsupportedCacheError, match="micro-batching"):
        check_batching(dbo)
    check_batching(SimpleNamespace(parallel_config=SimpleNamespace(use_ubatching=False)))  # type: ignore[arg-type]
