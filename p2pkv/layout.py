"""Which bytes a (layer, block) occupies in vLLM's KV cache, as numpy byte views over the cache memory.

Every layout vLLM 0.29+ uses keeps one block of one layer as one contiguous run of bytes (the block dimension is
outermost within a layer), even when the layer tensor itself is a strided view into a shared buffer. Blocks are
copied whole as opaque bytes: on CPU their interior is packed by the attention kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from p2pkv.errors import IncompatiblePeerError
from p2pkv.protocol import LayoutDigest

ByteBlocks = npt.NDArray[np.uint8]


def _block_bytes_view(t: torch.Tensor) -> ByteBlocks:
    if t.device.type != "cpu":
        raise IncompatiblePeerError(f"KV tensors on {t.device.type} need a GPU transport (not available yet)")
    if t.dim() < 2 or not t[0].is_contiguous():
        raise IncompatiblePeerError(f"KV layer of shape {tuple(t.shape)} strides {t.stride()}: "
                                    "a block is not one contiguous run of bytes")
    es = t.element_size()
    block_bytes = t[0].numel() * es
    flat = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    view = flat.as_strided((t.shape[0], block_bytes), (t.stride(0) * es, 1), t.storage_offset() * es)
    arr: ByteBlocks = view.numpy()
    return arr


def runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive block ids coalesced into (first, count) runs, in order."""
    out: list[tuple[int, int]] = []
    for b in block_ids:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


@dataclass
class KvBlocks:
    """Byte views of every layer's blocks, in the order the layers were registered."""

    layers: list[ByteBlocks]
    digest: LayoutDigest

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], block_size: int, kernel: str) -> KvBlocks:
        if not tensors:
            raise IncompatiblePeerError("no KV cache tensors were registered")
        layers = [_block_bytes_view(t) for t in tensors]
        first = tensors[0]
        shapes = {(tuple(t.shape[1:]), t.dtype) for t in tensors}
        if len(shapes) != 1:
            raise IncompatiblePeerError(f"KV layers differ in block shape or dtype: {shapes}")
        digest = LayoutDigest(num_layers=len(tensors), block_size=block_size, block_bytes=layers[0].shape[1],
                              dtype=str(first.dtype).removeprefix("torch."), block_shape=tuple(first.shape[1:]),
                              kernel=kernel)
        return cls(layers, digest)

    @property
    def block_bytes(self) -> int:
        return self.digest.block_bytes

    def block_views(self, layer: int, block_ids: Sequence[int]) -> tuple[memoryview, ...]:
        """Zero-copy views of the given blocks of one layer, one per run of consecutive blocks."""
        arr = self.layers[layer]
        contiguous_runs = arr.strides[0] == arr.shape[1]
        views: list[memoryview] = []
        for first, count in runs(block_ids):
            if contiguous_runs:
                views.append(arr[first : first + count].reshape(-1).data)
            else:
                views.extend(arr[b].data for b in range(first, first + count))
        return tuple(views)

    def write_blocks(self, layer: int, block_ids: Sequence[int], src: memoryview) -> None:
        """Copy consecutive whole blocks from `src` into the given blocks of one layer."""
        data = np.frombuffer(src, dtype=np.uint8).reshape(len(block_ids), self.block_bytes)
        arr = self.layers[layer]
        row = 0
        for first, count in runs(block_ids):
            arr[first : first + count] = data[row : row + count]
            row += count
