"""What the scheduler side tells the workers each step. Plain dataclasses: vLLM pickles them to workers."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from p2pkv.params import Address


@dataclass(frozen=True, kw_only=True)
class SaveSpec:
    """Push the first `len(block_ids)` blocks of a finished prefill to the decode instance at `peer` (rank 0),
    or, when `peer` is None (GET mode), hold them for the decode instance to pull."""

    req_id: str
    transfer_id: str
    peer: Address | None
    block_ids: tuple[int, ...]
    inline: bool = False  # PUT: the step waits in wait_for_save until the push is sent
    # The request was preempted after its first save and has computed its prompt again, into these blocks: what
    # was held for a pull is held again, in them (`peer` is None); a push that went through is not sent again.
    again: bool = False
    # GET: the decode instance whose ranks will pull (rank 0) and how many ranks it has, when the proxy said. A
    # transfer is not held for an instance one of whose ranks this worker refused at its hello (another KV layout):
    # none of its pulls would be accepted.
    pulled_by: Address | None = None
    pullers: int = 0
    puller_launch: str = ""  # which start of that instance will pull (its refusals before that start do not count)
    prompt: str = ""  # the digest of the prompt computed (`PushBlocks.prompt`): told to the decode side with the push
    # vLLM's hybrid KV cache manager: each KV cache group's block ids for the same blocks of the prompt (`block_ids`
    # is the first group's); a sliding-window group's start with vLLM's null block, which are not sent
    groups: tuple[tuple[int, ...], ...] = ()
    # vLLM may free blocks of a sliding window this push reads before it has read them (at the request's finish, or
    # as it goes on decoding): the step waits in `wait_for_save` until the push is received
    settle: bool = False


@dataclass(frozen=True, kw_only=True)
class LoadSpec:
    """Land staged blocks `first_block ..` of a transfer in the local `block_ids`; empty means just discard.
    With `pull_from` (GET mode) the blocks are pulled from that prefill engine (rank 0) instead."""

    req_id: str
    transfer_id: str
    first_block: int
    block_ids: tuple[int, ...]
    corrupt: bool = False
    pull_from: Address | None = None
    fallback_from: Address | None = None  # where to pull from if this side refused the push (no space)
    prefill_tp: int = 0  # the prefill instance's tensor-parallel size, when it differs from ours (else 0)
    prefill_pp: int = 0  # the prefill instance's pipeline-parallel size, when it differs from ours (else 0)
    prefill_launch: str = ""  # which start of the prefill instance pushes it (`DecodeParams.prefill_launch`)
    # Sent alongside the prefill (`DecodeParams.alongside_s`): this request's own prompt digest, which the push must
    # say it holds before any of it lands, and how long the push may take to begin (the prefill runs meanwhile)
    prompt: str = ""
    wait_s: float = 0.0
    groups: tuple[tuple[int, ...], ...] = ()  # as in `SaveSpec`: each group's blocks for `block_ids`' positions


@dataclass(frozen=True)
class Discard:
    """A transfer no request here loads (the prompt was in the local cache, or the client went away): its staging
    is freed once it arrives; with `release_from` (GET mode) the prefill instance there is told to free the blocks
    it holds for the pull, as it is with `fallback_from` should this side refuse the push (it then holds them)."""

    transfer_id: str
    release_from: Address | None = None
    prefill_tp: int = 0  # the prefill instance's sizes, when they differ from ours (as in LoadSpec)
    prefill_pp: int = 0
    fallback_from: Address | None = None
    wait_s: float = 0.0  # its decode request went alongside the prefill: the push may begin this much later


@dataclass(frozen=True)
class Wanted:
    """Transfers from the prefill instance at `prefill` (rank 0; `prefill_ranks` ranks, each holding its own blocks)
    whose requests still wait here for blocks of this cache: what is staged of them is kept, and the prefill
    instance is asked to keep holding the blocks of those it holds for a pull (GET, or a refused push)."""

    prefill: Address
    transfer_ids: tuple[str, ...]
    prefill_ranks: int = 1


@dataclass
class P2pkvMetadata(KVConnectorMetadata):  # type: ignore[misc]
    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    # Transfers this instance will not load (the prompt was in its own cache, or the client went away): their
    # staging is freed once they arrive. No request waits on them, so they are never reported to vLLM as finished loads.
    discards: list[Discard] = field(default_factory=list)
    # Transfers whose saved request vLLM preempted this step: their blocks are free and this step may overwrite them.
    preempted: list[str] = field(default_factory=list)
    # Transfers whose saved request was aborted (its client went away): nobody got its parameters, so nobody will
    # pull it. Its blocks are no longer offered; vLLM frees them once a push in flight is done.
    abandoned: list[str] = field(default_factory=list)
    wanted: list[Wanted] = field(default_factory=list)
    idle: bool = False  # the step computes nothing (vLLM steps on while transfers are in flight)
    # vLLM reset its caches since the last step (a weight update, or on request): what is staged here was computed
    # before, and is dropped before this step's loads.
    reset: bool = False
    # Requests queued since the last step that load nothing for want of p2pkv params, by reason
    # (`p2pkv.params.foreign_params`): counted by the workers (`p2pkv_requests_computed_here_total`).
    computed_here: list[str] = field(default_factory=list)
