"""vLLM's KV cache groups (its hybrid KV cache manager): which layers keep which kind of KV, and what p2pkv moves of
each. A full-attention group moves every block of the prompt; a sliding-window group only the blocks vLLM still
holds (those before the window are its null block, id 0, on both sides); a state group (Mamba) its one block, the
state after the prompt. Anything else is refused at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from p2pkv.errors import UnsupportedCacheError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

NULL_BLOCK = 0  # vLLM's null block: the first of its pool, in a request's table where no block is held


@dataclass(frozen=True)
class CacheGroups:
    """`kinds`: per group, "full", "window N" (N tokens) or "window N+R" (R tokens behind the window retained, for
    speculative decoding); `of_layer`: layer name -> its group; `windows`: per group, the tokens a step keeps of a
    request (N + R; 0: full attention). `grouped`: block ids go per group (several groups, or a sliding window: null
    blocks in the tables); one full-attention group moves as one list of block ids."""

    kinds: tuple[str, ...] = ()
    of_layer: dict[str, int] = field(default_factory=dict)
    windows: tuple[int, ...] = ()
    states: tuple[bool, ...] = ()  # per group: state (Mamba), one block a request, rewritten in place as it goes
    block_size: int = 0  # tokens a block of the attention groups holds (0: not known; a state's block holds more)

    @property
    def has_state(self) -> bool:
        return any(self.states)

    @property
    def grouped(self) -> bool:
        return len(self.kinds) > 1 or any(kind != "full" for kind in self.kinds)

    @property
    def factor(self) -> str:
        """What peers compare at the hello (`LayoutDigest.kv_groups`): the groups' kinds and which layers each
        holds. "" for one full-attention group."""
        if not self.grouped:
            return ""
        members = [sorted((n for n, g in self.of_layer.items() if g == i), key=_layer_key)
                   for i in range(len(self.kinds))]
        return "|".join(f"{kind}:{','.join(str(_layer_key(n)[0]) for n in names)}"
                                       for kind, names in zip(self.kinds, members, strict=True))


def _layer_key(name: str) -> tuple[int, str]:
    return next((int(part) for part in name.split(".") if part.isdigit()), 0), name


def window_start(num_prompt_tokens: int, window: int, block_size: int) -> int:
    """The first block of a prompt that a sliding window of `window` tokens (with those retained behind it) still
    reads when the prompt's last token is computed: the decode side, which computes it, holds the blocks from there,
    vLLM's null block before (its `SlidingWindowManager.get_num_skipped_tokens`)."""
    return max(0, num_prompt_tokens - window) // block_size if window else 0


def frees_soon(num_prompt_tokens: int, window: int, block_size: int) -> bool:
    """Whether vLLM may free a block from `window_start` on as a request that computed its prompt finishes: its
    window moves on by a token, two under async scheduling (a step scheduled before the finish was known). A push
    that reads that block must have read it by then."""
    return bool(window) and max(0, num_prompt_tokens + 2 - window) // block_size > window_start(
        num_prompt_tokens, window, block_size)


def state_only(ids: tuple[int, ...], num_blocks: int) -> tuple[int, ...]:
    """A state group's block ids where an attention group's `num_blocks` blocks stand: its state block (the
    request's first) in the last place, null before. Block ids travel by place, and a prompt's state is what its
    last block's tokens leave: the sender skips the nulls (`PushBlocks.skip`) and both sides count places alike."""
    if not ids or num_blocks <= 0:
        return ()
    return (NULL_BLOCK,) * (num_blocks - 1) + (ids[0],)


def leading_nulls(block_ids: tuple[int, ...]) -> int:
    """How many of a group's block ids, from the first, are vLLM's null block (blocks before a sliding window)."""
    count = 0
    for block in block_ids:
        if block != NULL_BLOCK:
            break
        count += 1
    return count


def _state_kind(spec: MambaSpec, name: str) -> str:
    """How a state group is told apart at the hello: its mixer and the shape and dtype of each state tensor. Refuses
    what p2pkv cannot move: states kept per block of the prompt (prefix caching) and speculative decoding's."""
    if spec.mamba_cache_mode != "none":
        raise UnsupportedCacheError(
            f"KV layer {name}: Mamba state with mamba_cache_mode {spec.mamba_cache_mode!r} (prefix caching keeps a "
            "state per block): p2pkv moves the state after the prompt only; run the instances with "
            "--no-enable-prefix-caching")
    if spec.num_speculative_blocks:
        raise UnsupportedCacheError(f"KV layer {name}: Mamba state with speculative decoding "
                                    f"({spec.num_speculative_blocks} blocks of drafts): not supported by p2pkv yet")
    tensors = ", ".join(f"{'x'.join(map(str, shape))} {str(dtype).removeprefix('torch.')}"
                        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True))
    mixer = getattr(spec.mamba_type, "name", str(spec.mamba_type)).lower()
    return f"state {mixer} {tensors}"


def cache_groups(kv_cache_config: KVCacheConfig | None) -> CacheGroups:
    """The groups of a KV cache p2pkv can move, or `UnsupportedCacheError` naming what it cannot: beside other
    groups, any attention other than full or sliding-window (chunked local attention, say), and state other than
    Mamba's without prefix caching. One group of any attention KV moves as before."""
    if kv_cache_config is None:
        return CacheGroups()
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    groups = list(kv_cache_config.kv_cache_groups)
    kinds: list[str] = []
    windows: list[int] = []
    states: list[bool] = []
    of_layer: dict[str, int] = {}
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        name = group.layer_names[0] if group.layer_names else "?"
        specs = list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        if all(isinstance(one, MambaSpec) for one in specs) and len({_state_kind(one, name) for one in specs}) == 1:
            kinds.append(_state_kind(specs[0], name))
            windows.append(0)
            states.append(True)
            of_layer.update(dict.fromkeys(group.layer_names, index))
            continue
        for one in specs:
            if not isinstance(one, AttentionSpec):
                raise UnsupportedCacheError(f"KV layer {name}: its cache is a {type(one).__name__}, neither attention "
                                            "KV nor one Mamba state: p2pkv cannot move it")
        kept = {(one.sliding_window, one.extra_retained_tokens) for one in specs if type(one) is SlidingWindowSpec}
        if len(kept) == 1 and all(type(one) is SlidingWindowSpec for one in specs):
            window, retained = kept.pop()
            kinds.append(f"window {window}+{retained}" if retained else f"window {window}")
            windows.append(window + retained)
        elif all(type(one) is FullAttentionSpec or (len(groups) == 1 and isinstance(one, FullAttentionSpec))
                 for one in specs):
            kinds.append("full")
            windows.append(0)
        else:  # blocks vLLM frees or reuses as the request goes (chunked local attention, say): not yet
            raise UnsupportedCacheError(
                f"KV layer {name}: a {type(specs[0]).__name__} cache group: p2pkv moves full-attention, "
                "sliding-window and Mamba state groups only")
        states.append(False)
        of_layer.update(dict.fromkeys(group.layer_names, index))
    # A state group's block holds a whole request (its block size is the model's length): not counted here.
    sizes = {group.kv_cache_spec.block_size for group, state in zip(groups, states, strict=True) if not state}
    if len(sizes) > 1:
        raise UnsupportedCacheError(f"KV cache groups of different block sizes ({sorted(sizes)} tokens): p2pkv moves "
                                    "groups whose blocks hold the same tokens")
    return CacheGroups(tuple(kinds), of_layer, tuple(windows), tuple(states), sizes.pop() if sizes else 0)
