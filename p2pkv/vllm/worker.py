"""Worker side of the connector: registers the KV cache with a transfer engine, pushes saved layers or holds them
for pulls, and reports what finished; loading is `p2pkv.vllm.loads`."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import msgspec

from p2pkv.config import ConnectorConfig, Transport
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.device import Fence, PlaceSource
from p2pkv.engine.offers import OfferState
from p2pkv.engine.sender import OutState
from p2pkv.errors import IncompatiblePeerError
from p2pkv.kv.blocks import BlockAccess, InPlaceBlocks
from p2pkv.kv.buffers import TransferBuffers
from p2pkv.kv.device_copy import DeviceOps, NoPinnedSpace
from p2pkv.kv.ipc import CacheAccess
from p2pkv.kv.layers import prepare_layers
from p2pkv.kv.layout import KvBlocks
from p2pkv.kv.pipes import make_pipes
from p2pkv.kv.slices import HeadSlices
from p2pkv.kv.stages import StageLayers
from p2pkv.kv.staging import STAGE_ENV, DeviceKv
from p2pkv.memory.huge import HugePageFiller
from p2pkv.params import Address
from p2pkv.vllm.loads import Loads, Placement
from p2pkv.vllm.metadata import P2pkvMetadata, SaveSpec, Wanted
from p2pkv.vllm.refusals import RefusalNotes, RefusalReporter

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.005  # at most this long per empty step, at most 200 empty steps a second


def _kernel_tag(t: torch.Tensor) -> str:
    import torch

    if t.device.type == "cpu":
        return f"cpu:{torch.backends.cpu.get_cpu_capability()!s}"
    return str(t.device.type)


def _layer_number(name: str) -> int:
    """The model's index of a layer from vLLM's name for it ("model.layers.12.self_attn.attn" -> 12); 0 for a
    name without one."""
    return next((int(part) for part in name.split(".") if part.isdigit()), 0)


def _raiser(exc: Exception) -> Callable[[float], bool]:
    def ready(_deadline: float) -> bool:
        raise exc

    return ready


def _pullers(spec: SaveSpec) -> tuple[Address, ...]:
    """The listeners of the decode ranks that will pull `spec` (GET), where the scheduler knows them."""
    if spec.pulled_by is None:
        return ()
    return tuple(spec.pulled_by.offset(rank) for rank in range(spec.pullers or 1))


class WorkerSide:
    def __init__(self, config: ConnectorConfig, rank: int, block_size: int, tp_size: int = 1,
                 total_heads: int = 0, pp_rank: int = 0, pp_size: int = 1, total_layers: int = 0,
                 stage_layers: StageLayers | None = None, model: str = "",
                 weights: Callable[[], str] | None = None, *, num_blocks: int = 0,
                 device_ops: DeviceOps | None = None) -> None:
        """`rank`: the tensor-parallel rank; `pp_rank`: the pipeline stage, whose ranks come after the earlier
        stages' (the worker binds `kv_port + pp_rank * tp_size + rank`, as vLLM numbers its workers).
        `total_layers` and `stage_layers` (which layers a stage holds): how the model's layers split over stages,
        for prefill instances of another pipeline-parallel size (not known: such loads fail). `model`: what the
        KV's values depend on beyond its shape (`p2pkv.vllm.model_factors`), compared with each peer's; `weights`
        adds the weights' factor to it when the cache is registered (the model is loaded by then). `num_blocks`:
        vLLM's block count (`KVCacheConfig.num_blocks`), from which kernel blocks are regrouped into vLLM's;
        `device_ops`: what issues a device cache's copies (the tests' recording layers; by default torch's)."""
        self._config = config
        self._at = Placement(rank, tp_size, pp_rank, pp_size, total_heads, range(0), total_layers, stage_layers)
        self._refusals = RefusalReporter(self._at.slot)
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._device_ops = device_ops
        self._model = model
        self._weights = weights
        self._engine: TransferEngine | None = None
        self._blocks: BlockAccess | None = None
        self._slices = HeadSlices()
        self._layer_index: dict[str, int] = {}
        self._meta = P2pkvMetadata()
        self._pushed: dict[str, set[int]] = {}
        self._left: set[str] = set()  # this step's transfers left for the peer to pull (it asked: device path)
        self._sending: dict[str, str] = {}
        self._specs: dict[str, SaveSpec] = {}
        self._finished: set[str] = set()
        # transfers of preempted (or aborted) requests: not offered again, unless a preempted one saves again
        self._withdrawn: set[str] = set()
        self._loading: Loads | None = None
        # KV behind a device copy (a GPU's): every layer is pushed as the forward computes it, whatever the link,
        # so that the copy overlaps the compute (see `save_layer` for host KV).
        self._staged = False
        self.huge_pages: HugePageFiller | None = None  # the KV cache's pages, made huge by register_kv_caches

    @property
    def engine(self) -> TransferEngine:
        assert self._engine is not None, "register_kv_caches has not run"
        return self._engine

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = prepare_layers(kv_caches, self._num_blocks, self._block_size, lambda n: (_layer_number(n), n))
        names, tensors = layers.names, layers.tensors
        extra = self._config.extra
        kernel = _kernel_tag(tensors[0])
        device, access, pipes = None, None, None
        if tensors[0].device.type != "cpu" or os.environ.get(STAGE_ENV) == "1":
            # KV the engine cannot address in place (a GPU's): through host buffers, and pulls by reference.
            device = DeviceKv(tensors, self._block_size, kernel, extra.transfer_timeout_s, self._at.total_heads,
                              self._device_ops)
            self._blocks, access = TransferBuffers(device), CacheAccess(device)
            self._staged = True
            pipes = make_pipes(device, extra.kv_host, extra.nccl_num_channels)
        else:
            if extra.huge_pages and extra.transport in (Transport.AUTO, Transport.SHM):
                # Peers on this host copy from it with the kernel's cross-process copy, twice as fast out of 2 MiB
                # pages; vLLM has just zeroed it, and nothing writes to it before its first forward.
                self.huge_pages = HugePageFiller(
                    (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors)
                self.huge_pages.start()
            self._blocks = InPlaceBlocks(KvBlocks.from_tensors(tensors, self._block_size, kernel,
                                                               self._at.total_heads))
        self._slices = HeadSlices(tensors, self._block_size, kernel, self._blocks, device)
        self._layer_index = dict(layers.index)
        # Peers compare which layers they hold: a pipeline stage must talk to the same stage of the other side, or
        # (another pipeline-parallel size) pull only layers both hold. Layers that share a cache (KV sharing) are
        # moved once: such a model's layers are not matched across pipeline-parallel sizes.
        first = _layer_number(names[0])
        held = range(first, first + len(tensors))
        in_order = ([_layer_number(n) for n in names] == list(held) and held.stop <= self._at.total_layers
                    and not layers.aliases)
        self._at = replace(self._at, layers=held, total_layers=self._at.total_layers if in_order else 0)
        metrics_port = extra.metrics_port + self._at.slot if extra.metrics_port else 0
        settings = replace(EngineSettings.from_config(extra, self._config.worker_port(self._at.slot), metrics_port),
                           launch=self._config.launch, pinned_staging=device is not None and device.on_gpu)
        factors = ";".join(f for f in (self._model, self._weights() if self._weights else "") if f)
        digest = msgspec.structs.replace(self._blocks.digest, first_layer=first, total_layers=self._at.total_layers,
                                         model=factors)
        self._engine = TransferEngine(settings, digest, self._at.slot, access, pipes)
        self._engine.metrics.intervals = True  # vLLM takes them every step (take_stats)
        if device is not None:
            device.pool, device.metrics = self._engine.pool, self._engine.metrics
            if self._engine.pool is not None and device.on_gpu:
                self._engine.pool.prepare()  # pinning takes about 0.5 s per GiB: at start-up, not in a transfer
        self._engine.start()
        self._loading = Loads(self._config, self._engine, self._blocks, self._slices, self._at)

    def bind(self, meta: P2pkvMetadata) -> None:
        self._meta = meta
        self._pushed = {s.transfer_id: set() for s in meta.saves}
        self._left = set()
        if meta.reset:
            dropped = self.engine.store.drop_all("dropped by a cache reset (its KV predates it)")
            log.info("cache reset: dropped %d staged transfers", dropped)
        # vLLM binds after it queued the zeroing of newly allocated blocks: copies into this step's loads' blocks
        # come after this fence.
        self.loading.start(meta.loads, self.blocks.fence() if meta.loads else None)
        self.loading.discard(meta.discards)
        if meta.abandoned:
            self._abandon(meta.abandoned)
        if meta.wanted:
            self._keep(meta.wanted)
        for reason in meta.computed_here:
            self.engine.metrics.of(self.engine.metrics.computed_here, reason).inc()

    def _keep(self, wanted: list[Wanted]) -> None:
        """Requests still wait for blocks: their staged pushes are kept on every rank, and rank 0 asks each rank of
        their prefill instances to keep holding the blocks of those held for a pull."""
        deadline = time.monotonic() + self._config.extra.transfer_timeout_s
        for keep in wanted:
            self.engine.store.touch(keep.transfer_ids)
            if self._at.slot == 0:
                for rank in range(keep.prefill_ranks):
                    self.engine.renew_leases(keep.prefill.offset(rank), keep.transfer_ids, deadline)

    def _abandon(self, transfer_ids: list[str]) -> None:
        """Transfers whose request was aborted: nobody will pull them, so their blocks are no longer offered (nor
        offered later, should the push be refused) and go back to vLLM once a push in flight is done."""
        sending = set(self._sending.values())
        for tid in transfer_ids:
            if tid not in sending:
                continue
            self._withdrawn.add(tid)
            if not self.engine.offers.withdraw(tid, time.monotonic()):
                log.info("transfer %s: a pull reads the blocks of an aborted request; they go when it is done", tid)
            log.info("transfer %s: its request was aborted; nothing will pull its blocks", tid)

    def save_layer(self, layer_name: str) -> None:
        """A layer of this step's forward is computed: its blocks are pushed now, so that the device copy (KV on a
        GPU) or the wire (a peer on another host) overlaps the next layers' compute. Except with KV in host memory
        (vLLM's CPU build) for a peer on this host that reads it in place (shm): nothing is pushed until
        `wait_for_save`, when the forward is over. There the peer's copy is one cheap system call, while the
        transfer's threads share the cores and the GIL with the forward: a push per layer, with its wake-ups,
        frame and copy confirmation, slowed the prefill more than it overlapped (a 200-token prompt of the tiny
        model, 1P1D on 2 cores: the prefill request took 5 to 6 ms longer than without a transfer when pushed per
        layer, 1 to 2 ms longer pushed whole)."""
        layer = self._layer_index.get(layer_name)
        if layer is None or not self._meta.saves:
            return
        fence: Fence | None = None
        for spec in self._meta.saves:
            if self._staged or spec.peer is None or not self.engine.peer_reads_in_place(
                    spec.peer.offset(self._at.slot)):
                if fence is None:
                    fence = self.blocks.fence()  # the layer is written: its copies out come after this
                self._push(spec, layer, fence)

    @property
    def loading(self) -> Loads:
        assert self._loading is not None, "register_kv_caches has not run"
        return self._loading

    @property
    def blocks(self) -> BlockAccess:
        assert self._blocks is not None, "register_kv_caches has not run"
        return self._blocks

    def _offer(self, spec: SaveSpec, fence: Fence | None) -> None:
        """GET: hold the blocks for the decode side (and say where they lie, for cuda_ipc pulls; and which bytes
        hold which heads of which layers, for decode ranks of another tensor- or pipeline-parallel size). Whatever
        reads them comes after `fence`: vLLM's thread recorded it once the forward that wrote them was queued."""
        tid, ids = spec.transfer_id, spec.block_ids
        if tid in self._withdrawn:
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

        self.engine.offer(tid, len(ids), self.blocks.source(tid, ids, fence), self._config.extra.lease_s,
                          self.blocks.offered_places(tid, ids, fence),
                          lambda wanted, layers: piece(wanted, layers).source(tid, ids, fence),
                          slice_places, _pullers(spec), spec.puller_launch)

    def _refused_puller(self, spec: SaveSpec) -> tuple[Address, str] | None:
        """A rank of the decode instance that will pull `spec` (GET) that this worker refused at its hello, and why."""
        for peer in _pullers(spec):
            reason = self.engine.refusal(peer, spec.puller_launch)
            if reason is not None:
                return peer, reason
        return None

    def _claim(self, spec: SaveSpec, layers: Iterable[int]) -> float:
        """Note `layers` of `spec` as pushed and its request as sending; the deadline of the pushes."""
        self._pushed[spec.transfer_id].update(layers)
        self._sending[spec.req_id] = spec.transfer_id
        self._specs[spec.req_id] = spec
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
        if first and self.engine.pulls_instead(peer):
            self._left.add(tid)  # decided once per transfer, at its first layer
        deadline = self._claim(spec, (layer,))
        if tid in self._left:  # the peer pulls over a device path: no copy to the host, no bytes
            self.engine.push_layer(tid, peer, layer, len(spec.block_ids), (), deadline, None, True)
            return
        try:
            views, ready = self.blocks.push_views(tid, layer, spec.block_ids, fence)
        except NoPinnedSpace as exc:
            if first:  # nothing sent yet: the blocks are held for the peer to pull instead
                log.info("transfer %s: %s; holding the blocks for a pull", tid, exc)
                self._left.add(tid)
                self.engine.push_layer(tid, peer, layer, len(spec.block_ids), (), deadline, None, True)
                return
            log.error("transfer %s: layer %d: %s", tid, layer, exc)
            views, ready = (), _raiser(exc)
        except Exception as exc:  # a device error: this transfer fails, not the forward pass
            log.error("transfer %s: layer %d could not be copied from the device: %r", tid, layer, exc)
            views, ready = (), _raiser(exc)
        self.engine.push_layer(tid, peer, layer, len(spec.block_ids), views, deadline, ready)

    def _push_rest(self, spec: SaveSpec, fence: Fence | None) -> None:
        """The layers of `spec` not pushed yet. KV in host memory goes as one job per run of consecutive layers (one
        frame and one wake-up of the engine's sender; queueing 32 layers took this thread 17 us, against 35 us a job
        per layer, on the 2-core CI machine); a GPU cache's layers, whose copies to the host each have their own
        `ready`, and a transfer left for a pull go layer by layer."""
        pushed = self._pushed[spec.transfer_id]
        todo = [layer for layer in range(self.blocks.digest.num_layers) if layer not in pushed]
        if not todo or spec.peer is None:
            return
        peer = spec.peer.offset(self._at.slot)
        if self._staged or spec.transfer_id in self._left or (not pushed and self.engine.pulls_instead(peer)):
            for layer in todo:
                self._push(spec, layer, fence)
            return
        try:
            got = [self.blocks.push_views(spec.transfer_id, layer, spec.block_ids) for layer in todo]
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
                self.engine.push_layers(spec.transfer_id, peer, todo[start], len(spec.block_ids), views[start:end],
                                        deadline)
                start = end

    def wait_for_save(self) -> None:
        # The layers not pushed yet are pushed here (every layer, for host-memory KV a peer on this host reads in
        # place; otherwise those whose hook did not fire this step, none in normal runs), so no transfer is short.
        fence = self.blocks.fence() if self._meta.saves else None  # every layer of this step's forward is queued
        for spec in self._meta.saves:
            if spec.again:
                self._hold_again(spec, fence)
                continue
            if spec.peer is None:
                # GET: every layer is final now that the forward has run; hold the blocks for the pull.
                self._sending[spec.req_id] = spec.transfer_id
                self._offer(spec, fence)
                continue
            self._push_rest(spec, fence)
        if any(spec.inline and spec.peer is not None for spec in self._meta.saves):
            self.engine.wait_sent(time.monotonic() + self._config.extra.transfer_timeout_s)

    def _hold_again(self, spec: SaveSpec, fence: Fence | None) -> None:
        """A request preempted after its save has computed its prompt again, into other blocks: a transfer that was
        held for a pull (GET, a refused push, a pull over a device path) is offered again, from the new blocks. A
        push that went through needs nothing: the decode side has the bytes."""
        tid = spec.transfer_id
        out = self.engine.outgoing(tid)
        if tid not in self._withdrawn or (self.engine.offer_state(tid) is None
                                          and (out is None or out.state is not OutState.REFUSED)):
            return
        self._withdrawn.discard(tid)
        self.blocks.release(tid)  # what was read from the old blocks (host buffers of a GPU cache)
        self._slices.release(tid)
        self._sending[spec.req_id] = tid
        self._specs[spec.req_id] = spec
        self._offer(spec, fence)
        log.info("transfer %s: its request computed its prompt again after a preemption; held again for a pull", tid)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._engine is None:
            return None, None
        # A lease counts from when vLLM finishes the request, whose answer names the transfer: until then (a prefill
        # request that goes on decoding) nobody can pull, so its offer is held for as long as it runs.
        unanswered = [tid for req_id, tid in self._sending.items() if req_id not in self._finished]
        if unanswered:
            self._engine.offers.renew(unanswered)
        self._engine.housekeeping()
        sent, loaded = self._finished_sending(finished_req_ids), self.loading.finished(finished_req_ids)
        if self._meta.idle and not sent and not loaded and (self._sending or self.loading.pending):
            # vLLM steps without pause while transfers are in flight, even with nothing to compute: on such an
            # empty step, wait a moment for a transfer to finish instead of returning at once. Each spinning step
            # costs every rank a core (and, with tensor parallelism, a collective), which the transfers' own
            # threads need. Blocks held for a pull or a push in flight: the peer's pace.
            if not self.loading.wait(IDLE_WAIT_S):
                time.sleep(IDLE_WAIT_S)
        return sent or None, loaded or None

    def _finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        self._finished |= finished_req_ids & self._sending.keys()
        for req_id, tid in self._sending.items():
            out = self.engine.outgoing(tid)
            if (out is not None and out.state is OutState.REFUSED and self.engine.offer_state(tid) is None
                    and tid not in self._withdrawn):
                # The decode side had no room to stage the push: hold the blocks for it to pull instead.
                spec = self._specs[req_id]
                log.info("transfer %s: push refused (%s); holding the blocks for a pull", tid, out.reason)
                # On vLLM's thread, after the forward that wrote the blocks: a fence now comes after it.
                self._offer(spec, self.blocks.fence())
        done: set[str] = set()
        for req_id in self._finished:
            tid = self._sending[req_id]
            offered = self.engine.offer_state(tid)
            if offered is not None:
                if offered in (OfferState.SERVED, OfferState.EXPIRED):
                    done.add(req_id)
                continue
            out = self.engine.outgoing(tid)
            if out is None or out.state is not OutState.SENDING:
                done.add(req_id)
        for req_id in done:
            self._finished.discard(req_id)
            tid = self._sending.pop(req_id)
            self._specs.pop(req_id, None)
            withdrawn = tid in self._withdrawn
            self._withdrawn.discard(tid)
            self.engine.forget_outgoing(tid)
            # A pull that comes later (its request was aborted, or preempted) is refused at once, not left waiting.
            self.engine.offers.forget(tid, "withdrawn" if withdrawn else None)
            self.blocks.release(tid)
            self._slices.release(tid)
        return done

    def transfers_of(self, req_ids: Iterable[str]) -> list[str]:
        """The transfers these requests are sending."""
        return [tid for req_id in req_ids if (tid := self._sending.get(req_id)) is not None]

    def handle_preemptions(self, transfer_ids: Iterable[str]) -> None:
        """Requests whose blocks are being sent were preempted: vLLM has freed their blocks, and this step's forward
        may write other KV into them. A push still reading them is waited for (it ends by its deadline); blocks held
        for a pull are withdrawn, and are not offered later, so the decode side's pull fails (it recomputes) rather
        than read other KV."""
        if self._engine is None:
            return
        for tid in transfer_ids:
            self._withdrawn.add(tid)
            out = self.engine.outgoing(tid)
            if out is not None and out.state is OutState.SENDING:
                self.engine.wait_outgoing(tid, max(0.0, out.deadline - time.monotonic()))
            if not self.engine.offers.withdraw(tid, time.monotonic() + self._config.extra.transfer_timeout_s):
                log.error("transfer %s: a pull still reads the blocks of a preempted request", tid)
            log.info("transfer %s: its request was preempted; nothing reads its blocks any more", tid)

    def take_stats(self) -> dict[str, Any] | None:
        """What the engine counted since the last step: transfers, bytes, transfer times."""
        return self._engine.metrics.take_interval() if self._engine is not None else None

    def refusals(self) -> RefusalNotes | None:
        """The peers this worker refused at their hello, when that changed since the last step (for the heartbeats
        that tell the proxy: `p2pkv.vllm.refusals`)."""
        return self._refusals.report(self._engine.refused) if self._engine is not None else None

    def take_load_errors(self) -> set[int]:
        return self._loading.take_errors() if self._loading is not None else set()

    def shutdown(self) -> None:
        if self.huge_pages is not None:
            self.huge_pages.close()
        if self._engine is not None:
            self._engine.close()
