"""KV caches whose vLLM blocks are split into smaller kernel blocks (FlashMLA's 64, CUTLASS MLA's 128, FlashInfer
with a large `--block-size`), built by vLLM's own allocation and view code (`allocate_kv_cache`) on CPU tensors:
a transfer between two worker sides moves each whole vLLM block byte for byte, pushed or pulled, in host memory
or handled as a GPU's; peers whose blocks split differently are refused at the handshake, the difference named."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm", reason="the caches are built by vLLM's own allocation code")

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    group_kernel_blocks,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from p2pkv.bench.cluster import free_ports
from p2pkv.engine.puller import PullState
from p2pkv.kv.layout import KvBlocks
from p2pkv.params import Address
from p2pkv.vllm.metadata import LoadSpec, P2pkvMetadata, SaveSpec
from p2pkv.vllm.worker import WorkerSide
from tests.helpers.workers import LOCAL, offer_and_pull, push_and_load, settle, worker_side

LAYERS, BLOCKS, HEADS, HEAD = 3, 6, 2, 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def vllm_caches(block: int, kernel: int, layout: KVCacheLayout, seed: int | None) -> dict[str, torch.Tensor]:
    """Every layer's view as vLLM gives it to a connector: one buffer for all layers, kernel blocks on dim 0;
    random bytes (`seed`) or zeros."""
    spec = FullAttentionSpec(block_size=block, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=page * BLOCKS * LAYERS, layers=NAMES, layer_stride=page * BLOCKS, block_stride=page)
    config = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[tensor],
                           kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    kv = allocate_kv_cache(config, torch.device("cpu"), layout, kernel_block_sizes=[kernel])
    if seed is not None:
        raw = torch.empty(0, dtype=torch.uint8).set_(kv[NAMES[0]].untyped_storage())
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return kv


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bytes equal (random bfloat16 bytes hold NaNs, which never equal themselves as values)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize(("block", "kernel"), [(64, 16), (128, 64), (64, 64)])
@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC])
@pytest.mark.parametrize("send", ["GET", "PUT"])
def test_whole_vllm_blocks_move_byte_for_byte(sides: list[WorkerSide], mode: str, block: int, kernel: int,
                                              layout: KVCacheLayout, send: str) -> None:
    p_kv, d_kv = vllm_caches(block, kernel, layout, 7), vllm_caches(block, kernel, layout, None)
    ratio = block // kernel
    assert p_kv[NAMES[0]].shape[0] == BLOCKS * ratio, "vLLM's views count kernel blocks"
    if ratio > 1:
        # Read as vLLM hands them over, a block id would address one kernel block: a fraction of the block.
        assert KvBlocks.from_tensors(list(p_kv.values()), block, "t").block_bytes * ratio == \
            group_kernel_blocks(p_kv[NAMES[0]], BLOCKS)[0].numel() * 2
    p_port, d_port = free_ports(2)
    prefill = worker_side("kv_producer", p_port, p_kv, block, num_blocks=BLOCKS)
    decode = worker_side("kv_consumer", d_port, d_kv, block, num_blocks=BLOCKS)
    sides += [prefill, decode]
    assert prefill.engine.layout.kernel_blocks == ratio
    src, dst = (4, 1), (2, 5)
    if send == "GET":
        offer_and_pull(prefill, decode, "t1", src, dst, p_port)
    else:
        push_and_load(prefill, decode, "t1", src, dst, NAMES, p_port, d_port)
    for name in NAMES:
        theirs, ours = group_kernel_blocks(p_kv[name], BLOCKS), group_kernel_blocks(d_kv[name], BLOCKS)
        for s, d in zip(src, dst, strict=True):
            assert same(ours[d], theirs[s]), (name, s, d)
        untouched = [b for b in range(BLOCKS) if b not in dst]
        assert not ours[untouched].any(), "nothing else was written"


def test_without_the_block_count_the_split_is_told_from_the_views(sides: list[WorkerSide]) -> None:
    """A vLLM that passes no KV cache config: the kernel blocks per block are told from the views' token
    dimension, a fraction of the block size."""
    p_port, d_port = free_ports(2)
    p_kv, d_kv = vllm_caches(64, 16, KVCacheLayout.LBHNC, 3), vllm_caches(64, 16, KVCacheLayout.LBHNC, None)
    prefill = worker_side("kv_producer", p_port, p_kv, 64)
    decode = worker_side("kv_consumer", d_port, d_kv, 64)
    sides += [prefill, decode]
    assert prefill.engine.layout.kernel_blocks == 4
    offer_and_pull(prefill, decode, "t2", (3,), (0,), p_port)
    assert same(group_kernel_blocks(d_kv[NAMES[1]], BLOCKS)[0], group_kernel_blocks(p_kv[NAMES[1]], BLOCKS)[3])


def test_peers_whose_blocks_split_differently_are_refused_at_the_handshake(sides: list[WorkerSide]) -> None:
    """One backend splits 64-token blocks into 16-token kernel blocks, the other does not: the same bytes per
    block, laid out differently. The pull is refused at the hello, the message names the difference, and the load
    fails (vLLM recomputes) rather than landing the wrong KV."""
    p_port, d_port = free_ports(2)
    prefill = worker_side("kv_producer", p_port, vllm_caches(64, 16, KVCacheLayout.LBHNC, 5), 64,
                          num_blocks=BLOCKS)
    decode = worker_side("kv_consumer", d_port, vllm_caches(64, 64, KVCacheLayout.LBHNC, None), 64,
                         num_blocks=BLOCKS)
    sides += [prefill, decode]
    assert prefill.engine.layout.block_bytes == decode.engine.layout.block_bytes
    prefill.bind(P2pkvMetadata(saves=[SaveSpec(req_id="p-req", transfer_id="t3", peer=None, block_ids=(1,))]))
    prefill.wait_for_save()
    decode.bind(P2pkvMetadata(loads=[LoadSpec(req_id="d-req", transfer_id="t3", first_block=0, block_ids=(2,),
                                              pull_from=Address(LOCAL, p_port))]))
    deadline = time.monotonic() + 10
    while (result := decode.engine.pull_result("t3")) is None or result.state is PullState.PENDING:
        assert time.monotonic() < deadline, "the pull did not settle"
        time.sleep(0.01)
    assert result.state is PullState.FAILED
    assert "kernel_blocks: ours 4, peer 1" in result.reason, result.reason  # as the prefill side said it
    settle(decode, "d-req", sending=False)
    assert decode.take_load_errors() == {2}
