"""Worker side, loading: KV pulled from the prefill side, or pushed and staged here, lands in the blocks vLLM
allocated for a request's prompt. Each load is reported once: finished, or its blocks as load errors (vLLM then
recomputes or fails the request)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace

from p2pkv.config import ConnectorConfig
from p2pkv.engine import TransferEngine
from p2pkv.engine.device import Fence
from p2pkv.engine.puller import HeadSlice, PullKey, PullState
from p2pkv.engine.store import StagedTransfer, StageState
from p2pkv.errors import ConfigError, P2pkvError, TransferError
from p2pkv.kv.blocks import BlockAccess
from p2pkv.kv.device_copy import Marker, PartialCopy, all_done, done
from p2pkv.kv.slices import HeadSlices
from p2pkv.kv.stages import StageLayers, StagePart, plan_stages, stage_split
from p2pkv.kv.tp import plan_pulls
from p2pkv.params import Address
from p2pkv.vllm.groups import NULL_BLOCK, leading_nulls
from p2pkv.vllm.metadata import Discard, LoadSpec
from p2pkv.way import push_or_pull

log = logging.getLogger(__name__)
# Why this side refused a push, for which the prefill instance then holds the blocks for a pull instead.


@dataclass(frozen=True)
class Placement:
    """Where a worker sits in its instance, and which part of the model's KV it holds."""

    rank: int  # tensor-parallel rank
    tp_size: int
    pp_rank: int  # pipeline stage
    pp_size: int
    total_heads: int  # the model's KV heads (0: not known)
    layers: range  # the model's layers held here
    total_layers: int  # the model's KV layers (0: not known, or not its hidden layers in order)
    stage_layers: StageLayers | None  # which layers a stage of a given pipeline-parallel size holds

    @property
    def slot(self) -> int:
        """The worker's number in its instance, as vLLM numbers them: it binds `kv_port + slot`."""
        return self.pp_rank * self.tp_size + self.rank


@dataclass
class _Landing:
    """Copies into the blocks, issued and not waited for: the load is reported once `marker` says they are done,
    and `finish` then frees what they read."""

    marker: Marker
    finish: Callable[[], None]
    failure: str | None = None  # the load failed: its blocks are reported as load errors once the copies are done


@dataclass
class _Load:
    spec: LoadSpec
    deadline: float
    # Copies into the load's blocks come after this: vLLM's thread recorded it when the load was bound, after
    # vLLM queued the zeroing of the blocks it had just allocated.
    fence: Fence | None = None
    # From a prefill instance of another tensor- or pipeline-parallel size: one pull per prefill rank, each into
    # a slice of the blocks (some heads of some layers; None for a pull that only releases that rank's blocks).
    parts: list[tuple[str, BlockAccess | None]] = field(default_factory=list)
    landing: _Landing | None = None
    overdue: bool = False  # its landing outlived the deadline (logged once)
    # A push: the layers whose copies into the blocks were issued as they arrived, while the rest was on the way,
    # and those copies; `broken`: issuing one failed (the load fails once they are done).
    landed: set[int] = field(default_factory=set)
    early: list[Marker] = field(default_factory=list)
    broken: str | None = None
    held: StagedTransfer | None = None  # the transfer's bytes, held while those copies read them
    # Sent alongside the prefill (`LoadSpec.prompt`): whether the push said this request's prompt (True), or why it
    # is not taken (another prompt's, or said none)
    prompt_ok: bool = False
    other_prompt: str | None = None


def _no_sink(layer: int, first: int, count: int) -> tuple[memoryview, ...]:
    return ()


class Loads:
    def __init__(self, config: ConnectorConfig, engine: TransferEngine, blocks: BlockAccess, slices: HeadSlices,
                 at: Placement, groups: tuple[int, ...] | None = None) -> None:
        """`groups`: the KV cache group of each layer, where each group has its own block ids (`LoadSpec.groups`);
        such loads are pushed only, and a failed one is reported by its request (`take_failed`)."""
        self._config = config
        self._groups = groups
        self._failed: set[str] = set()
        self._engine = engine
        self._blocks = blocks
        self._slices = slices
        self._at = at
        self._loads: dict[str, _Load] = {}
        self._errors: set[int] = set()
        # Discarded pushes: transfer id -> until when to look for its staging, and where the prefill instance holds
        # the blocks should this side refuse the push (None: it does not)
        self._discards: dict[str, tuple[float, Address | None]] = {}
        self._releases: set[PullKey] = set()  # pulls of no heads under way, each with its own deadline

    @property
    def pending(self) -> bool:
        return bool(self._loads)

    def start(self, specs: list[LoadSpec], fence: Fence | None = None) -> None:
        """This step's new loads: pulls start now, and so do those of pushes already known to be left for a pull
        or refused; other pushes are awaited. Copies into their blocks come after `fence`."""
        now = time.monotonic()
        deadline = now + self._config.extra.transfer_timeout_s
        for spec in specs:
            # Sent alongside its prefill: the push may begin as late as the prefill's end (then a transfer's deadline).
            load = self._loads[spec.req_id] = _Load(spec, max(deadline, now + spec.wait_s), fence)
            if spec.pull_from is not None and spec.block_ids and self._groups is not None:
                self._fail_load(spec, "KV of several cache groups is pushed, not pulled: its prompt is computed here")
                load.spec = replace(spec, block_ids=())
            elif spec.pull_from is not None and spec.block_ids:
                self._start_pull(load, spec.pull_from)
            elif self._engine.staged_state(spec.transfer_id) is StageState.FAILED and self._prompt_said(load):
                self._fall_back_to_pull(load)  # a step sooner than finished() would

    def discard(self, discards: list[Discard]) -> None:
        """Transfers no request here loads (the prompt was in the local cache): their staging is freed by the store
        as soon as it has arrived, with or without a next step; blocks held for our pull are released
        at once (a pull of no heads). Never reported as a finished load: vLLM, which asserts that a reported request
        waits for its KV, does not wait for these."""
        now = time.monotonic()
        for discard in discards:
            # A push whose decode request came alongside its prefill may begin as late as the prefill's end.
            deadline = now + discard.wait_s + self._config.extra.transfer_timeout_s
            if discard.release_from is None:
                self._discards[discard.transfer_id] = deadline, discard.fallback_from
                self._engine.discard_staged(discard.transfer_id, deadline)
            else:
                self._release_safely(discard, discard.release_from, deadline)
        if self._discards or self._releases:
            self._drop_discarded()

    def _release_safely(self, discard: Discard, peer: Address, deadline: float) -> None:
        try:
            self._release(discard, peer, deadline)
        except P2pkvError as exc:  # layers that cannot be matched across stages: the lease runs out instead
            log.warning("transfer %s: the blocks held for it cannot be released (%s)", discard.transfer_id, exc)

    def _release(self, discard: Discard, peer: Address, deadline: float) -> None:
        """A pull of no heads from each prefill rank this rank would have pulled from, as the pull would have been
        announced (pullers and puller), so that each rank's offer counts it as served."""
        tid = discard.transfer_id
        if not (discard.prefill_tp or discard.prefill_pp):  # our sizes: one whole offer per rank, ours
            key = PullKey(tid, release=True)
            self._releases.add(key)
            self._engine.pull(tid, peer.offset(self._at.slot), 0, 1, _no_sink, deadline, None,
                              HeadSlice(heads=(0, 0), block_bytes=0, pullers=1, puller=0, key=str(key)))
            return
        prefill_tp = discard.prefill_tp or self._at.tp_size
        for stage in self._stages(discard.prefill_pp or self._at.pp_size):
            for part in plan_pulls(self._at.rank, self._at.tp_size, prefill_tp, self._at.total_heads):
                slot = stage.prefill_stage * prefill_tp + part.prefill_rank
                key = PullKey(tid, slot, release=True)
                self._releases.add(key)
                self._engine.pull(tid, peer.offset(slot), 0, 1, _no_sink, deadline, None,
                                  HeadSlice(heads=(0, 0), block_bytes=0, pullers=part.pullers * stage.pullers,
                                            puller=self._at.slot, key=str(key), layers=stage.layers))

    def _drop_discarded(self) -> None:
        for release in list(self._releases):
            result = self._engine.pull_result(str(release))
            if result is None or result.state is not PullState.PENDING:
                self._engine.forget_pull(str(release))
                self._releases.discard(release)
        now = time.monotonic()
        for key, (deadline, fallback) in list(self._discards.items()):
            if (state := self._engine.staged_state(key)) in (StageState.COMPLETE, StageState.FAILED):
                refused = state is StageState.FAILED and push_or_pull(refused=self._engine.refused_for(key)).pulled
                item = self._engine.take_staged(key)
                if item is not None:
                    self._engine.release_staged(item)
                if refused and fallback is not None:  # the prefill instance holds the blocks for a pull instead
                    del self._discards[key]
                    self._release_safely(Discard(key), fallback, deadline)
                    continue
            elif now <= deadline:
                continue
            del self._discards[key]

    def _start_pull(self, load: _Load, peer: Address) -> None:
        """Pull the load's KV from `peer`. One that cannot even start (heads or layers that cannot be split, say)
        fails now, as load errors, and is reported finished at the next check: the step goes on."""
        try:
            self._pull(load, peer)
        except P2pkvError as exc:
            self._fail_load(load.spec, str(exc))
            load.parts.clear()
            load.spec = replace(load.spec, pull_from=peer, block_ids=())

    def _landed(self, load: _Load, now: float) -> bool:
        """Whether the copies into a load's blocks are done (then what they read is freed). Never waited for: a
        load whose copies outlive its deadline stays pending (vLLM may reuse the blocks of a load reported failed,
        so nothing may still write into them), with an error logged once."""
        landing = load.landing
        assert landing is not None
        try:
            if not landing.marker():
                if now > load.deadline and not load.overdue:
                    load.overdue = True
                    log.error("transfer %s: the copies into the blocks are still running past the deadline",
                              load.spec.transfer_id)
                return False
        except Exception as exc:  # a device error: the blocks hold what they hold, vLLM recomputes them
            landing.failure = f"the copy into the blocks failed: {exc!r}"
        if landing.failure is not None:
            self._fail_load(load.spec, landing.failure)
        landing.finish()
        return True

    def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a load's transfer to settle; False (at once) when no load is pending."""
        for load in self._loads.values():
            if load.landing is not None:
                continue
            keys = [key for key, _ in load.parts] or [load.spec.transfer_id]
            if load.spec.pull_from is not None:
                pending = [k for k in keys if (r := self._engine.pull_result(k)) is not None
                           and r.state is PullState.PENDING]
                self._engine.wait_pull((pending or keys)[0], timeout_s)  # returns once that pull settles
            else:  # wakes as soon as another layer arrives, to land it (a load that lands none: once it settles)
                lands = bool(load.spec.block_ids) and load.broken is None
                known = len(load.landed) if lands else self._engine.layout.num_layers
                self._engine.wait_arrival(load.spec.transfer_id, known, timeout_s)
            return True
        return False

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_failed(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed

    def _pull(self, load: _Load, peer: Address) -> None:
        spec = load.spec
        if spec.prefill_tp or spec.prefill_pp:
            self._pull_parts(load, peer)
            return
        self._engine.pull(spec.transfer_id, peer.offset(self._at.slot), spec.first_block, len(spec.block_ids),
                          self._blocks.sink(spec.transfer_id, spec.block_ids), load.deadline,
                          self._blocks.device_blocks(spec.block_ids), after=load.fence)

    def _stages(self, prefill_pp: int) -> list[StagePart]:
        """The prefill stages this stage pulls its layers from."""
        at = self._at
        if prefill_pp == at.pp_size:
            return [StagePart(at.pp_rank, (at.layers.start, at.layers.stop), 1)]
        if at.stage_layers is None or not at.total_layers:
            raise ConfigError(f"the prefill instance runs pipeline-parallel size {prefill_pp}, this one "
                              f"{at.pp_size}, and this model's layers cannot be matched across stages")
        decode = stage_split(at.stage_layers, at.pp_size)
        if decode[at.pp_rank] != at.layers:
            raise ConfigError(f"this stage holds layers {at.layers.start}..{at.layers.stop}, not the "
                              f"{decode[at.pp_rank].start}..{decode[at.pp_rank].stop} of vLLM's split")
        return plan_stages(at.pp_rank, decode, stage_split(at.stage_layers, prefill_pp), at.total_layers)

    def _pull_parts(self, load: _Load, peer: Address) -> None:
        """From a prefill instance of another tensor- or pipeline-parallel size: this rank's heads of this stage's
        layers, from the prefill ranks that hold them, each into its slice of the blocks."""
        spec, tid = load.spec, load.spec.transfer_id
        prefill_tp = spec.prefill_tp or self._at.tp_size
        jobs = []
        try:
            for stage in self._stages(spec.prefill_pp or self._at.pp_size):
                local = (stage.layers[0] - self._at.layers.start, stage.layers[1] - self._at.layers.start)
                for part in plan_pulls(self._at.rank, self._at.tp_size, prefill_tp, self._at.total_heads):
                    # Prefill stage s's ranks follow its earlier stages' ranks.
                    slot = stage.prefill_stage * prefill_tp + part.prefill_rank
                    key = str(PullKey(tid, slot))
                    access = None if part.release_only else self._slices.get(part.decode_heads, local)
                    block_bytes = access.digest.block_bytes if access is not None else 0
                    sink = access.sink(key, spec.block_ids) if access is not None else _no_sink
                    places = access.places(spec.block_ids) if access is not None else None
                    jobs.append((slot, sink, HeadSlice(heads=part.prefill_heads, block_bytes=block_bytes,
                                                       pullers=part.pullers * stage.pullers, puller=self._at.slot,
                                                       key=key, layers=stage.layers, places=places), access))
        except P2pkvError:
            for _, _, head_slice, access in jobs:
                if access is not None:
                    access.release(head_slice.key)
            raise
        # Submitted only once every part could be prepared: a load that fails here has nothing writing its blocks.
        for slot, sink, head_slice, access in jobs:
            load.parts.append((head_slice.key, access))
            self._engine.pull(tid, peer.offset(slot), spec.first_block, len(spec.block_ids), sink,
                              load.deadline, None, head_slice, after=load.fence)

    def finished(self, finished_req_ids: AbstractSet[str] = frozenset()) -> set[str]:
        """The requests whose load settled (landed, or failed as load errors); `finished_req_ids`: the requests
        vLLM ended since the last step (aborted ones among them)."""
        abandoned = self._abandon(finished_req_ids & self._loads.keys()) if finished_req_ids else set()
        if self._discards or self._releases:
            self._drop_discarded()
        done: set[str] = set()
        now = time.monotonic()
        for req_id, load in self._loads.items():
            if load.landing is not None:
                if self._landed(load, now):
                    done.add(req_id)
                continue
            if load.spec.pull_from is not None:
                if self._pull_finished(load):
                    done.add(req_id)
                continue
            said = self._prompt_said(load)
            state = self._land_arrived(load) if said else self._engine.staged_state(load.spec.transfer_id)
            if state is StageState.FAILED and not load.landed and said and self._fall_back_to_pull(load):
                continue
            if load.other_prompt is not None:
                state = StageState.FAILED if state is StageState.FAILED else None  # not landed, let go below
            if state is StageState.COMPLETE and load.broken is None and said:
                self._land(load)
                if self._landed(load, now):
                    done.add(req_id)
            elif (state is StageState.FAILED or load.broken is not None or load.other_prompt is not None
                  or now > load.deadline or (refused := self._refusal(load.spec))):
                if load.other_prompt is not None:
                    reason = load.other_prompt
                elif load.broken is not None:
                    reason = f"the copy into the blocks failed: {load.broken}"
                elif state is StageState.FAILED:  # the store's reason: the sender's abort, a lost link, a bad digest
                    reason = f"transfer failed: {self._engine.staged_reason(load.spec.transfer_id)}"
                elif now > load.deadline:
                    reason = "deadline passed"
                else:
                    reason = f"the prefill worker that pushes it was refused: {refused}"
                # Reported once the layers landed early are in (vLLM may reuse a failed load's blocks); what they read
                # is held until then.
                load.landing = _Landing(all_done(load.early), self._let_go(load, state), reason)
                if self._landed(load, now):
                    done.add(req_id)
        for req_id in done:
            del self._loads[req_id]
        return done | abandoned

    def _prompt_said(self, load: _Load) -> bool:
        """Whether a load sent alongside its prefill may take its push: the push said this request's prompt. False
        while nothing of it is here, or when it said another (`other_prompt` then says why, and the load fails).
        True at once for a load whose params named the prompt."""
        spec = load.spec
        if not spec.prompt or load.prompt_ok:
            return True
        if load.other_prompt is not None:
            return False
        said = self._engine.staged_prompt(spec.transfer_id)
        if said is None:
            return False
        if said == spec.prompt:
            load.prompt_ok = True  # the prefill is done with its first layers: from here, a transfer's deadline
            load.deadline = time.monotonic() + self._config.extra.transfer_timeout_s
            return True
        if said or self._engine.staged_state(spec.transfer_id) is not StageState.FAILED:
            load.other_prompt = (f"the push holds the KV of another prompt (digest {said}, this request's "
                                 f"{spec.prompt}): the two instances tokenized the request differently" if said
                                 else "the push did not say which prompt its KV is for, so a request sent "
                                 "alongside its prefill cannot take it")
        return False

    def _refusal(self, spec: LoadSpec) -> str | None:
        """Why this worker refused the prefill worker that would push this load (its hello; its pushes are all
        refused alike), if it did: the load then fails at once rather than at its deadline. Not if the prefill
        instance started again since that refusal (its restart's first push is on the way)."""
        if spec.fallback_from is None:
            return None
        return self._engine.refusal(spec.fallback_from.offset(self._at.slot), spec.prefill_launch)

    def _abandon(self, req_ids: AbstractSet[str]) -> set[str]:
        """Requests vLLM ended (their client went away) while their KV was on the way. One that awaits a push is
        reported at once, with no load error: nothing writes into its blocks (a push lands in them only in
        `finished`), and vLLM frees them, rather than once the deadline has passed. The push becomes a discard,
        freed when it arrives. A pull in flight, or copies landing, write into the blocks: they are left to settle."""
        done: set[str] = set()
        for req_id in req_ids:
            load = self._loads[req_id]
            spec = load.spec
            if spec.pull_from is not None or load.landing is not None or load.landed:  # something writes into them
                continue
            log.info("transfer %s: request %s ended before its KV landed; the push is freed when it arrives",
                     spec.transfer_id, req_id)
            self.discard([Discard(spec.transfer_id, fallback_from=spec.fallback_from, wait_s=spec.wait_s)])
            del self._loads[req_id]
            done.add(req_id)
        return done

    def _fall_back_to_pull(self, load: _Load) -> bool:
        """This side refused the push (no staging space, or the sender holds other heads or layers), or asked for
        pulls over a device path: pull the blocks straight into the cache instead."""
        spec = load.spec
        decision = push_or_pull(refused=self._engine.refused_for(spec.transfer_id))
        if not decision.pulled or spec.fallback_from is None or not spec.block_ids or self._groups is not None:
            return False
        item = self._engine.take_staged(spec.transfer_id)
        if item is not None:
            self._engine.release_staged(item)
        why = decision.why.value if decision.why else ""
        log.info("transfer %s: not pushed (%s); pulling from %s", spec.transfer_id, why, spec.fallback_from)
        load.spec = replace(spec, pull_from=spec.fallback_from)
        self._start_pull(load, spec.fallback_from)
        return True

    def _parts_finished(self, load: _Load) -> bool:
        """A load pulled in slices: done once every part has settled; it failed if any part did."""
        spec = load.spec
        results = [self._engine.pull_result(key) for key, _ in load.parts]
        if any(r is not None and r.state is PullState.PENDING for r in results):
            return False
        failed = next((r.reason if r is not None else "deadline passed" for r in results
                       if r is None or r.state is not PullState.DONE), None)
        markers: list[Marker] = []
        try:
            if failed is None:
                for (key, access), result in zip(load.parts, results, strict=True):
                    if access is not None and result is not None and not result.by_reference:
                        markers.append(access.land(key, load.fence))  # by reference: straight into the blocks
        except Exception as exc:  # no device memory for a copy, say: what was issued still runs
            if isinstance(exc, PartialCopy):
                markers.append(exc.pending)
            failed = repr(exc)
        parts = list(load.parts)
        nbytes = sum(r.nbytes for r in results if r is not None)

        def finish() -> None:
            for key, access in parts:
                self._engine.forget_pull(key)
                if access is not None:
                    access.release(key)
            if failed is None:
                self._loaded(spec, nbytes)

        load.landing = _Landing(lambda: all(m() for m in markers), finish,
                                None if failed is None else "pull failed: " + failed)
        return self._landed(load, time.monotonic())

    def _pull_finished(self, load: _Load) -> bool:
        spec = load.spec
        if not spec.block_ids:
            return True
        if load.parts:
            return self._parts_finished(load)
        result = self._engine.pull_result(spec.transfer_id)
        if result is not None and result.state is PullState.DONE:
            self._engine.forget_pull(spec.transfer_id)
            nbytes = result.nbytes

            def finish() -> None:
                self._blocks.release(spec.transfer_id)
                self._loaded(spec, nbytes)

            try:
                # Copied device to device otherwise: nothing to land.
                marker = self._blocks.land(spec.transfer_id, load.fence) if not result.by_reference else None
            except Exception as exc:  # what was issued still runs: released and reported once it is done
                pending = exc.pending if isinstance(exc, PartialCopy) else done
                load.landing = _Landing(pending, lambda: self._blocks.release(spec.transfer_id), repr(exc))
            else:
                load.landing = _Landing(marker or done, finish)
            return self._landed(load, time.monotonic())
        # Only a finished pull is reported: vLLM may free and reuse the blocks of a failed load, so the puller
        # (which honours the same deadline) must be done writing into them first.
        if result is None or result.state is PullState.FAILED:
            self._fail_load(spec, "pull failed: " + (result.reason if result is not None else "deadline passed"))
            self._engine.forget_pull(spec.transfer_id)
            self._blocks.release(spec.transfer_id)
            return True
        return False

    def _loaded(self, spec: LoadSpec, nbytes: int) -> None:
        """A pulled load is in the blocks. With fault injection, a load marked `test_corrupt` is then damaged (the
        integration tests' negative control: the output must change)."""
        if spec.corrupt and self._config.extra.test_fault_injection:
            key, first = f"{spec.transfer_id}#corrupt", spec.block_ids[:1]
            try:
                data = bytearray(b"".join(bytes(v) for v in self._blocks.source(key, first)(0, 0, 1)))
                data[:4096] = bytes(b ^ 0x5A for b in data[:4096])
                self._blocks.write_blocks(0, first, memoryview(data))
            finally:
                self._blocks.release(key)
        self._engine.count_load(True, nbytes)

    def _sources(self, spec: LoadSpec, views: list[tuple[int, memoryview]],
                 skips: Mapping[int, int] | None = None) -> list[tuple[int, memoryview]]:
        """The load's blocks of staged layers (a staged layer holds the transfer's blocks, from `first_block`; from
        the first sent where `skips` says the sender left some out); with fault injection, a load marked
        `test_corrupt` damaged (the integration tests' negative control)."""
        bb = self._engine.layout.block_bytes
        n = len(spec.block_ids) * bb
        out = []
        for layer, view in views:
            start = (spec.first_block - (skips or {}).get(layer, 0)) * bb
            if start < 0:
                raise TransferError(f"layer {layer}: the prefill worker left out blocks this load needs")
            src = view[start : start + n]
            if spec.corrupt and self._config.extra.test_fault_injection:
                src = memoryview(bytes(b ^ 0x5A for b in src[:4096]) + bytes(src[4096:]))
            out.append((layer, src))
        return out

    def _write(self, spec: LoadSpec, item: StagedTransfer, views: list[tuple[int, memoryview]],
               fence: Fence | None) -> Marker:
        """Copy staged layers into the load's blocks: one list of block ids, or each layer's group's, without
        the blocks before a sliding window (vLLM's null block here). A block the sender left out (its own window
        began later) fails the load: it would land nothing there."""
        if self._groups is None or not spec.groups:
            return self._blocks.write_layers(spec.block_ids, self._sources(spec, views, item.skips), fence)
        # Every check before any copy, over every layer whose skip the push has said (all of them from its first
        # chunk): no layer lands before one that cannot fails the load
        for layer, skip in item.skips.items():
            needed = spec.first_block + leading_nulls(spec.groups[self._groups[layer]])
            if skip > needed:
                raise TransferError(f"layer {layer}: the prefill worker sent blocks from {skip}, this load needs "
                                    f"them from {needed}")
        by_group: dict[int, list[tuple[int, memoryview]]] = {}
        for layer, view in views:
            by_group.setdefault(self._groups[layer], []).append((layer, view))
        parts: list[tuple[LoadSpec, list[tuple[int, memoryview]]]] = []
        for group, layers in by_group.items():
            ids = spec.groups[group]
            null = leading_nulls(ids)
            if NULL_BLOCK in ids[null:]:
                raise TransferError(f"cache group {group}'s blocks {list(ids)} hold a null block after others")
            first = spec.first_block + null
            if null < len(ids):
                parts.append((replace(spec, first_block=first, block_ids=ids[null:]), layers))
        return all_done([self._blocks.write_layers(part.block_ids, self._sources(part, layers, item.skips), fence)
                         for part, layers in parts])

    def _let_go(self, load: _Load, state: StageState | None) -> Callable[[], None]:
        """A failed push load gives its transfer up now: freed by the store if it failed there, else dropped as it
        settles (chunks still coming are taken in and dropped). Returns what lets go of the bytes its early copies
        read, once they are done."""
        tid = load.spec.transfer_id
        if state is StageState.FAILED:
            item = self._engine.take_staged(tid)
            if item is not None:
                self._engine.release_staged(item)
        else:
            until = time.monotonic() + load.spec.wait_s + self._config.extra.transfer_timeout_s
            self._engine.discard_staged(tid, until)
        held = load.held

        def unhold() -> None:
            if held is not None:
                self._engine.unhold_staged(held)

        return unhold

    def _land_arrived(self, load: _Load) -> StageState | None:
        """A pushed load's transfer state; the layers of it that arrived since the last look are copied into the
        blocks now, while the rest is on the way (landing overlaps the transfer)."""
        spec = load.spec
        state, arrived = self._engine.staged_arrivals(spec.transfer_id, load.landed)
        if state is not StageState.RECEIVING or not arrived or not spec.block_ids or load.broken is not None:
            return state
        if load.held is None:  # the bytes the copies read stay until they are done, whatever the transfer does
            load.held = self._engine.hold_staged(spec.transfer_id)
            if load.held is None:  # failed just now
                return self._engine.staged_state(spec.transfer_id)
            state, arrived = self._engine.staged_arrivals(spec.transfer_id, load.landed)
            if state is not StageState.RECEIVING or not arrived:
                return state
        try:
            load.early.append(self._write(spec, load.held, list(arrived.items()), load.fence))  # held: not None
        except Exception as exc:  # a device error: what was issued still runs; the load fails once it is done
            if isinstance(exc, PartialCopy):
                load.early.append(exc.pending)
            load.broken = repr(exc)
        load.landed.update(arrived)
        return state

    def _land(self, load: _Load) -> None:
        """Issue the copies of a complete staged push's layers not landed yet into the load's blocks; `finished`
        reports it once they (and those landed as they arrived) are done; the staged bytes are kept until then."""
        spec = load.spec
        item = self._engine.take_staged(spec.transfer_id)
        assert item is not None
        n = len(spec.block_ids)
        nbytes = n * item.block_bytes * item.num_layers
        if self._groups is not None and spec.groups:  # each layer lands its group's blocks, from the first non-null
            nbytes = item.block_bytes * sum(len(spec.groups[g]) - leading_nulls(spec.groups[g]) for g in self._groups)

        def finish() -> None:
            self._engine.release_staged(item)
            if load.held is not None:
                self._engine.unhold_staged(load.held)
            if n:
                self._engine.count_load(True, nbytes)
                early = f" early={len(load.landed)}" if load.landed else ""
                log.info("transfer %s landed peer=%s blocks=%d bytes=%d ms=%.1f transport=%s%s", spec.transfer_id,
                         item.source.split("#")[0], n, nbytes, (time.monotonic() - item.created) * 1000,
                         item.transport, early)

        if not n:
            load.landing = _Landing(lambda: True, finish)
            return
        rest = [(layer, item.layer_view(layer)) for layer in range(item.num_layers) if layer not in load.landed]
        try:
            marker = self._write(spec, item, rest, load.fence) if rest else done
            load.landing = _Landing(all_done([*load.early, marker]), finish)
        except Exception as exc:  # a device error (no memory for the copy, say): the prompt is computed here
            pending = exc.pending if isinstance(exc, PartialCopy) else done
            unhold = self._let_go(load, StageState.FAILED)  # taken already: nothing more to give up

            def give_up() -> None:
                self._engine.release_staged(item)
                unhold()

            load.landing = _Landing(all_done([*load.early, pending]), give_up, repr(exc))

    def _fail_load(self, spec: LoadSpec, reason: str) -> None:
        """Report the load's blocks to vLLM as load errors (it recomputes or fails the request)."""
        log.warning("transfer %s: load failed (%s); reporting %d blocks", spec.transfer_id, reason,
                    len(spec.block_ids))
        if self._groups is None:
            self._errors.update(spec.block_ids)
        elif spec.block_ids:
            self._failed.add(spec.req_id)
        self._engine.count_load(False)
