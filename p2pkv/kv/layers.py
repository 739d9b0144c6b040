"""The KV caches vLLM hands a worker (`register_kv_caches`), made ready to move, once, at registration: ordered by
the model's layers, kernel blocks regrouped into vLLM blocks (`p2pkv.kv.layout.manager_blocks`), layers that share one
cache (vLLM's KV sharing) folded into one, and anything p2pkv cannot move refused with an error that names the
layer and what it is. Every plane then works from this one description."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from p2pkv.errors import UnsupportedCacheError
from p2pkv.kv.layout import LayerGeometry, manager_blocks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KvLayers:
    names: list[str]  # every layer vLLM named, in the model's order
    tensors: list[torch.Tensor]  # the distinct caches, in that order, vLLM's block ids on dim 0
    index: dict[str, int]  # layer name -> the index of its cache in `tensors`
    aliases: dict[str, str]  # a layer that reuses another's cache -> that layer
    groups: list[int]  # the KV cache group of each cache in `tensors` (vLLM's hybrid KV cache manager)

    @property
    def owners(self) -> list[str]:
        """The layer that owns each cache in `tensors`."""
        return [n for n in self.names if n not in self.aliases]


def _identity(t: torch.Tensor) -> tuple[object, ...]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _page(t: torch.Tensor | Sequence[torch.Tensor], name: str) -> torch.Tensor:
    """A state layer's first view (vLLM gives a byte view of each block's state, or one view per state tensor)."""
    first = t[0] if isinstance(t, (list, tuple)) else t
    if not isinstance(first, torch.Tensor) or first.dim() < 2:
        raise UnsupportedCacheError(f"KV layer {name}: a state of {type(t).__name__} p2pkv does not know")
    return first


def state_views(kv_caches: Mapping[str, torch.Tensor], num_blocks: int, states: set[str]) -> dict[str, torch.Tensor]:
    """Every layer's blocks in one shape: a state layer's (Mamba) as its whole page of vLLM's hybrid manager, seen
    through the attention layers' view of theirs (vLLM pads both to one page size), so that its blocks move as
    theirs do, padding and all; with no attention layers, as bytes. Refuses pages laid out otherwise."""
    if not states:
        return dict(kv_caches)
    pages = {name: _page(kv_caches[name], name) for name in states}
    attention = [t for n, t in kv_caches.items() if n not in states]
    some = next(iter(pages.values()))
    page = some.stride(0) * some.element_size()
    if attention:
        # The state takes the attention layers' own view (kernel blocks and all), so it is regrouped as theirs is
        like = attention[0]
        es = like.element_size()
        blocks = manager_blocks(like, num_blocks, next(n for n in kv_caches if n not in states))
        inner = LayerGeometry.of(blocks).inner
        if blocks.stride(0) * es != page or inner != ((0, page),):
            raise UnsupportedCacheError(
                f"KV layer {next(iter(states))}: Mamba state pages of {page} bytes beside attention blocks of "
                f"{blocks.stride(0) * es} bytes laid out in {len(inner)} runs: p2pkv moves a state only where "
                "each attention block is one page (KV cache layouts with the block outermost in a layer)")
        shape, stride, dtype = tuple(like.shape), like.stride(), like.dtype
    else:
        count = num_blocks or some.shape[0]
        shape, stride, dtype, es = (count, 1, 1, page), (page, page, page, 1), torch.uint8, 1
    out = dict(kv_caches)
    for name, t in pages.items():
        offset = t.storage_offset() * t.element_size()
        if t.stride(0) * t.element_size() != page or offset % es:
            raise UnsupportedCacheError(f"KV layer {name}: its state pages are not {page} bytes apart from an "
                                        f"offset of whole {dtype} elements")
        out[name] = torch.empty(0, dtype=dtype, device=t.device).set_(t.untyped_storage(), offset // es, shape,
                                                                      stride)
    return out


def prepare_layers(kv_caches: Mapping[str, torch.Tensor], num_blocks: int, block_size: int,
                   order: Callable[[str], tuple[int, str]], group_of: Mapping[str, int] | None = None,
                   state_groups: Sequence[bool] = ()) -> KvLayers:
    """`num_blocks`: vLLM's block count (`KVCacheConfig.num_blocks`; 0: not known, then told from views whose
    token dimension is a fraction of `block_size`); `order`: the sort key that puts layer names in the model's
    order; `group_of`: each layer's KV cache group (none: one group); `state_groups`: which groups hold a state
    (`state_views`). Layers of different groups that share one buffer (vLLM's hybrid manager lays them out so)
    are not aliases: each group has its own blocks in it."""
    group_of = group_of or {}
    if not kv_caches:
        raise UnsupportedCacheError("vLLM registered no KV cache layers")
    states = {n for n in kv_caches if (g := group_of.get(n, 0)) < len(state_groups) and state_groups[g]}
    kv_caches = state_views(kv_caches, num_blocks, states)
    if num_blocks <= 0:
        sample = next(iter(kv_caches.values()))
        tokens = sample.shape[2] if sample.dim() == 4 else block_size
        if 0 < tokens < block_size and block_size % tokens == 0:
            num_blocks = sample.shape[0] // (block_size // tokens)
    names = sorted(kv_caches, key=order)
    tensors: list[torch.Tensor] = []
    index: dict[str, int] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[object, ...], str] = {}
    groups: list[int] = []
    for name in names:
        t = kv_caches[name]
        if t.dim() != 4:
            raise UnsupportedCacheError(
                f"KV layer {name}: vLLM gave a buffer of shape {tuple(t.shape)}, not a [blocks, heads, tokens, "
                "bytes] view: a cache the model lays out itself (Mamba or other state), which p2pkv cannot move")
        key = (*_identity(t), group_of.get(name, 0))
        owner = seen.get(key)
        if owner is not None:
            aliases[name], index[name] = owner, index[owner]
            continue
        seen[key] = name
        index[name] = len(tensors)
        tensors.append(manager_blocks(t, num_blocks, name))
        groups.append(group_of.get(name, 0))
    first = tensors[0]
    for name, t in zip((n for n in names if n not in aliases), tensors, strict=True):
        if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
            raise UnsupportedCacheError(
                f"KV layer {name} holds blocks of shape {tuple(t.shape[1:])} {t.dtype}, layer {names[0]} of "
                f"{tuple(first.shape[1:])} {first.dtype}: models whose layers have different KV page sizes are "
                "not supported")
    if aliases:
        log.info("%d layers reuse another layer's KV cache (KV sharing); each cache moves once", len(aliases))
    if first.dim() == 5:
        log.info("vLLM's blocks are split into %d kernel blocks each; every transfer moves whole vLLM blocks",
                 first.shape[1])
    return KvLayers(names, tensors, index, aliases, groups)
