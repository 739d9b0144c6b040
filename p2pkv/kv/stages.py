"""Which prefill pipeline stages a decode stage pulls its layers from, when the two instances run different
pipeline-parallel sizes.

A stage holds a consecutive range of the model's layers; the stages of an instance cover every layer once, in
order. vLLM decides the split (`vllm.distributed.utils.get_pp_indices`); here it is given as one range per stage.
Pure logic: every decode stage computes the same plan from the same two splits, so a prefill stage learns from the
first pull how many decode stages will pull it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from p2pkv.errors import ConfigError

# (stage, pipeline-parallel size) -> the model's layers that stage holds.
StageLayers = Callable[[int, int], range]


@dataclass(frozen=True)
class StagePart:
    """Layers `layers` (the model's numbering, (first, end)) come from prefill stage `prefill_stage`, which
    `pullers` decode stages pull."""

    prefill_stage: int
    layers: tuple[int, int]
    pullers: int


def check_split(stages: Sequence[range], total: int) -> None:
    """The stages hold layers 0 .. total, each at least one, in order, each layer once."""
    at = 0
    for stage, held in enumerate(stages):
        if held.step != 1 or held.start != at or held.stop <= held.start:
            raise ConfigError(f"pipeline stage {stage} holds layers {held.start}..{held.stop}: expected a "
                              f"non-empty range from layer {at}")
        at = held.stop
    if at != total:
        raise ConfigError(f"pipeline stages hold {at} layers; the model has {total}")


def _overlap(a: range, b: range) -> tuple[int, int] | None:
    first, end = max(a.start, b.start), min(a.stop, b.stop)
    return (first, end) if first < end else None


def plan_stages(decode_stage: int, decode: Sequence[range], prefill: Sequence[range], total: int) -> list[StagePart]:
    """The prefill stages decode stage `decode_stage` pulls from, and which of its layers each gives."""
    check_split(decode, total)
    check_split(prefill, total)
    if not 0 <= decode_stage < len(decode):
        raise ConfigError(f"pipeline stage {decode_stage} outside pipeline-parallel size {len(decode)}")
    parts = []
    for stage, held in enumerate(prefill):
        layers = _overlap(decode[decode_stage], held)
        if layers is not None:
            pullers = sum(1 for mine in decode if _overlap(mine, held) is not None)
            parts.append(StagePart(stage, layers, pullers))
    return parts


def stage_split(stage_layers: StageLayers, pp_size: int) -> list[range]:
    """Every stage's layers for pipeline-parallel size `pp_size`; ConfigError where the split cannot be made."""
    try:
        return [stage_layers(stage, pp_size) for stage in range(pp_size)]
    except ValueError as exc:  # vLLM's: VLLM_PP_LAYER_PARTITION does not fit this size
        raise ConfigError(f"cannot split the layers over pipeline-parallel size {pp_size}: {exc}") from None
