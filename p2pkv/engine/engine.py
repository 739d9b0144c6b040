"""The transfer engine of one worker: wires the listener, receive store, sender and metrics together."""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from p2pkv.config import ExtraConfig, Transport
from p2pkv.engine.device import CacheDigest, DeviceAccess, Fence, PipeMaker, PlaceSource
from p2pkv.engine.handshake import local_offer
from p2pkv.engine.lanes import IDLE_S, PullLanes
from p2pkv.engine.metrics import EngineMetrics
from p2pkv.engine.offers import OfferState, OfferTable, SlicePlaces, Slicer, ViewSource
from p2pkv.engine.puller import HeadSlice, Puller, PullJob, PullResult, Renewal
from p2pkv.engine.receiver import Receiver
from p2pkv.engine.refused import RefusedPeers
from p2pkv.engine.sender import Outgoing, PushJob, Sender
from p2pkv.engine.store import ReceiveStore, StagedTransfer, StageState
from p2pkv.memory import HostPool
from p2pkv.params import Address
from p2pkv.protocol import DeviceHome, FrameLimits, Hello, LayoutDigest
from p2pkv.transport.base import Connection
from p2pkv.transport.tcp import TcpConnection, TcpListener
from p2pkv.way import WhyPull

log = logging.getLogger(__name__)
_LOOPBACK = ("127.", "::1", "localhost")


@dataclass(frozen=True)
class EngineSettings:
    host: str
    port: int
    secret: bytes
    staging_budget_bytes: int
    staging_expiry_s: float
    transfer_timeout_s: float
    connect_timeout_s: float
    metrics_port: int
    limits: FrameLimits
    pool_bytes: int = 0
    pool_pinned_bytes: int = 0  # of the pool, pinned by `pin_pool` (a GPU cache's worker, at start-up)
    transport: Transport = Transport.AUTO
    pull_over_device: bool = True
    integrity_check: bool = False
    towards: str = ""  # the proxy's host, if any: a wildcard `host` is named by this host's address on its route
    launch: str = ""  # this start of the instance (`p2pkv.config.launch_of`), said in the hello
    # KV on a GPU: the staging store's first tier (kv_buffer_size) is pinned too, so pushed bytes land in the cache
    # with copies that never wait for the host.
    pinned_staging: bool = False
    pull_lane_idle_s: float = IDLE_S  # a puller idle this long ends (`p2pkv.engine.lanes`)
    max_connections: int = 256  # peer connections the listener serves at once; more are closed at once
    connection_idle_s: float = 300.0  # a peer connection with no frame for this long is closed
    switch_interval_s: float = 0.0  # the interpreter's switch interval is lowered to this at start (0: left alone)

    @classmethod
    def from_config(cls, extra: ExtraConfig, port: int, metrics_port: int) -> EngineSettings:
        return cls(
            host=extra.kv_host,
            port=port,
            secret=extra.auth_secret.encode(),
            staging_budget_bytes=int(extra.kv_buffer_size),
            staging_expiry_s=extra.staging_expiry_s,
            transfer_timeout_s=extra.transfer_timeout_s,
            connect_timeout_s=extra.connect_timeout_s,
            metrics_port=metrics_port,
            limits=FrameLimits(max_message_bytes=extra.max_frame_bytes),
            pool_bytes=int(extra.mem_pool_size_gb * (1 << 30)),
            pool_pinned_bytes=int(min(extra.mem_pool_pinned_gb, extra.mem_pool_size_gb) * (1 << 30)),
            transport=extra.transport,
            pull_over_device=extra.pull_over_device,
            integrity_check=extra.integrity_check,
            towards=extra.proxy_host,
            max_connections=extra.max_connections,
            connection_idle_s=extra.connection_idle_s,
            switch_interval_s=extra.switch_interval_ms / 1000,
        )


def lower_switch_interval(seconds: float) -> None:
    """Lower the interpreter's switch interval to `seconds` (0: leave it). A thread that runs Python without pause
    (vLLM's, between the steps it launches) keeps the interpreter lock that long each time an engine thread wants it
    back after a system call: 5 ms by default, which made a 64 KiB transfer take up to 6.4 ms here."""
    if 0 < seconds < sys.getswitchinterval():
        log.info("interpreter switch interval lowered from %.1f to %.1f ms (switch_interval_ms), so that the "
                 "KV transfer threads are not held off for long by a busy thread", sys.getswitchinterval() * 1000,
                 seconds * 1000)
        sys.setswitchinterval(seconds)


class TransferEngine:
    """`start()` binds and starts threads; `close()` stops them in reverse order and is idempotent."""

    def __init__(self, settings: EngineSettings, layout: LayoutDigest, rank: int = 0,
                 device: DeviceAccess | None = None, pipes: PipeMaker | None = None, intervals: bool = False,
                 pool: HostPool | None = None) -> None:
        """`device`: this worker's KV cache as peers on this host may open it (cuda_ipc), when it is on a GPU;
        `pipes`: what makes a communicator with a peer (nccl), when this worker can; `intervals`: someone takes
        `take_interval` (vLLM's per-step stats); `pool`: the host pool (by default one of `settings.pool_bytes`)."""
        self.settings = settings
        self.device = device
        self.pipes = pipes
        self.layout = layout
        self.rank = rank
        self.engine_id = uuid.uuid4().hex[:12]
        self.metrics = EngineMetrics()
        self.metrics.intervals = intervals
        # The pool's memory is taken on first use only, when staging first overflows kv_buffer_size.
        if pool is None and settings.pool_bytes >= 4096:
            pool = HostPool(settings.pool_bytes)
        self.pool = pool
        self.store = ReceiveStore(settings.staging_budget_bytes, settings.staging_expiry_s, layout.block_bytes,
                                  layout.num_layers, self.metrics, self.pool, pinned=settings.pinned_staging)
        self.offers = OfferTable()
        self.refused = RefusedPeers()  # peers refused at their hello, by the address of their own listener
        self._receiver: Receiver | None = None
        self._sender: Sender | None = None
        self._puller: PullLanes | None = None
        self._metrics_server: object | None = None
        self._metrics_thread: threading.Thread | None = None
        self._closed = False
        self.address = ""

    def start(self) -> None:
        s = self.settings
        lower_switch_interval(s.switch_interval_s)
        if not s.secret and not s.host.startswith(_LOOPBACK):
            log.warning("the KV port binds %s without auth_secret: anyone who reaches it can push KV", s.host)
        listener = TcpListener(s.host, s.port, s.secret, s.limits)
        self.address = listener.address
        # shm (same-host peers read each other's memory directly) unless tcp is asked for; peers on other hosts,
        # or where it cannot be set up, use tcp.
        offer = local_offer() if s.transport is not Transport.TCP else None
        if s.transport is Transport.SHM and offer is None:
            log.warning("transport shm: cross-memory attach is not available here; using tcp")
        device = self.device if s.transport in (Transport.AUTO, Transport.CUDA_IPC) else None
        if s.transport is Transport.CUDA_IPC and device is None:
            log.warning("transport cuda_ipc: the KV cache is not on a GPU; using shm or tcp")
        export = None
        if device is not None:
            try:
                export = device.export()
            except Exception as exc:  # e.g. memory CUDA IPC cannot share: pulls carry bytes instead
                log.warning("the KV cache cannot be exported for cuda_ipc (%r); pulls will carry bytes", exc)
                device = None
        pipes = self.pipes if s.transport in (Transport.AUTO, Transport.NCCL) else None
        if s.transport is Transport.NCCL and pipes is None:
            log.warning("transport nccl: this worker cannot make NCCL pipes (no GPU KV, or no CuPy); using shm or tcp")
        cache_digest = self._cache_digest(device, pipes)
        # With a secret, payloads are covered by the signed frames through their digests, whatever integrity_check.
        digests = s.integrity_check or bool(s.secret)
        self._receiver = Receiver(listener, store=self.store, offers=self.offers, layout=self.layout,
                                  metrics=self.metrics, frame_timeout_s=s.transfer_timeout_s, offer=offer,
                                  device=export, pipes=pipes, pipe_setup_s=s.connect_timeout_s,
                                  pulls_over_device=self._pull_rule(device, pipes), digests=digests,
                                  cache_digest=cache_digest, refused=self.refused,
                                  max_connections=s.max_connections, idle_s=s.connection_idle_s)
        self._receiver.start()
        hello = Hello(engine_id=self.engine_id, rank=self.rank, layout=self.layout, cma=offer,
                      device_kind=device.kind if device is not None else "",
                      pipe_kind=pipes.kind if pipes is not None else "",
                      home=DeviceHome(export.kind, export.boot_id, export.device) if export is not None else None,
                      digests=digests, kv_address=str(Address.advertised(s.host, listener.port, s.towards)),
                      launch=s.launch)
        require_shm = s.transport is Transport.SHM
        self._sender = Sender(self._connect, hello, self.metrics, require_shm)
        self._sender.start()
        self._puller = PullLanes(lambda: Puller(self._connect, hello, self.metrics, require_shm, device, pipes,
                                                s.connect_timeout_s, cache_digest), idle_s=s.pull_lane_idle_s)
        self._puller.start()
        if s.metrics_port:
            from prometheus_client import start_http_server

            self._metrics_server, self._metrics_thread = start_http_server(
                s.metrics_port, addr=s.host, registry=self.metrics.registry)
        log.info("p2pkv engine %s rank %d listening on %s", self.engine_id, self.rank, self.address)

    def pin_pool(self) -> None:
        """Pin the first `pool_pinned_bytes` of the host pool now (a GPU cache's worker, at start-up: pinning takes
        about 0.5 s per GiB, and a transfer that finds none pinned is held for a pull instead)."""
        if self.pool is not None and self.settings.pool_pinned_bytes > 0:
            self.pool.prepare(up_to=self.settings.pool_pinned_bytes)

    def _cache_digest(self, device: DeviceAccess | None, pipes: PipeMaker | None) -> CacheDigest | None:
        """How this worker digests pieces of its cache, for pulls that copy cache to cache on a link that checks
        digests (integrity_check on either side). A cache in host memory (host_ipc, gloo pipes) is digested on
        both sides; a GPU cache's pulls (cuda_ipc, nccl) are not checked."""
        access = device if device is not None else pipes
        if access is None:
            return None
        gpu = (device is not None and device.kind == "cuda") or (pipes is not None and pipes.kind == "nccl")
        if self.settings.integrity_check and gpu:
            log.warning("integrity_check: pulls that copy GPU cache to GPU cache (cuda_ipc, nccl) carry no digest; "
                        "bytes sent as frames (tcp, shm, and pushes staged from a GPU) are checked")
        return access.bytes_digest

    def _pull_rule(self, device: DeviceAccess | None, pipes: PipeMaker | None) -> Callable[[Hello], bool] | None:
        """When this worker asks a client to leave its pushes for a pull (`pull_over_device`): it can open the
        client's exported cache (cuda_ipc), or both make pipes of one kind (nccl). Pulls over those copy cache to
        cache; pushes of device KV go through host buffers."""
        if not self.settings.pull_over_device or (device is None and pipes is None):
            return None

        def rule(hello: Hello) -> bool:
            if pipes is not None and hello.pipe_kind == pipes.kind:
                return True
            return device is not None and hello.home is not None and device.reaches(hello.home)

        return rule

    def _connect(self, peer: Address, deadline: float) -> Connection:
        deadline = min(deadline, time.monotonic() + self.settings.connect_timeout_s)
        return TcpConnection.connect(peer, deadline, self.settings.secret, self.settings.limits)

    @property
    def _out(self) -> Sender:
        if self._sender is None:
            raise RuntimeError("engine not started")
        return self._sender

    @property
    def _lanes(self) -> PullLanes:
        if self._puller is None:
            raise RuntimeError("engine not started")
        return self._puller

    # Sending side.
    def push_layer(self, transfer_id: str, peer: Address, layer: int, total_blocks: int,
                   views: tuple[memoryview, ...], deadline: float,
                   ready: Callable[[float], bool] | None = None, pull_instead: bool = False,
                   prompt: str = "", skip: int = 0, skips: tuple[int, ...] = ()) -> None:
        """Queue one layer; `ready` (staged device KV) is called with the deadline before it is sent, and must
        return True once `views` hold the layer's bytes. `pull_instead` (no views): the transfer is not pushed;
        the peer is told to pull it (`pulls_instead`), and the transfer ends refused, holding the blocks. `prompt`:
        the digest of the prompt the KV was computed for, told to the receiver (`PushBlocks.prompt`); `skip`: the
        blocks at the layer's start left out, outside its sliding window (`views` hold the others); `skips`: every
        layer's, where any is not 0 (the same in every layer's call)."""
        self._out.submit(PushJob(transfer_id, peer, layer, self.layout.num_layers, total_blocks, views, deadline,
                                    ready, pull_instead, prompt=prompt, skip=skip, skips=skips))

    def push_layers(self, transfer_id: str, peer: Address, first_layer: int, total_blocks: int,
                    layer_views: Sequence[tuple[memoryview, ...]], deadline: float, prompt: str = "") -> None:
        """Queue consecutive layers at once, from `first_layer`, whose bytes are ready (KV in host memory): one job
        and one frame for them, where `push_layer` costs a job each."""
        if not layer_views:
            return
        self._out.submit(PushJob(transfer_id, peer, first_layer, self.layout.num_layers, total_blocks,
                                    tuple(v for views in layer_views for v in views), deadline,
                                    layers=len(layer_views), prompt=prompt))

    def pulls_instead(self, peer: Address) -> bool:
        """The link to `peer` is up and its receiver pulls over a device path: push nothing, leave the blocks."""
        return self._out.pulls_instead(peer)

    def peer_reads_in_place(self, peer: Address) -> bool:
        """The link to `peer` is up and the peer reads our payloads from our memory (shm): a push costs us a frame."""
        return self._out.peer_reads_in_place(peer)

    def wait_sent(self, deadline: float) -> bool:
        return self._out.wait_idle(deadline)

    def outgoing(self, transfer_id: str) -> Outgoing | None:
        return self._out.poll(transfer_id)

    def wait_outgoing(self, transfer_id: str, timeout_s: float) -> Outgoing | None:
        """Block until the transfer has finished (or `timeout_s` passed); None for an unknown id."""
        return self._out.wait(transfer_id, time.monotonic() + timeout_s)

    def push_reads(self, transfer_id: str) -> bool:
        """Whether a push may still read the transfer's bytes (`Sender.reads`): they are not to be freed yet."""
        return self._out.reads(transfer_id)

    def forget_outgoing(self, transfer_id: str) -> None:
        self._out.forget(transfer_id)

    # GET mode.
    def offer(self, transfer_id: str, total_blocks: int, source: ViewSource, lease_s: float,
              places: PlaceSource | None = None, slicer: Slicer | None = None,
              slice_places: SlicePlaces | None = None, pulled_by: tuple[Address, ...] = (),
              pulled_by_launch: str = "") -> None:
        """Hold blocks for a decode engine to pull, until it does or the lease runs out; `places`: where they lie
        in this worker's storages, for a puller that copies them itself (cuda_ipc) or takes them through a pipe;
        `slicer`: some heads of them, for decode ranks of another tensor-parallel size (each pulls its heads; served
        once all have); `slice_places`: where such slices lie, for pulls of them by reference or by pipe;
        `pulled_by`: the listeners of the decode ranks that will pull, where known: should this engine refuse
        one at its hello, the blocks are freed at once (also when it was refused just before this offer, unless
        that was an earlier start of its instance than `pulled_by_launch`)."""
        named = frozenset(str(peer) for peer in pulled_by)
        self.offers.offer(transfer_id, total_blocks, source, lease_s, places, slicer, slice_places, named)
        for peer in named:  # a refusal noted since the caller asked, whose release did not see this offer
            if (reason := self.refused.reason(peer, pulled_by_launch)) is not None:
                self.offers.refused(peer, reason)

    def offer_state(self, transfer_id: str) -> OfferState | None:
        return self.offers.poll(transfer_id)

    def withdraw_offer(self, transfer_id: str, until: float) -> bool:
        """No pull may read this offer's blocks any more: False while one still does (it may until `until`)."""
        return self.offers.withdraw(transfer_id, until)

    def renew_offers(self, transfer_ids: list[str]) -> None:
        """These offers' requests have not been answered yet: their leases count from now."""
        self.offers.renew(transfer_ids)

    def forget_offer(self, transfer_id: str, why: str | None = None) -> None:
        """The transfer's blocks are no longer held: if it was offered (or `why` says why it never will be), a later
        pull of it is refused at once."""
        self.offers.forget(transfer_id, why)

    def pull(self, transfer_id: str, peer: Address, first_block: int, num_blocks: int, sink: ViewSource,
             deadline: float, device_blocks: tuple[int, ...] | None = None, part: HeadSlice | None = None,
             after: Fence | None = None) -> None:
        """Fetch blocks into `sink`; or, given `device_blocks` and a peer whose cache opens here (cuda_ipc), copy
        them straight into those blocks of this worker's cache (the result says `by_reference`), after `after`.
        With `part`, only some of the peer's heads, into `sink` (a slice of the blocks); the result is then kept
        under `part.key`."""
        self._lanes.submit(PullJob(transfer_id, peer, first_block, num_blocks, sink, deadline, device_blocks, part,
                                    after))

    def renew_leases(self, peer: Address, transfer_ids: tuple[str, ...], deadline: float) -> None:
        """Ask `peer` to keep holding the blocks of these transfers that it holds for a pull (their requests still
        wait here); sent in the background, by `deadline`."""
        self._lanes.renew(Renewal(peer, transfer_ids, deadline))

    def pull_result(self, transfer_id: str) -> PullResult | None:
        return self._lanes.poll(transfer_id)

    def wait_pull(self, transfer_id: str, timeout_s: float) -> PullResult | None:
        """Block until the pull is done or failed (or `timeout_s` passed); None for an unknown id."""
        return self._lanes.wait(transfer_id, time.monotonic() + timeout_s)

    def forget_pull(self, transfer_id: str) -> None:
        self._lanes.forget(transfer_id)

    # Receiving side.
    def refusal(self, peer: Address, launch: str = "") -> str | None:
        """Why this engine's listener refused the peer whose own listener is at `peer`, at its last hello; None if it
        did not (or accepted it since, or `launch` names a later start of the peer's instance than the one
        refused)."""
        return self.refused.reason(str(peer), launch)

    def staged_state(self, transfer_id: str) -> StageState | None:
        return self.store.state(transfer_id)

    def staged_prompt(self, transfer_id: str) -> str | None:
        """The digest of the prompt a staged (or referred) transfer's sender said its KV is for ("": not said);
        None while nothing of it is here."""
        return self.store.prompt(transfer_id)

    def staged_reason(self, transfer_id: str) -> str:
        """Why a staged transfer failed ("" if it did not)."""
        return self.store.reason(transfer_id)

    def keep_staged(self, transfer_ids: tuple[str, ...]) -> None:
        """These transfers' requests still wait: their staging's expiry counts from now."""
        self.store.touch(transfer_ids)

    def drop_staged(self, reason: str) -> int:
        """Fail every transfer staged or arriving now, freeing its bytes; how many."""
        return self.store.drop_all(reason)

    def wait_staged(self, transfer_id: str, timeout_s: float) -> StageState | None:
        """Block until a pushed transfer is complete or failed (or `timeout_s` passed); its state then."""
        return self.store.wait(transfer_id, time.monotonic() + timeout_s)

    def staged_arrivals(self, transfer_id: str, known: AbstractSet[int] = frozenset()
                        ) -> tuple[StageState | None, dict[int, memoryview]]:
        """A pushed transfer's state, and the bytes of each of its layers received whole but for `known`."""
        return self.store.arrived(transfer_id, known)

    def hold_staged(self, transfer_id: str) -> StagedTransfer | None:
        """Keep a pushed transfer's bytes until `unhold_staged`, whatever becomes of it (copies read them)."""
        return self.store.hold(transfer_id)

    def unhold_staged(self, item: StagedTransfer) -> None:
        self.store.unhold(item)

    def wait_arrival(self, transfer_id: str, known: int, timeout_s: float) -> None:
        """Block until more than `known` layers of a pushed transfer have arrived, or it settled (or `timeout_s`)."""
        self.store.wait_arrival(transfer_id, known, time.monotonic() + timeout_s)

    def take_staged(self, transfer_id: str) -> StagedTransfer | None:
        return self.store.take(transfer_id)

    def release_staged(self, item: StagedTransfer) -> None:
        self.store.release(item)

    def refused_for(self, transfer_id: str) -> WhyPull | None:
        """Why this side refused a push of this transfer, where the refusal asks the sender to hold it for a pull."""
        return WhyPull.of(self.store.reason(transfer_id))

    def discard_staged(self, transfer_id: str, until: float) -> None:
        """No request here loads this pushed transfer: its staging is freed as soon as it settles."""
        self.store.discard(transfer_id, until)

    # What the vLLM side counts.
    def count_load(self, ok: bool, nbytes: int = 0) -> None:
        if ok:
            self.metrics.count_bytes("loaded", nbytes)
        self.metrics.count_transfer("load", "ok" if ok else "failed")

    def count_computed_here(self, reason: str) -> None:
        """A request loaded nothing for want of p2pkv (`reason`): its decode instance computed the prompt."""
        self.metrics.of(self.metrics.computed_here, reason).inc()

    def take_interval(self) -> dict[str, Any] | None:
        """What was counted since the last call: transfers, bytes, transfer times (vLLM's per-step stats)."""
        return self.metrics.take_interval()

    def housekeeping(self) -> None:
        """Expire stale staging and overdue sends; cheap, called once per step by the owner."""
        self.store.expire()
        self.offers.expire()
        if self._sender is not None:
            self._sender.expire()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._metrics_server is not None:
            self._metrics_server.shutdown()  # type: ignore[attr-defined]
            self._metrics_server.server_close()  # type: ignore[attr-defined]
        if self._puller is not None:
            self._puller.close()
        if self._sender is not None:
            self._sender.close()
        if self._receiver is not None:
            self._receiver.close()
        self.store.close()
        if self.pool is not None:
            self.pool.close()
