"""Every KV layout vLLM 0.29+ can give a connector, built the way vLLM builds it (one flat buffer, per-layer
`[B, H, N, C]` views through `as_strided` in a physical order), checked byte for byte on CPU tensors: blocks
copied from one cache to another with the same layout land exactly, nothing else is touched."""

from __future__ import annotations

import pytest
import torch

from p2pkv.kv.layout import KvBlocks
from tests.helpers.unit import PHYSICAL_ORDERS, views

L, B, H, N, C = 3, 12, 4, 16, 8  # layers, blocks, KV heads, tokens per block, K+V elements per token


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("order", [*PHYSICAL_ORDERS, "MLA"])
def test_blocks_move_byte_for_byte(order: str, dtype: torch.dtype) -> None:
    sizes = {"L": L, "B": B, "H": 1 if order == "MLA" else H, "N": N, "C": 24 if order == "MLA" else C}
    physical = "LBHNC" if order == "MLA" else order
    src_layers, dst_layers = views(physical, dtype, sizes, True), views(physical, dtype, sizes, False)
    src, dst = KvBlocks.from_tensors(src_layers, N, "test"), KvBlocks.from_tensors(dst_layers, N, "test")
    assert src.digest == dst.digest
    assert src.block_bytes == sizes["H"] * N * sizes["C"] * src_layers[0].element_size()
    moves = {3: 1, 4: 2, 5: 7, 9: 8}
    for layer in range(L):
        payload = b"".join(bytes(v) for v in src.block_views(layer, list(moves)))
        assert len(payload) == len(moves) * src.block_bytes
        dst.write_blocks(layer, list(moves.values()), memoryview(payload))
    for layer in range(L):
        for b in range(B):
            source = [s for s, d in moves.items() if d == b]
            if source:
                assert torch.equal(dst_layers[layer][b], src_layers[layer][source[0]]), (order, layer, b)
            else:
                assert torch.count_nonzero(dst_layers[layer][b]) == 0, (order, layer, b)


def test_consecutive_blocks_coalesce_where_the_layout_allows() -> None:
    sizes = {"L": L, "B": B, "H": H, "N": N, "C": C}
    block_major = KvBlocks.from_tensors(views("LBNHC", torch.bfloat16, sizes, False), N, "test")
    assert len(block_major.block_views(0, [3, 4, 5])) == 1  # one copy for three blocks
    assert block_major.digest.block_order == "NHC"
    head_major = KvBlocks.from_tensors(views("LHBNC", torch.bfloat16, sizes, False), N, "test")
    assert len(head_major.block_views(0, [3])) == H  # one run per head
    assert head_major.digest.block_order == "HNC"
    layers_inside = KvBlocks.from_tensors(views("BLHNC", torch.bfloat16, sizes, False), N, "test")
    assert len(layers_inside.block_views(1, [3, 4])) == 2  # the other layers lie between two blocks
    # Peers whose blocks hold their dimensions in another order are told so at the handshake; where only the runs
    # differ (heads inside or outside the blocks), the bytes mean the same and move.
    assert block_major.digest.differences(head_major.digest) == [
        "block_order: ours NHC (tokens outside heads: LBNHC, BLNHC), peer HNC (heads outside tokens: LBHNC, BLHNC, "
        "LHBNC, BHLNC)"]
    assert KvBlocks.from_tensors(views("LBHNC", torch.bfloat16, sizes, False), N, "test").digest.differences(
        head_major.digest) == []
