"""KV whose bytes mean something else on the other side is refused at the hello, the difference named, never moved:
blocks whose dimensions lie in another physical order (vLLM lets `VLLM_KV_CACHE_LAYOUT` override the layout p2pkv
asks for), quantized caches of another format (fp8's e4m3 and e5m2 share one storage dtype), and context
parallelism, refused at start-up. Caches are built by vLLM's own allocation and view code (`allocate_kv_cache`) on
CPU tensors; where the bytes move, they are checked byte for byte."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="the caches and configs are vLLM's own")

from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from p2pkv.bench.cluster import free_ports
from p2pkv.engine.puller import PullState
from p2pkv.errors import UnsupportedCacheError
from p2pkv.params import Address
from p2pkv.tinymodel import write_tiny_model
from p2pkv.vllm.connector import P2pNcclConnector, check_context_parallel, check_kv_scales
from p2pkv.vllm.metadata import LoadSpec, P2pkvMetadata, SaveSpec
from p2pkv.vllm.model_factors import model_factors
from p2pkv.vllm.worker import WorkerSide
from tests.helpers.workers import LOCAL, offer_and_pull, push_and_load, settle, worker_side

LAYERS, BLOCKS, TOKENS, HEAD = 2, 6, 16, 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def vllm_caches(layout: KVCacheLayout, heads: int, seed: int | None, dtype: torch.dtype = torch.bfloat16,
                blocks: int = BLOCKS) -> dict[str, torch.Tensor]:
    """Every layer's view as vLLM gives it to a connector (one buffer for all layers, in `layout`, its strides as
    vLLM's cache config works them out); random bytes (`seed`) or zeros."""
    spec = FullAttentionSpec(block_size=TOKENS, num_kv_heads=heads, head_size=HEAD, dtype=dtype)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, blocks, LAYERS, layout)
    tensor = KVCacheTensor(size=spec.page_size_bytes * blocks * LAYERS, layers=NAMES, layer_stride=layer_stride,
                           block_stride=block_stride)
    config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[tensor],
                           kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    kv = allocate_kv_cache(config, torch.device("cpu"), layout)
    if seed is not None:
        raw = torch.empty(0, dtype=torch.uint8).set_(kv[NAMES[0]].untyped_storage())
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return kv


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Compared as bytes: random bfloat16 bytes hold NaNs, which never equal themselves as values."""
    return t.contiguous().view(torch.uint8)


def refused_pull(prefill: WorkerSide, decode: WorkerSide, p_port: int, tid: str) -> str:
    """GET between two workers that should refuse each other: the pull's reason; the load fails (vLLM recomputes)
    with nothing written into the decode side's blocks."""
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id=tid, peer=None, block_ids=(1, 3))]))
    prefill.wait_for_save()
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id=tid, first_block=0, block_ids=(2, 4),
                                              pull_from=Address(LOCAL, p_port))]))
    deadline = time.monotonic() + 10
    while (result := decode.engine.pull_result(tid)) is None or result.state is PullState.PENDING:
        assert time.monotonic() < deadline, "the pull did not settle"
        time.sleep(0.01)
    assert result.state is PullState.FAILED
    settle(decode, "d-req", sending=False)
    assert decode.take_load_errors() == {2, 4}
    return result.reason


@pytest.mark.parametrize("send", ["GET", "PUT"])
def test_blocks_of_another_physical_order_are_refused_naming_both(sides: list[WorkerSide], send: str) -> None:
    """LBHNC and LBNHC blocks are one run each, of one shape and size: moved as bytes, heads and tokens would be
    permuted. Both orders are named, and nothing is written."""
    p_port, d_port = free_ports(2)
    p_kv, d_kv = vllm_caches(KVCacheLayout.LBHNC, 2, 7), vllm_caches(KVCacheLayout.LBNHC, 2, None)
    prefill = worker_side("kv_producer", p_port, p_kv, TOKENS, num_blocks=BLOCKS)
    decode = worker_side("kv_consumer", d_port, d_kv, TOKENS, num_blocks=BLOCKS)
    sides += [prefill, decode]
    assert prefill.engine.layout.block_bytes == decode.engine.layout.block_bytes
    assert prefill.engine.layout.block_shape == decode.engine.layout.block_shape
    if send == "GET":
        reason = refused_pull(prefill, decode, p_port, "o1")
        assert "block_order: ours HNC" in reason and "peer NHC" in reason, reason  # the prefill side's words
    else:
        decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="o2", first_block=0, block_ids=(2, 4),
                                                  fallback_from=Address(LOCAL, p_port))]))
        prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="o2", peer=Address(LOCAL, d_port),
                                                   block_ids=(1, 3))]))
        for name in NAMES:
            prefill.save_layer(name)
        prefill.wait_for_save()
        settle(decode, "d-req", sending=False, also=[prefill])
        assert decode.take_load_errors() == {2, 4}
        reason = decode.engine.refusal(Address(LOCAL, p_port)) or ""
        assert "block_order: ours NHC (tokens outside heads" in reason and "peer HNC (heads outside" in reason, reason
    assert not any(t.view(torch.uint8).any() for t in d_kv.values()), "nothing was written"


@pytest.mark.parametrize("decode_layout", [KVCacheLayout.LHBNC, KVCacheLayout.LBHNC])
def test_blocks_of_one_order_move_byte_for_byte_whatever_their_runs(sides: list[WorkerSide],
                                                                   decode_layout: KVCacheLayout) -> None:
    """LHBNC: one run per head, placed by the block count. A peer with another block count (other GPU memory), or
    whose blocks are one run (LBHNC), holds the same bytes in the same order: the order is compared, not where
    the runs lie."""
    p_port, d_port = free_ports(2)
    more = BLOCKS + 3
    p_kv, d_kv = vllm_caches(KVCacheLayout.LHBNC, 2, 3), vllm_caches(decode_layout, 2, None, blocks=more)
    prefill = worker_side("kv_producer", p_port, p_kv, TOKENS, num_blocks=BLOCKS)
    decode = worker_side("kv_consumer", d_port, d_kv, TOKENS, num_blocks=more)
    sides += [prefill, decode]
    offer_and_pull(prefill, decode, "o3", (1, 3), (7, 0), p_port)
    for name in NAMES:
        assert torch.equal(as_bytes(d_kv[name][[7, 0]]), as_bytes(p_kv[name][[1, 3]]))


def test_one_head_slices_move_between_orders_and_wider_slices_are_refused(sides: list[WorkerSide]) -> None:
    """Between tensor-parallel sizes blocks move as head slices: a slice of one head is the same bytes in either
    order (tokens, then elements), so TP 2 decode ranks of one head each load a TP 1 prefill rank's LBNHC blocks
    byte for byte; slices of two heads from another order are refused."""
    p_port, d_port, w_port = free_ports(3, run=2)
    p_kv = vllm_caches(KVCacheLayout.LBNHC, 2, 11)
    prefill = worker_side("kv_producer", p_port, p_kv, TOKENS, num_blocks=BLOCKS, total_heads=2)
    d_kv = [vllm_caches(KVCacheLayout.LBHNC, 1, None) for _ in range(2)]
    decode = [worker_side("kv_consumer", d_port, d_kv[r], TOKENS, rank=r, tp_size=2, total_heads=2,
                          num_blocks=BLOCKS) for r in range(2)]
    sides += [prefill, *decode]
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="o4", peer=None, block_ids=(5, 2))]))
    prefill.wait_for_save()
    load = LoadSpec(req_id="d-req", transfer_id="o4", first_block=0, block_ids=(0, 3),
                    pull_from=Address(LOCAL, p_port), prefill_tp=1)
    for d in decode:
        d.bind(P2pkvMetadata(loads=[load]))
    for r, d in enumerate(decode):
        settle(d, "d-req", sending=False)
        assert d.take_load_errors() == set()
        for name in NAMES:
            assert torch.equal(as_bytes(d_kv[r][name][[0, 3]]), as_bytes(p_kv[name][[5, 2], r : r + 1]))
    wide = worker_side("kv_consumer", w_port, vllm_caches(KVCacheLayout.LBHNC, 2, None), TOKENS, tp_size=2,
                       total_heads=4, num_blocks=BLOCKS)
    four = worker_side("kv_producer", free_ports(1)[0], vllm_caches(KVCacheLayout.LBNHC, 4, 5), TOKENS,
                       total_heads=4, num_blocks=BLOCKS)
    sides += [wide, four]
    four.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="o5", peer=None, block_ids=(1,))]))
    four.wait_for_save()
    wide.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="o5", first_block=0, block_ids=(2,),
                                            pull_from=Address(LOCAL, four.engine.settings.port), prefill_tp=1)]))
    settle(wide, "d-req", sending=False)
    assert wide.take_load_errors() == {2}
    assert "block_order: ours NHC" in (four.engine.refusal(Address(LOCAL, w_port)) or "")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def factors(tiny: Path, cache_dtype: str) -> str:
    return model_factors(VllmConfig(model_config=ModelConfig(model=str(tiny)),
                                    cache_config=CacheConfig(cache_dtype=cache_dtype)))  # type: ignore[arg-type]


def test_fp8_caches_of_another_format_are_refused_by_name(sides: list[WorkerSide], tiny: Path) -> None:
    """fp8, fp8_e4m3 and fp8_e5m2 caches are all uint8, of one size: the format is compared, by name. vLLM's fp8 is
    e4m3, so those two move (byte for byte)."""
    assert "kv_cache_dtype" not in factors(tiny, "auto")
    e4m3, e5m2, fp8 = factors(tiny, "fp8_e4m3"), factors(tiny, "fp8_e5m2"), factors(tiny, "fp8")
    p_port, d_port, q_port = free_ports(3)
    p_kv = vllm_caches(KVCacheLayout.LBHNC, 2, 13, torch.uint8)
    prefill = worker_side("kv_producer", p_port, p_kv, TOKENS, num_blocks=BLOCKS, model=e4m3)
    other = worker_side("kv_consumer", d_port, vllm_caches(KVCacheLayout.LBHNC, 2, None, torch.uint8), TOKENS,
                        num_blocks=BLOCKS, model=e5m2)
    sides += [prefill, other]
    reason = refused_pull(prefill, other, p_port, "f1")
    assert "model.kv_cache_dtype: ours fp8_e4m3, peer fp8_e5m2" in reason, reason
    d_kv = vllm_caches(KVCacheLayout.LBHNC, 2, None, torch.uint8)
    same = worker_side("kv_consumer", q_port, d_kv, TOKENS, num_blocks=BLOCKS, model=fp8)
    sides.append(same)
    push_and_load(prefill, same, "f2", (0, 5), (1, 2), NAMES, p_port, q_port)
    for name in NAMES:
        assert torch.equal(d_kv[name][[1, 2]], p_kv[name][[0, 5]])


def test_context_parallelism_is_refused_at_start_up_naming_the_flag(tiny: Path) -> None:
    """A context-parallel instance's block holds block_size x CP tokens interleaved across ranks: p2pkv would load
    a prompt's first tokens into blocks meant for more, and never send the rest."""
    transfer = KVTransferConfig(kv_connector="P2pNcclConnector", kv_connector_module_path="p2pkv.vllm",
                                kv_role="kv_both")
    dcp = VllmConfig(model_config=ModelConfig(model=str(tiny)), kv_transfer_config=transfer,
                     parallel_config=ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=2))
    with pytest.raises(UnsupportedCacheError, match=r"--decode-context-parallel-size 2"):
        P2pNcclConnector(dcp, KVConnectorRole.SCHEDULER, None)  # type: ignore[arg-type]
    pcp: Any = SimpleNamespace(parallel_config=ParallelConfig(prefill_context_parallel_size=2))
    with pytest.raises(UnsupportedCacheError, match=r"--prefill-context-parallel-size 2"):
        check_context_parallel(pcp)
    check_context_parallel(SimpleNamespace(parallel_config=ParallelConfig()))  # type: ignore[arg-type]


def test_kv_scales_computed_by_each_instance_are_refused_at_start_up() -> None:
    """vLLM versions with `--calculate-kv-scales` take a quantized cache's scales from each instance's first batch."""
    calculated: Any = SimpleNamespace(cache_config=SimpleNamespace(calculate_kv_scales=True, cache_dtype="fp8"))
    with pytest.raises(UnsupportedCacheError, match=r"--calculate-kv-scales with --kv-cache-dtype fp8"):
        check_kv_scales(calculated)
    check_kv_scales(SimpleNamespace(cache_config=SimpleNamespace(calculate_kv_scales=True,  # type: ignore[arg-type]
                                                                 cache_dtype="auto")))
