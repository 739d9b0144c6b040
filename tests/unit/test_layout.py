import numpy as np
import pytest
import torch

from p2pkv.errors import IncompatiblePeerError
from p2pkv.kv.layout import KvBlocks, runs


def test_runs_coalesce_consecutive_blocks() -> None:
    assert runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    assert runs([]) == []


def _cache(num_blocks: int = 10, shape: tuple[int, ...] = (2, 16, 8)) -> torch.Tensor:
    return torch.randn(num_blocks, *shape, dtype=torch.float32)


def test_block_views_are_the_blocks_bytes() -> None:
    layers = [_cache(), _cache()]
    kv = KvBlocks.from_tensors(layers, 16, "test")
    assert kv.block_bytes == 2 * 16 * 8 * 4
    views = kv.block_views(1, [2, 3, 7])
    assert len(views) == 2  # [2, 3] coalesced, [7] alone
    joined = b"".join(bytes(v) for v in views)
    expected = b"".join(layers[1][b].numpy().tobytes() for b in (2, 3, 7))
    assert joined == expected


def test_write_blocks_lands_bytes_in_place() -> None:
    src_layers = [_cache()]
    dst_layers = [torch.zeros(10, 2, 16, 8)]
    src = KvBlocks.from_tensors(src_layers, 16, "test")
    dst = KvBlocks.from_tensors(dst_layers, 16, "test")
    payload = b"".join(bytes(v) for v in src.block_views(0, [1, 2, 5]))
    dst.write_blocks(0, [7, 8, 0], memoryview(payload))
    assert torch.equal(dst_layers[0][7], src_layers[0][1])
    assert torch.equal(dst_layers[0][8], src_layers[0][2])
    assert torch.equal(dst_layers[0][0], src_layers[0][5])
    assert torch.count_nonzero(dst_layers[0][1:7]) == 0


def test_strided_layers_sharing_one_buffer() -> None:
    # Block-major layout (blocks outermost, layers inside): each layer is a strided view, blocks stay contiguous.
    buffer = torch.arange(6 * 2 * 64, dtype=torch.float32).reshape(6, 2, 64)
    layers = [buffer[:, 0].view(6, 2, 32), buffer[:, 1].view(6, 2, 32)]
    kv = KvBlocks.from_tensors(layers, 16, "test")
    views = kv.block_views(1, [1, 2])
    assert len(views) == 2  # not mergeable: the two blocks are not adjacent in memory
    got = np.frombuffer(b"".join(bytes(v) for v in views), dtype=np.float32)
    assert np.array_equal(got, buffer[1:3, 1].reshape(-1).numpy())


def test_overlapping_views_are_refused() -> None:
    t = torch.randn(4, 1, 16).expand(4, 8, 16)  # every head aliases the same bytes
    with pytest.raises(IncompatiblePeerError, match="overlaps"):
        KvBlocks.from_tensors([t], 16, "test")


def test_padded_blocks_copy_only_their_elements() -> None:
    # Each block row padded: 8 runs of 16 floats with gaps of 16 floats between them.
    t = torch.zeros(4, 8, 32)[:, :, :16]
    kv = KvBlocks.from_tensors([t], 16, "test")
    assert kv.block_bytes == 8 * 16 * 4
    assert len(kv.block_views(0, [1])) == 8
    assert kv.geometry[0].inner == tuple((h * 128, 64) for h in range(8))
    assert kv.digest.block_order == "HC"  # as an unpadded peer's: the same bytes, in the same order


def test_layers_of_different_shape_are_refused() -> None:
    with pytest.raises(IncompatiblePeerError, match="differ"):
        KvBlocks.from_tensors([_cache(), _cache(shape=(2, 16, 4))], 16, "test")


@pytest.mark.parametrize("inner", [((0, 256),), ((0, 128), (256, 128)), ((0, 32), (32, 32), (100, 8))])
@pytest.mark.parametrize("stride", [256, 512, 64 * 3])
def test_long_transfers_ranges_equal_the_block_by_block_rule(inner: tuple[tuple[int, int], ...], stride: int) -> None:
    """From VECTOR_FROM blocks the ranges are worked out with numpy: the same ranges, in the same order, as block
    after block with touching ranges merged, for blocks in order, shuffled, repeated and in runs."""
    from p2pkv.kv.layout import VECTOR_FROM, LayerGeometry, merge_adjacent

    geometry = LayerGeometry(96, stride, inner)
    rng = np.random.default_rng(7)
    lists = [list(range(VECTOR_FROM * 3)), rng.permutation(500)[:200].tolist(), rng.integers(0, 50, 300).tolist(),
             [*range(10, 90), *range(200, 260), 5, 6, 7, *range(300, 400, 2)]]
    for ids in lists:
        assert len(ids) >= VECTOR_FROM
        expected = merge_adjacent([(96 + b * stride + off, n) for b in ids for off, n in inner])
        got = geometry.ranges(ids)
        assert got == expected
        assert all(type(a) is int and type(n) is int for a, n in got)
