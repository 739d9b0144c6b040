"""Worker side, saving: each transfer of a prefill worker, pushed layer by layer as the forward computes it or
held for the decode worker's pull, until the push is done or the pull served; loading is `p2pkv.vllm.loads`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from p2pkv.config import ConnectorConfig
from p2pkv.engine import TransferEngine
from p2pkv.engine.device import Fence, PlaceSource
from p2pkv.engine.offers import OfferState
from p2pkv.engine.sender import OutState
from p2pkv.errors import IncompatiblePeerError
from p2pkv.kv.blocks import BlockAccess
from p2pkv.kv.device_copy import Marker, NoPinnedSpace, all_done, wait_marker
from p2pkv.kv.slices import HeadSlices
from p2pkv.params import Address
from p2pkv.vllm.groups import leading_nulls
from p2pkv.vllm.loads import Placement
from p2pkv.vllm.metadata import SaveSpec
from p2pkv.way import push_or_pull

log = logging.getLogger(__name__)


def _raiser(exc: Exception) -> Callable[[float], bool]:
    def ready(_deadline: float) -> bool:
        raise exc

    return ready


def _pullers(spec: SaveSpec) -> tuple[Address, ...]:
    """The listeners of the decode ranks that will pull `spec` (GET), where the scheduler knows them."""
    if spec.pulled_by is None:
        return ()
    return tuple(spec.pulled_by.offset(rank) for rank in range(spec.pullers or 1))


class Saves:
    def __init__(self, config: ConnectorConfig, engine: TransferEngine, blocks: BlockAccess, slices: HeadSlices,
                 at: Placement, staged: bool, groups: tuple[int, ...] | None = None) -> None:
        """`staged`: the KV is behind a device copy (a GPU's): every layer is pushed as the forward computes it,
        whatever the link, so that the copy overlaps the compute (see `save_layer` for host KV). `groups`: the KV
        cache group of each layer, where each group has its own block ids (`SaveSpec.groups`): those are pushed,
        layer by layer, and never held for a pull; a save that says `settle` is waited for in `wait_for_save`."""
        self._config = config
        self._groups = groups
        self._engine = engine
        self._blocks = blocks
        self._slices = slices
        self._at = at
        self._staged = staged
        self._saves: list[SaveSpec] = []  # this step's
        self._pushed: dict[str, set[int]] = {}
        self._left: set[str] = set()  # this step's transfers left for the peer to pull (it asked: device path)
        self._sending: dict[str, SaveSpec] = {}  # request id -> the save whose transfer it is sending
        self._finished: set[str] = set()
        # transfers of preempted (or aborted) requests: not offered again, unless a preempted one saves again
        self._withdrawn: set[str] = set()

    @property
    def pending(self) -> bool:
        return bool(self._sending)

    def bind(self, saves: list[SaveSpec]) -> None:
        self._saves = saves
        self._pushed = {s.transfer_id: set() for s in saves}
        self._left = set()

    def renew(self) -> None:
        """A lease counts from when vLLM finishes the request, whose answer names the transfer: until then (a
        prefill request that goes on decoding) nobody can pull, so its offer is held for as long as it runs."""
        unanswered = [spec.transfer_id for req_id, spec in self._sending.items() if req_id not in self._finished]
        if unanswered:
            self._engine.renew_offers(unanswered)

    def abandon(self, transfer_ids: list[str]) -> None:
        """Transfers whose request was aborted: nobody will pull them, so their blocks are no longer offered (nor
        offered later, should the push be refused) and go back to vLLM once a push in flight is done."""
        sending = {spec.transfer_id for spec in self._sending.values()}
        for tid in transfer_ids:
            if tid not in sending:
                continue
            self._withdrawn.add(tid)
            if not self._engine.withdraw_offer(tid, time.monotonic()):
                log.info("transfer %s: a pull reads the blocks of an aborted request; they go when it is done", tid)
            log.info("transfer %s: its request was aborted; nothing will pull its blocks", tid)

    def save_layer(self, layer: int) -> None:
        """A layer of this step's forward is computed: its blocks are pushed now, so that the device copy (KV on a
        GPU) or the wire (a peer on another host) overlaps the next layers' compute. Except with KV in host memory
        (vLLM's CPU build) for a peer on this host that reads it in place (shm): nothing is pushed until
        `wait_for_save`, when the forward is over. There the peer's copy is one cheap system call, while the
        transfer's threads share the cores and the GIL with the forward: a push per layer, with its wake-ups,
        frame and copy confirmation, slowed the prefill more than it overlapped (a 200-token prompt of the tiny
        model, 1P1D on 2 cores: the prefill request took 5 to 6 ms longer than without a transfer when pushed per
        layer, 1 to 2 ms longer pushed whole)."""
        if not self._saves:
            return
        fence: Fence | None = None
        for spec in self._saves:
            if self._staged or spec.peer is None or not self._engine.peer_reads_in_place(
                    spec.peer.offset(self._at.slot)):
                if fence is None:
                    fence = self._blocks.fence()  # the layer is written: its copies out come after this
                self._push(spec, layer, fence)

    def wait_for_save(self) -> None:
        # The layers not pushed yet are pushed here (every layer, for host-memory KV a peer on this host reads in
        # place; otherwise those whose hook did not fire this step, none in normal runs), so no transfer is short.
        fence = self._blocks.fence() if self._saves else None  # every layer of this step's forward is queued
        for spec in self._saves:
            if spec.again:
                self._hold_again(spec, fence)
                continue
            if spec.peer is None:
                # GET: every layer is final now that the forward has run; hold the blocks for the pull.
                self._sending[spec.req_id] = spec
                self._offer(spec, fence)
                continue
            self._push_rest(spec, fence)
        if any(spec.inline and spec.peer is not None for spec in self._saves):
            self._engine.wait_sent(time.monotonic() + self._config.extra.transfer_timeout_s)
        for spec in self._saves:
            if spec.settle and spec.peer is not None and not spec.again and spec.transfer_id not in self._left:
                self._engine.wait_outgoing(spec.transfer_id, self._config.extra.transfer_timeout_s)

    def _offer(self, spec: SaveSpec, fence: Fence | None) -> None:
        """GET: hold the blocks for the decode side (and say where they lie, for cuda_ipc pulls; and which bytes
        hold which heads of which layers, for decode ranks of another tensor- or pipeline-parallel size). Whatever
        reads them comes after `fence`: vLLM's thread recorded it once the forward that wrote them was queued."""
        tid, ids = spec.transfer_id, spec.block_ids
        if tid in self._withdrawn:
            return
        if self._groups is not None:  # the decode side's load fails at once and computes the prompt
            log.warning("transfer %s: not held for a pull: KV of several cache groups is pushed only", tid)
            return
        # Checked before anything is set up for the offer (a GPU cache takes a host buffer here); a refusal that comes
        # later expires the offer in the engine (`TransferEngine.offer`, `OfferTable.refused`).
        if (refused := self._refused_puller(spec)) is not None:
            log.warning("transfer %s: not held for a pull: this worker refused the decode worker at %s (%s); its "
                        "prompt is computed there", tid, refused[0], refused[1])
            return

        def piece(wanted: tuple[int, int], layers: tuple[int, int] | None) -> BlockAccess:
            if layers is None:
                return self._slices.get(wanted)
            held = self._at.layers
            if not held.start <= layers[0] < layers[1] <= held.stop:
                raise IncompatiblePeerError(f"layers {layers[0]}..{layers[1]} asked for; this stage holds "
                                            f"{held.start}..{held.stop}")
            return self._slices.get(wanted, (layers[0] - held.start, layers[1] - held.start))

        def slice_places(wanted: tuple[int, int], layers: tuple[int, int] | None) -> PlaceSource | None:
            return piece(wanted, layers).offered_places(tid, ids, fence)

        self._engine.offer(tid, len(ids), self._blocks.source(tid, ids, fence), self._config.extra.lease_s,
                          self._blocks.offered_places(tid, ids, fence),
                          lambda wanted, layers: piece(wanted, layers).source(tid, ids, fence),
                          slice_places, _pullers(spec), spec.puller_launch)

    def _refused_puller(self, spec: SaveSpec) -> tuple[Address, str] | None:
        """A rank of the decode instance that will pull `spec` (GET) that this worker refused at its hello, and why."""
        for peer in _pullers(spec):
            reason = self._engine.refusal(peer, spec.puller_launch)
            if reason is not None:
                return peer, reason
        return None

    def _claim(self, spec: SaveSpec, layers: Iterable[int]) -> float:
        """Note `layers` of `spec` as pushed and its request as sending; the deadline of the pushes."""
        self._pushed[spec.transfer_id].update(layers)
        self._sending[spec.req_id] = spec
        return time.monotonic() + self._config.extra.transfer_timeout_s

    def _push(self, spec: SaveSpec, layer: int, fence: Fence | None) -> None:
        if spec.peer is None:
            return
        tid = spec.transfer_id
        pushed = self._pushed[tid]
        if layer in pushed:
            return
        peer = spec.peer.offset(self._at.slot)
        first = not pushed
        if first and push_or_pull(device_path=self._engine.pulls_instead(peer)).pulled:
            self._left.add(tid)  # decided once per transfer, at its first layer
        deadline = self._claim(spec, (layer,))
        if tid in self._left:  # the peer pulls over a device path: no copy to the host, no bytes
            self._engine.push_layer(tid, peer, layer, len(spec.block_ids), (), deadline, None, True, prompt=spec.prompt)
            return
        ids, skip = self._ids(spec, layer)
        try:
            views, ready = self._blocks.push_views(self._key(tid, layer), layer, ids, fence, self._held(layer))
        except NoPinnedSpace as exc:
            if first and self._groups is None and push_or_pull(pinned_space=False).pulled:  # the peer can pull
                log.info("transfer %s: %s; holding the blocks for a pull", tid, exc)
                self._left.add(tid)
                self._engine.push_layer(tid, peer, layer, len(spec.block_ids), (), deadline, None, True,
                                        prompt=spec.prompt)
                return
            log.error("transfer %s: layer %d: %s", tid, layer, exc)
            views, ready = (), _raiser(exc)
        except Exception as exc:  # a device error: this transfer fails, not the forward pass
            log.error("transfer %s: layer %d could not be copied from the device: %r", tid, layer, exc)
            views, ready = (), _raiser(exc)
        self._engine.push_layer(tid, peer, layer, len(spec.block_ids), views, deadline, ready, prompt=spec.prompt,
                                skip=skip, skips=self._skips(spec))

    def _key(self, tid: str, layer: int) -> str:
        """What the blocks' access knows a transfer's layer by: a group's layers have their own blocks, and so
        their own host buffers (a GPU cache)."""
        return tid if self._groups is None else f"{tid}#{self._groups[layer]}"

    def _held(self, layer: int) -> tuple[int, ...] | None:
        """The layers of `layer`'s group, which its transfer key stands for (`_key`)."""
        if self._groups is None:
            return None
        group = self._groups[layer]
        return tuple(at for at, of in enumerate(self._groups) if of == group)

    def _keys(self, tid: str) -> list[str]:
        """Every key `_key` gives the transfer's layers."""
        return [tid] if self._groups is None else [f"{tid}#{group}" for group in sorted(set(self._groups))]

    def _release(self, tid: str) -> None:
        for key in self._keys(tid):
            self._blocks.release(key)

    def _copied_out(self, tid: str) -> Marker | None:
        markers = [self._blocks.copied_out(key) for key in self._keys(tid)]
        return None if any(m is None for m in markers) else all_done([m for m in markers if m is not None])

    def _skips(self, spec: SaveSpec) -> tuple[int, ...]:
        """Every layer's blocks left out (`_ids`), where any layer leaves some out (`PushBlocks.skips`): the
        receiver stages only the blocks sent."""
        if self._groups is None or not spec.groups:
            return ()
        by_group = [min(leading_nulls(ids), len(ids) - 1) for ids in spec.groups]
        skips = tuple(by_group[group] for group in self._groups)
        return skips if any(skips) else ()

    def _ids(self, spec: SaveSpec, layer: int) -> tuple[tuple[int, ...], int]:
        """The blocks of `layer` to push: its group's, without those before a sliding window (vLLM's null block),
        and how many those are."""
        if self._groups is None or not spec.groups:
            return spec.block_ids, 0
        ids = spec.groups[self._groups[layer]]
        skip = min(leading_nulls(ids), len(ids) - 1)
        return ids[skip:], skip

    def _push_rest(self, spec: SaveSpec, fence: Fence | None) -> None:
        """The layers of `spec` not pushed yet. KV in host memory goes as one job per run of consecutive layers (one
        frame and one wake-up of the engine's sender; queueing 32 layers took this thread 17 us, against 35 us a job
        per layer, on the 2-core CI machine); a GPU cache's layers, whose copies to the host each have their own
        `ready`, and a transfer left for a pull go layer by layer."""
        pushed = self._pushed[spec.transfer_id]
        todo = [layer for layer in range(self._blocks.digest.num_layers) if layer not in pushed]
        if not todo or spec.peer is None:
            return
        peer = spec.peer.offset(self._at.slot)
        if (self._staged or spec.transfer_id in self._left or self._groups is not None
                or (not pushed and push_or_pull(device_path=self._engine.pulls_instead(peer)).pulled)):
            for layer in todo:
                self._push(spec, layer, fence)
            return
        try:
            got = [self._blocks.push_views(spec.transfer_id, layer, spec.block_ids) for layer in todo]
        except Exception:  # the careful path, which fails this transfer and not the forward pass
            got = []
        if len(got) != len(todo) or any(ready is not None for _, ready in got):  # not in place after all
            for layer in todo:
                self._push(spec, layer, fence)
            return
        views = [layer_views for layer_views, _ in got]
        deadline = self._claim(spec, todo)
        start = 0
        for end in range(1, len(todo) + 1):
            if end == len(todo) or todo[end] != todo[end - 1] + 1:
                self._engine.push_layers(spec.transfer_id, peer, todo[start], len(spec.block_ids), views[start:end],
                                        deadline, prompt=spec.prompt)
                start = end

    def _hold_again(self, spec: SaveSpec, fence: Fence | None) -> None:
        """A request preempted after its save has computed its prompt again, into other blocks: a transfer that was
        held for a pull (GET, a refused push, a pull over a device path) is offered again, from the new blocks. A
        push that went through needs nothing: the decode side has the bytes."""
        tid = spec.transfer_id
        out = self._engine.outgoing(tid)
        if tid not in self._withdrawn or (self._engine.offer_state(tid) is None
                                          and (out is None or out.state is not OutState.REFUSED)):
            return
        self._withdrawn.discard(tid)
        self._release(tid)  # what was read from the old blocks (host buffers of a GPU cache)
        self._slices.release(tid)
        self._sending[spec.req_id] = spec
        self._offer(spec, fence)
        log.info("transfer %s: its request computed its prompt again after a preemption; held again for a pull", tid)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        self._finished |= finished_req_ids & self._sending.keys()
        for spec in self._sending.values():
            tid = spec.transfer_id
            out = self._engine.outgoing(tid)
            if (out is not None and out.state is OutState.REFUSED and self._engine.offer_state(tid) is None
                    and tid not in self._withdrawn and self._groups is None):
                # The decode side had no room to stage the push: hold the blocks for it to pull instead.
                log.info("transfer %s: push refused (%s); holding the blocks for a pull", tid, out.reason)
                # On vLLM's thread, after the forward that wrote the blocks: a fence now comes after it.
                self._offer(spec, self._blocks.fence())
        done: set[str] = set()
        for req_id in self._finished:
            tid = self._sending[req_id].transfer_id
            offered = self._engine.offer_state(tid)
            if offered is not None:
                if offered in (OfferState.SERVED, OfferState.EXPIRED):
                    done.add(req_id)
                continue
            out = self._engine.outgoing(tid)
            # Freed only once nothing reads its bytes: a push that failed may still have layers in the sender's hands
            if (out is None or out.state is not OutState.SENDING) and not self._engine.push_reads(tid):
                done.add(req_id)
        for req_id in done:
            self._finished.discard(req_id)
            tid = self._sending.pop(req_id).transfer_id
            withdrawn = tid in self._withdrawn
            self._withdrawn.discard(tid)
            self._engine.forget_outgoing(tid)
            # A pull that comes later (its request was aborted, or preempted) is refused at once, not left waiting.
            self._engine.forget_offer(tid, "withdrawn" if withdrawn else None)
            self._release(tid)
            self._slices.release(tid)
        return done

    def transfers_of(self, req_ids: Iterable[str]) -> list[str]:
        """The transfers these requests are sending."""
        return [spec.transfer_id for req_id in req_ids if (spec := self._sending.get(req_id)) is not None]

    def preempted(self, transfer_ids: Iterable[str]) -> None:
        """Requests whose blocks are being sent were preempted: vLLM has freed their blocks, and this step's forward
        may write other KV into them. A push goes on from the host buffers its layers were copied into, once those
        copies are done (a GPU cache); one that reads the blocks themselves (KV in host memory) is waited for (it
        ends by its deadline). Blocks held for a pull are withdrawn, and are not offered later, so the decode side's
        pull fails (it recomputes) rather than read other KV."""
        for tid in transfer_ids:
            self._withdrawn.add(tid)
            out = self._engine.outgoing(tid)
            if out is not None and out.state is OutState.SENDING:
                copied = self._copied_out(tid)
                deadline = out.deadline if copied is None else time.monotonic() + self._config.extra.transfer_timeout_s
                if copied is None:
                    self._engine.wait_outgoing(tid, max(0.0, deadline - time.monotonic()))
                elif not wait_marker(copied, deadline):
                    log.error("transfer %s: the copies out of a preempted request's blocks are still running", tid)
            if not self._engine.withdraw_offer(tid, time.monotonic() + self._config.extra.transfer_timeout_s):
                log.error("transfer %s: a pull still reads the blocks of a preempted request", tid)
            log.info("transfer %s: its request was preempted; nothing reads its blocks any more", tid)
