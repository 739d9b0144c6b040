"""Which KV heads each tensor-parallel rank holds, and which prefill ranks a decode rank pulls them from when the
two instances run different tensor-parallel sizes.

vLLM splits a layer's KV heads evenly over the TP ranks; with fewer heads than ranks, each rank holds one head and
several ranks hold the same one (rank r holds head r * heads // tp). MLA caches one latent per token that every rank
holds whole: it is one "head", replicated. Head ranges here are (first, end) in a rank's own numbering unless said
otherwise. Pure logic: both sides of a transfer compute the same plan from the same three numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pkv.errors import ConfigError

HeadRange = tuple[int, int]  # (first, end), end exclusive


def heads_of(rank: int, tp: int, total: int) -> range:
    """The global heads that rank `rank` of `tp` holds."""
    check_split(tp, total)
    if not 0 <= rank < tp:
        raise ConfigError(f"rank {rank} outside tensor-parallel size {tp}")
    if total >= tp:
        per = total // tp
        return range(rank * per, (rank + 1) * per)
    head = rank * total // tp
    return range(head, head + 1)


def check_split(tp: int, total: int) -> None:
    if tp < 1 or total < 1:
        raise ConfigError(f"tensor-parallel size {tp} and {total} KV heads must both be positive")
    if (total >= tp and total % tp) or (total < tp and tp % total):
        raise ConfigError(f"{total} KV heads cannot be split over tensor-parallel size {tp}")


@dataclass(frozen=True)
class Part:
    """One pull of a decode rank: heads `prefill_heads` of prefill rank `prefill_rank` (its numbering) land in this
    rank's heads `decode_heads`. Empty ranges: nothing is needed from that rank, but its blocks may go (a release).
    `pullers`: how many decode ranks pull from that prefill rank, so it knows when its blocks are served."""

    prefill_rank: int
    prefill_heads: HeadRange
    decode_heads: HeadRange
    pullers: int

    @property
    def release_only(self) -> bool:
        return self.prefill_heads[0] == self.prefill_heads[1]


def _sources(decode_rank: int, decode_tp: int, prefill_tp: int, total: int) -> dict[int, list[int]]:
    """For one decode rank: prefill rank -> the global heads taken from it (each head from the first prefill rank
    that holds it), in head order."""
    out: dict[int, list[int]] = {}
    owners = [heads_of(p, prefill_tp, total) for p in range(prefill_tp)]
    for head in heads_of(decode_rank, decode_tp, total):
        rank = next(p for p, held in enumerate(owners) if head in held)
        out.setdefault(rank, []).append(head)
    return out


def plan_pulls(decode_rank: int, decode_tp: int, prefill_tp: int, total: int) -> list[Part]:
    """The pulls decode rank `decode_rank` makes. Every prefill rank is pulled by at least one decode rank (those
    whose heads no decode rank needs are released by decode rank `p % decode_tp`), so every prefill rank learns
    when its blocks may go."""
    check_split(decode_tp, total)
    check_split(prefill_tp, total)
    plans = [_sources(d, decode_tp, prefill_tp, total) for d in range(decode_tp)]
    pullers = [0] * prefill_tp
    releases: dict[int, list[int]] = {}
    for p in range(prefill_tp):
        pullers[p] = sum(1 for plan in plans if p in plan)
        if not pullers[p]:
            releases.setdefault(p % decode_tp, []).append(p)
            pullers[p] = 1
    parts = []
    mine = heads_of(decode_rank, decode_tp, total)
    for p, heads in sorted(plans[decode_rank].items()):
        theirs = heads_of(p, prefill_tp, total)
        # Heads of a rank are consecutive, and the heads taken from one prefill rank are too.
        parts.append(Part(p, (heads[0] - theirs.start, heads[-1] + 1 - theirs.start),
                          (heads[0] - mine.start, heads[-1] + 1 - mine.start), pullers[p]))
    parts += [Part(p, (0, 0), (0, 0), 1) for p in releases.get(decode_rank, [])]
    return parts

