"""Some heads of some layers of every block: what moves between instances of different tensor- or
pipeline-parallel sizes. Each (heads, layers) pair is a `BlockAccess` of its own, over views of the same cache
(`p2pkv.kv.layout.head_slice`), made on first use and kept; a cache in host memory is read and written in place, a
GPU's through host buffers (`p2pkv.kv.staging`), or, pulled by reference, by the byte runs of the slice in the cache's
storages (`BlockAccess.runs`, `ranges`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from p2pkv.errors import IncompatiblePeerError
from p2pkv.kv.blocks import BlockAccess, InPlaceBlocks
from p2pkv.kv.buffers import TransferBuffers
from p2pkv.kv.layout import KvBlocks, head_slice, heads_axis
from p2pkv.kv.staging import DeviceKv

if TYPE_CHECKING:
    import torch


class HeadSlices:
    def __init__(self, tensors: Sequence[torch.Tensor] = (), block_size: int = 0, kernel: str = "",
                 whole: BlockAccess | None = None, device: DeviceKv | None = None) -> None:
        """`whole`: the access to every head, used for the range that covers them all; `device`: the cache is
        reached through host copies (its pool and metrics are shared)."""
        self._tensors = list(tensors)
        self._block_size = block_size
        self._kernel = kernel
        self._whole = whole
        self._device = device
        self._lock = threading.Lock()
        self._made: dict[tuple[tuple[int, int], tuple[int, int]], BlockAccess] = {}

    def get(self, heads: tuple[int, int], layers: tuple[int, int] | None = None) -> BlockAccess:
        """The access to heads `first .. end` of every block of layers `layers` (as registered here, numbered
        from 0; None: all); IncompatiblePeerError outside what is held here."""
        if not self._tensors:
            raise AssertionError("no KV cache registered")
        every = (0, len(self._tensors))
        layers = layers or every
        if not 0 <= layers[0] < layers[1] <= every[1]:
            raise IncompatiblePeerError(f"layers {layers[0]}..{layers[1]} outside the {every[1]} held here")
        held = self._tensors[0].shape[heads_axis(self._tensors[0])]
        if self._whole is not None and heads == (0, held) and layers == every:
            return self._whole
        with self._lock:
            made = self._made.get((heads, layers))
            if made is None:
                views = head_slice(self._tensors[layers[0] : layers[1]], heads)
                made = self._made[heads, layers] = self._make(views)
            return made

    def _make(self, views: list[torch.Tensor]) -> BlockAccess:
        device = self._device
        if device is None:
            return InPlaceBlocks(KvBlocks.from_tensors(views, self._block_size, self._kernel))
        kv = DeviceKv(views, self._block_size, self._kernel, device.copy_timeout_s, parent=device)
        kv.pool, kv.metrics = device.pool, device.metrics
        return TransferBuffers(kv)

    def release(self, key: str) -> None:
        """Free what any slice holds for `key` (a transfer id, or a pull's key)."""
        with self._lock:
            made = list(self._made.values())
        for access in made:
            access.release(key)

    def collect(self) -> None:
        """`BlockAccess.collect` of every slice."""
        with self._lock:
            made = list(self._made.values())
        for access in made:
            access.collect()
