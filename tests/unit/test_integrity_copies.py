"""integrity_check on pulls that copy cache to cache: host_ipc (the puller reads the offerer's exported cache) and
pipes (gloo, nccl's CPU stand-in). No frame carries those bytes, so the offerer digests its blocks as it says where
they lie, and the puller digests them where they landed. Faults: a copy that lands one bit wrong in the puller's
cache (with a negative control: without the check it lands unseen), and the offerer's blocks changed right after its
digest, before the puller copied them (as if reused under the pull)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from p2pkv.engine.device import Fence, Placed, RemoteCache
from p2pkv.engine.puller import PullResult, PullState
from p2pkv.kv.ipc import CacheAccess
from p2pkv.kv.layout import placed_ranges
from p2pkv.kv.pipes import Channel, ChannelPipe
from p2pkv.protocol import DeviceExport
from p2pkv.transport import cma
from tests.helpers import ipc_side, pipe_sides
from tests.helpers.unit import SIZES

pytestmark = pytest.mark.skipif(not cma.available(), reason="needs cross-memory attach (Linux)")
MISMATCH = "do not match the sender's digest"
MOVES = {3: 0, 4: 1, 9: 7}
Side = ipc_side.Side | pipe_sides.Side


class Fault:
    """Flips one bit of the last byte of the blocks given, once, while `armed`."""

    armed = False

    def strike(self, storages: Sequence[torch.Tensor], placed: Placed) -> None:
        pieces = placed_ranges(placed.block_ids, placed.layers)
        if self.armed and pieces:
            storage, at, n = pieces[-1]
            storages[storage][at + n - 1 : at + n].bitwise_xor_(1)
            self.armed = False


class DamagingRemote:
    """A peer's opened cache whose copies land one bit wrong while the fault is armed."""

    def __init__(self, remote: RemoteCache, access: DamagingAccess) -> None:
        self._remote, self._access = remote, access
        self.transport = remote.transport

    def copy(self, theirs: Placed, ours: Placed, deadline: float, after: Fence | None = None) -> int:
        n = self._remote.copy(theirs, ours, deadline, after)
        self._access.strike(self._access.kv.flat, ours)
        return n

    def close(self) -> None:
        self._remote.close()


class DamagingAccess(CacheAccess, Fault):
    def open(self, export: DeviceExport) -> RemoteCache:
        return DamagingRemote(super().open(export), self)


class DamagingPipe(ChannelPipe):
    fault: Fault

    def recv(self, placed: Placed, deadline: float, after: Fence | None = None) -> None:
        super().recv(placed, deadline, after)
        self.fault.strike(self._kv.flat, placed)


class DamagingPipes(pipe_sides.RecordingPipes, Fault):
    def _pipe(self, channel: Channel) -> ChannelPipe:
        pipe = DamagingPipe(self.kv, channel, self.kind)
        pipe.fault = self
        return pipe


class ScribblingAccess(CacheAccess, Fault):
    """An offerer whose blocks change right after it digested them."""

    def bytes_digest(self, placed: Placed) -> int | None:
        got = super().bytes_digest(placed)
        self.strike(self.kv.flat, placed)
        return got


def counted(side: Side, outcome: str) -> float:
    value = side.engine.metrics.registry.get_sample_value("p2pkv_digests_total",
                                                          {"direction": "pull", "outcome": outcome})
    return value or 0.0


def pull(offerer: Side, puller: Side, tid: str) -> PullResult:
    """Pull MOVES into a zeroed cache; the result, once the offerer has the puller's copy confirmation (it gets one
    on a mismatch too: the copy is done, its bytes are wrong)."""
    for layer in puller.layers:
        layer.zero_()
    return pipe_sides.pull(offerer, puller, tid, MOVES, done=False)


def wrong_bytes(offerer: Side, puller: Side) -> int:
    """Bytes of the moved blocks that differ between the two caches."""
    return sum(int((puller.layers[layer][d].view(torch.uint8) != offerer.layers[layer][s].view(torch.uint8)).sum())
               for layer in range(SIZES["L"]) for s, d in MOVES.items())


def host_ipc_pair(sides: list[Side], integrity: bool, puller_access: type[CacheAccess] = CacheAccess,
                  offerer_access: type[CacheAccess] = CacheAccess) -> tuple[ipc_side.Side, ipc_side.Side]:
    # Only the puller asks for digests: the offerer takes them because the link agreed them at the handshake.
    offerer = ipc_side.Side(True, access=offerer_access)
    sides.append(offerer)
    puller = ipc_side.Side(False, integrity=integrity, access=puller_access)
    sides.append(puller)
    return offerer, puller


def pipe_pair(sides: list[Side], integrity: bool) -> tuple[pipe_sides.Side, pipe_sides.Side]:
    offerer = pipe_sides.Side("LHBNC", True)
    sides.append(offerer)
    puller = pipe_sides.Side("LHBNC", False, integrity=integrity, pipes=DamagingPipes)
    sides.append(puller)
    pipe_sides.pull_until_by_pipe(offerer, puller, MOVES, "warm")  # the first pulls carry bytes (while it is made)
    return offerer, puller


@pytest.mark.parametrize("integrity", [True, False], ids=["integrity_check", "negative-control"])
@pytest.mark.parametrize("path", ["host_ipc", "gloo"])
def test_a_copy_that_lands_wrong_fails_the_pull_only_with_integrity_check(sides: list[Side], path: str,
                                                                         integrity: bool) -> None:
    if path == "host_ipc":
        offerer, puller = host_ipc_pair(sides, integrity, puller_access=DamagingAccess)
        fault: Fault = puller.access
    else:
        offerer, puller = pipe_pair(sides, integrity)
        fault = puller.pipes
    assert isinstance(fault, Fault)
    clean = pull(offerer, puller, "clean-1")
    assert clean.state is PullState.DONE and clean.by_reference and clean.transport == path
    assert wrong_bytes(offerer, puller) == 0
    checked = counted(puller, "ok")
    assert checked > 0 if integrity else checked == 0
    assert counted(puller, "mismatch") == 0

    fault.armed = True
    damaged = pull(offerer, puller, "damaged")
    assert not fault.armed, "the copy ran"
    if integrity:
        assert damaged.state is PullState.FAILED and MISMATCH in damaged.reason, damaged
        assert counted(puller, "mismatch") == 1
    else:
        assert damaged.state is PullState.DONE and damaged.by_reference
        assert wrong_bytes(offerer, puller) == 1, "unchecked, the damaged byte stays"

    again = pull(offerer, puller, "clean-2")  # the same link, opened cache and pipe serve the next pull
    assert again.state is PullState.DONE and again.by_reference and again.transport == path
    assert wrong_bytes(offerer, puller) == 0
    assert counted(puller, "ok") == checked + (1 if integrity else 0)
    assert counted(puller, "mismatch") == (1 if integrity else 0)


def test_blocks_changed_after_the_offerers_digest_fail_the_pull(sides: list[Side]) -> None:
    offerer, puller = host_ipc_pair(sides, True, offerer_access=ScribblingAccess)
    assert isinstance(offerer.access, ScribblingAccess)
    offerer.access.armed = True
    damaged = pull(offerer, puller, "reused")
    assert not offerer.access.armed, "the offerer digested the blocks it served"
    assert damaged.state is PullState.FAILED and MISMATCH in damaged.reason, damaged
    assert counted(puller, "mismatch") == 1
    assert pull(offerer, puller, "next").state is PullState.DONE
