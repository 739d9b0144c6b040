"""Which prefill pipeline stages a decode stage pulls its layers from (pure logic)."""

from __future__ import annotations

import itertools

import pytest

from p2pkv.errors import ConfigError
from p2pkv.kv.stages import check_split, plan_stages, stage_split


def even(total: int, pp: int) -> list[range]:
    """A split like vLLM's default for these sizes: the first stages take the remainder."""
    per, extra = divmod(total, pp)
    out, at = [], 0
    for stage in range(pp):
        n = per + (1 if stage < extra else 0)
        out.append(range(at, at + n))
        at += n
    return out


@pytest.mark.parametrize(("total", "decode_pp", "prefill_pp"),
                         [(t, d, p) for t, d, p in itertools.product([4, 7, 8, 32], [1, 2, 3, 4], [1, 2, 3, 4])
                          if t >= max(d, p)])
def test_every_layer_comes_once_and_every_prefill_stage_knows_its_pullers(total: int, decode_pp: int,
                                                                         prefill_pp: int) -> None:
    decode, prefill = even(total, decode_pp), even(total, prefill_pp)
    pulls: dict[int, int] = {}
    for stage in range(decode_pp):
        parts = plan_stages(stage, decode, prefill, total)
        got = [layer for part in parts for layer in range(*part.layers)]
        assert got == list(decode[stage])  # this stage's layers, each once, in order
        for part in parts:
            assert set(range(*part.layers)) <= set(prefill[part.prefill_stage])
            pulls[part.prefill_stage] = pulls.get(part.prefill_stage, 0) + 1
    # Every prefill stage is pulled (so its blocks are released), and says how many pulls to expect.
    assert sorted(pulls) == list(range(prefill_pp))
    for stage in range(decode_pp):
        for part in plan_stages(stage, decode, prefill, total):
            assert part.pullers == pulls[part.prefill_stage]


def test_one_prefill_stage_to_two_decode_stages_and_back() -> None:
    two, one = [range(0, 2), range(2, 4)], [range(0, 4)]
    assert [(p.prefill_stage, p.layers, p.pullers) for p in plan_stages(1, two, one, 4)] == [(0, (2, 4), 2)]
    assert [(p.prefill_stage, p.layers, p.pullers) for p in plan_stages(0, one, two, 4)] == [(0, (0, 2), 1),
                                                                                          (1, (2, 4), 1)]


@pytest.mark.parametrize(("stages", "total", "error"), [
    ([range(0, 2), range(3, 4)], 4, "from layer 2"),
    ([range(0, 2), range(2, 2), range(2, 4)], 4, "non-empty"),
    ([range(0, 2)], 4, "hold 2 layers; the model has 4"),
    ([range(1, 4)], 4, "from layer 0"),
])
def test_splits_that_do_not_cover_the_model_are_refused(stages: list[range], total: int, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        check_split(stages, total)


def test_a_split_vllm_cannot_make_is_a_config_error() -> None:
    def refuses(stage: int, pp: int) -> range:
        raise ValueError("len(partitions)=2 does not match pp_size=3.")

    with pytest.raises(ConfigError, match="pipeline-parallel size 3"):
        stage_split(refuses, 3)
    with pytest.raises(ConfigError, match="outside"):
        plan_stages(2, [range(0, 4)], [range(0, 4)], 4)
