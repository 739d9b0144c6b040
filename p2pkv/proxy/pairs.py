"""Which prefill instance may prefill for which decode instance: not one whose workers and the decode instance's
refused each other at their hello (another KV layout, or model settings the KV depends on: their KV cannot be
exchanged, and the decode instance would compute the prompt again after the prefill instance computed it for
nothing). The instances' heartbeats say whom their workers refused, and how long ago (`Heartbeat.refused`). Such a
pair is passed over for `PAIR_RETRY_S` after its latest refusal; then a request tries it again: the instances may
have been fixed (an accepted hello clears the refusal there), and if not, the refusal is noted afresh, and the pair
is passed over twice as long as the time before, up to `MAX_PAIR_RETRY_S` (each try costs a prefill computed for
nothing). A refused instance that restarted is paired again at once: refusals from before its restart no longer
count. A refusal names the start of the instance it refused (`PeerRefused.launch`); where it and the instance's
start now are both known and differ, the refusal is of an earlier start. Where either is not said, a restart is told
by another engine id in the heartbeats (`Side.up_since`).

Nor is a pair paired whose weights differ as far as the proxy knows: a weight update through its `/collective_rpc`
that one took and the other did not (it failed there, or the instance restarted since, with the weights it was
started with), until an update reaches both (`p2pkv.proxy.control`).

Instances from static flags that send no heartbeats are asked the same by probes (`p2pkv.proxy.poll`)."""

from __future__ import annotations

from dataclasses import dataclass

from p2pkv.params import Address

PAIR_RETRY_S = 60.0
MAX_PAIR_RETRY_S = 480.0  # under the 10 minutes for which heartbeats name a refusal (`MAX_REFUSAL_AGE_S`)


@dataclass(frozen=True)
class Refused:
    """A worker of another instance that a worker of this one refused at its hello: the pair is passed over until
    `PAIR_RETRY_S` after, doubled for each time it was refused again when tried after that (`strikes`)."""

    address: Address  # the refused worker's listener, as it names it
    reason: str
    at: float  # when it was refused, in the proxy's monotonic seconds
    strikes: int = 0
    launch: str = ""  # the start of the refused worker's instance (`p2pkv.config.launch_of`); "": not said

    @property
    def until(self) -> float:
        return self.at + min(MAX_PAIR_RETRY_S, PAIR_RETRY_S * float(1 << min(self.strikes, 16)))


Said = tuple[Address, str, float, str]  # a refusal as an instance says it: (address, reason, seconds since, launch)


def refusals(said: tuple[Said, ...], now: float, before: tuple[Refused, ...] = ()) -> tuple[Refused, ...]:
    """What a heartbeat said as times from `now`. `before`: what the instance said last; a refusal of the same
    worker made once the one before had run out (the pair was tried again, and refused afresh) is one more
    strike."""
    known = {r.address: r for r in before}
    out = []
    for address, reason, age, launch in said:
        at, last = now - age, known.get(address)
        strikes = 0 if last is None else last.strikes + (at >= last.until)
        out.append(Refused(address, reason, at, strikes, launch))
    return tuple(out)


def news(before: tuple[Refused, ...], after: tuple[Refused, ...], now: float) -> list[Refused]:
    """The refusals in `after` that pass a pair over now and did not before (to be logged once)."""
    known = {r.address for r in before if r.until > now}
    return [r for r in after if r.until > now and r.address not in known]


@dataclass(frozen=True)
class Side:
    """An instance as pairing sees it: its name, its workers' listeners (`kv` and the `ranks` - 1 after it), the
    refusals its heartbeats said, since when it runs as it does (when the proxy saw it restart; 0: not seen), and its
    start as it says it ("": not said)."""

    name: str
    kv: Address | None
    ranks: int
    refused: tuple[Refused, ...]
    up_since: float = 0.0
    launch: str = ""
    weights: str = ""  # the last weight update through the proxy it took ("": the weights it started with)

    def is_start_refused(self, refused: Refused) -> bool:
        """Whether `refused` is of this start of the instance, as far as the proxy can tell."""
        return refused.at >= self.up_since and not (refused.launch and self.launch and refused.launch != self.launch)

    def holds(self, address: Address) -> bool:
        return (self.kv is not None and address.host == self.kv.host
                and 0 <= address.port - self.kv.port < max(1, self.ranks))


def why_not_paired(decode: Side, prefill: Side, now: float) -> str | None:
    """Why the two must not exchange KV now (one refused a worker of the other, or a weight update through the
    proxy reached one and not the other: their KV differs); None if nothing says so."""
    if decode.weights != prefill.weights:
        return (f"their weights differ: {decode.name} took {decode.weights or 'no update'} and {prefill.name} "
                f"{prefill.weights or 'no update'} (a weight update through the proxy failed on one of them)")
    for by, other in ((decode, prefill), (prefill, decode)):
        for refused in by.refused:
            if refused.until > now and other.holds(refused.address) and other.is_start_refused(refused):
                return f"{by.name} refused its worker at {refused.address}: {refused.reason}"
    return None
