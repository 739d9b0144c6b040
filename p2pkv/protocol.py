"""The control-plane messages, as one versioned msgspec tagged union, and their framing.

A frame is a fixed 52-byte prefix, a msgpack-encoded message and an optional raw payload:

    magic "P2KV" | version u16 | reserved u16 | message length u32 | payload length u64 | HMAC-SHA256 (32 bytes)

The HMAC (zeros when no secret is configured) covers the prefix fields and the message, so a message cannot
be forged or altered. On a connection it also covers the frame's sequence number in its direction (counted by both
sides, never sent), and every frame after the hello and its reply is keyed with the connection's own key, made
from the secret and both sides' random nonces (`FrameAuth`): a frame replayed, reordered or moved to another
connection fails its check. Payload bytes are bulk KV, covered through their digest in the signed message
(`PushBlocks.digest`, on whenever a secret is set). Sizes are validated against caps before anything is allocated
from them.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from p2pkv import PROTOCOL_VERSION
from p2pkv.errors import ProtocolError

MAGIC = b"P2KV"
_PREFIX = struct.Struct("!4sHHIQ")
MAC_BYTES = 32
PREFIX_BYTES = _PREFIX.size + MAC_BYTES
NONCE_BYTES = 16
_SEQUENCE = struct.Struct("!Q")
_NO_MAC = bytes(MAC_BYTES)


class LayoutDigest(msgspec.Struct, frozen=True):
    """What both sides must agree on to exchange whole blocks as opaque bytes."""

    num_layers: int
    block_size: int
    block_bytes: int
    dtype: str
    block_shape: tuple[int, ...]
    kernel: str
    total_heads: int = 0  # KV heads of the model over all tensor-parallel ranks; 0: not known
    first_layer: int = 0  # the model's index of the first layer held here (pipeline stages hold later layers)
    total_layers: int = 0  # the model's KV layers over all pipeline stages; 0: not known
    # What the KV's values depend on beyond its shape (architecture, positional encoding, quantization): sorted
    # `key=value` pairs joined by ';' (`p2pkv.vllm.model_factors`); "": not known, not compared
    model: str = ""
    # Kernel blocks per vLLM block (a backend whose kernel blocks are smaller); `block_shape` is then a kernel
    # block's and `block_bytes` the whole block's.
    kernel_blocks: int = 1
    # The physical order of a block's dimensions, outermost first (`p2pkv.kv.layout.block_order`): "HNC" (LBHNC),
    # "NHC" (LBNHC), "KHNC" with kernel blocks.
    block_order: str = ""
    # vLLM's KV cache groups, where it has several or a sliding window (`p2pkv.vllm.groups.CacheGroups.factor`):
    # each group's kind and layers. "": one full-attention group. Compared always: the same bytes lie in other blocks.
    kv_groups: str = ""

    @property
    def layers(self) -> range:
        """The model's layers held here."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def local_heads(self) -> int:
        return self.block_shape[0] if self.block_shape else 1

    @property
    def head_bytes(self) -> int:
        return self.block_bytes // max(1, self.local_heads)

    def slices_with(self, other: LayoutDigest) -> bool:
        """The peer holds other heads of the same model (another tensor-parallel size): blocks move as head
        slices, not whole."""
        return (self.total_heads > 0 and self.total_heads == other.total_heads
                and self.local_heads != other.local_heads)

    def layers_with(self, other: LayoutDigest) -> bool:
        """The peer holds other layers of the same model (another pipeline-parallel size): pulls name the layers
        they want."""
        return self.total_layers > 0 and self.total_layers == other.total_layers and self.layers != other.layers

    def sliced_with(self, other: LayoutDigest) -> bool:
        """Whole blocks cannot move between us: the peer holds other heads or other layers."""
        return self.slices_with(other) or self.layers_with(other)

    def differences(self, other: LayoutDigest) -> list[str]:
        names: tuple[str, ...] = ("block_size", "kernel_blocks", "dtype", "kernel", "kv_groups")
        if self.total_layers and other.total_layers:
            names = ("total_layers", *names)
        if not self.layers_with(other):
            names = ("first_layer", "num_layers", *names)
        if self.slices_with(other):
            names += ("head_bytes",)
            if self.block_shape[1:] != other.block_shape[1:]:
                return [f"block_shape: ours {self.block_shape!r}, peer {other.block_shape!r}"]
        else:
            names += ("block_bytes", "block_shape")
        return [f"{n}: ours {getattr(self, n)!r}, peer {getattr(other, n)!r}" for n in names
                if getattr(self, n) != getattr(other, n)] + self._order_differences(other) \
            + self._model_differences(other)

    def _order_differences(self, other: LayoutDigest) -> list[str]:
        """Blocks (or the head slices that move between tensor-parallel sizes) whose dimensions lie in another
        order: the same bytes would mean other heads and tokens. Where what moves holds one head, its place is
        no matter."""
        one_head = min(self.local_heads, other.local_heads) == 1

        def order(d: LayoutDigest) -> str:
            return d.block_order.replace("H", "") if one_head else d.block_order

        if order(self) == order(other):
            return []
        return [f"block_order: ours {self.block_order or 'unknown'} ({_layout_name(self.block_order)}), "
                f"peer {other.block_order or 'unknown'} ({_layout_name(other.block_order)})"]

    def _model_differences(self, other: LayoutDigest) -> list[str]:
        if not self.model or not other.model or self.model == other.model:
            return []
        ours, theirs = _factors(self.model), _factors(other.model)
        keys = ours.keys() | theirs.keys()
        # A factor only one side could tell (its weight files were not found, or it runs without the check) is
        # not known to differ.
        keys -= {key for key in _IF_BOTH_KNOW if key not in ours or key not in theirs}
        return [f"model.{key}: ours {ours.get(key, 'unset')}, peer {theirs.get(key, 'unset')}"
                for key in sorted(keys) if ours.get(key) != theirs.get(key)]


def _layout_name(order: str) -> str:
    """The vLLM layout (`VLLM_KV_CACHE_LAYOUT`) that gives a block this order, for the refusal's reader."""
    inner = order.removeprefix("K")
    known = {"HNC": "heads outside tokens: LBHNC, BLHNC, LHBNC, BHLNC", "NHC": "tokens outside heads: LBNHC, BLNHC",
             "NC": "one head", "": "not said"}
    return known.get(inner, "another layout")


_IF_BOTH_KNOW = frozenset({"weights"})  # `p2pkv.weights`: compared only when both sides have it


def _factors(text: str) -> dict[str, str]:
    return dict(item.partition("=")[::2] for item in text.split(";") if item)


class CmaOffer(msgspec.Struct, frozen=True):
    """A same-host data path: process `pid` may be read directly; `token` is at `token_address` to prove it."""

    pid: int
    boot_id: str
    token_address: int
    token: bytes


class DeviceExport(msgspec.Struct, frozen=True):
    """The KV cache of a process, opened by a peer on its host to pull blocks device to device (cuda_ipc).

    `kind` "cuda": `handles[i]` is storage i (the layers' storages, each once: vLLM allocates one for all) as
    `torch.UntypedStorage._share_cuda_()` gives it (device, IPC handle, size, offset, ref-counter handle and offset,
    event handle, event sync flag). `kind` "host" (the stand-in that runs without a GPU): `handles[i]` is
    `(address, size)` of a CPU storage, read with process_vm_readv. `device` names the GPU (its UUID) or is
    empty."""

    kind: str
    boot_id: str
    pid: int
    device: str
    handles: list[tuple[int | bytes | bool | None, ...]]


class DeviceHome(msgspec.Struct, frozen=True):
    """Where a worker's exported cache lives: its kind ("cuda" or "host"), the host (boot id) and the GPU (UUID,
    empty for "host"). A peer tells from it whether it could open that export."""

    kind: str
    boot_id: str
    device: str = ""


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """First frame on a new connection: who is speaking, what its KV looks like, whether it may be read
    directly (shm transport), which device exports it can open (`device_kind`, cuda_ipc), and which kind of pipe
    it can make (`pipe_kind`, nccl); `home`: where its own export lives, when it exports its cache. Fields after
    `layout` have defaults: a peer that does not send one is read as not having it."""

    engine_id: str
    rank: int
    layout: LayoutDigest
    cma: CmaOffer | None = None
    device_kind: str = ""
    pipe_kind: str = ""
    home: DeviceHome | None = None
    digests: bool = False  # integrity_check: payloads on this link, both ways, carry their digest
    # Where the speaker's own KV listener is reached, as its instance names it to peers (`DecodeParams`): a
    # listener that refuses it notes the refusal under this address, so that loads of its pushes fail at once.
    kv_address: str = ""
    # Which start of its instance the speaker is (`p2pkv.config.launch_of`; "": not said): a refusal is of that
    # start, and a load whose prefill instance started since does not fail on it (`DecodeParams.prefill_launch`).
    launch: str = ""
    nonce: bytes = b""  # random, new for each connection (`FrameAuth.bind`); a listener refuses one it has seen


class HelloReply(msgspec.Struct, tag="hello_reply", frozen=True):
    """The verdict; `reads_you`: the listener reads the client's payloads from the client's memory; `cma`: the
    listener's own offer, which the client answers with a CmaStatus frame."""

    accepted: bool
    reason: str = ""
    cma: CmaOffer | None = None
    reads_you: bool = False
    device: DeviceExport | None = None  # the listener's KV cache, when the client can open that kind
    pipe_kind: str = ""  # the client's pipe kind, when the listener can join that kind too
    # The listener reaches the client's cache over a device path (opens its export, or shares a pipe kind): the
    # client should not push whole blocks through host memory, but send PullInstead and hold them for a pull.
    pull_instead: bool = False
    digests: bool = False  # integrity_check on the listener: payloads on this link, both ways, carry their digest
    idle_s: float = 0.0  # the listener closes this connection after so long without a frame; 0: never
    nonce: bytes = b""  # the listener's, random, new for each connection (`FrameAuth.bind`)
    hello_nonce: bytes = b""  # the hello's nonce: this reply answers that hello and no other


class PipeOpen(msgspec.Struct, tag="pipe_open", frozen=True):
    """Sent by the client once per connection, after the handshake: join the pipe it is making (`token`: the
    kind's rendezvous, e.g. NCCL's unique id). Pulls go by pipe once both sides have it."""

    token: bytes


class CmaStatus(msgspec.Struct, tag="cma_status", frozen=True):
    """Sent by the client right after the handshake when the listener offered: can the client read it?"""

    reads_you: bool


class PayloadCopied(msgspec.Struct, tag="copied", frozen=True):
    """shm transport: the reader has copied the payload of layers `layer .. layer+layers` out of the sender's
    memory, which may go."""

    transfer_id: str
    layer: int
    layers: int = 1


class PushBlocks(msgspec.Struct, tag="push", frozen=True):
    """Blocks `first_block .. first_block+num_blocks` of layers `layer .. layer+layers` of a transfer; the payload
    follows, layer after layer. A frame of several layers carries whole layers (every block of each)."""

    transfer_id: str
    layer: int
    first_block: int
    num_blocks: int
    total_blocks: int
    num_layers: int
    layers: int = 1
    digest: int | None = None  # of the payload (`p2pkv.integrity`), when the link checks integrity
    # `prompt_digest` of the prompt the KV was computed for ("": not said): a decode request sent while the prefill
    # ran knows only its own prompt, and loads the push only if the two agree
    prompt: str = ""
    # Blocks at the start of this layer that are not sent: outside its sliding window (vLLM's null block on the
    # sender). The layer is complete with the rest; a load that needs one of them fails. 0 in frames of several layers.
    skip: int = 0
    # Every layer's `skip`, in every chunk of a transfer that skips any (empty: none does): the receiver stages the
    # blocks sent only, and must know them all at the first chunk to size the transfer
    skips: tuple[int, ...] = ()


class PushAck(msgspec.Struct, tag="push_ack", frozen=True):
    """The receiver's verdict on a pushed transfer, sent once, on its first chunk: staged, or refused for lack
    of space (the sender then keeps the blocks for the receiver to pull); `duplicate`: refused because another
    connection began that transfer id or it was received already (the sender lets its blocks go: no pull follows)."""

    transfer_id: str
    accepted: bool
    reason: str = ""
    duplicate: bool = False


class PullInstead(msgspec.Struct, tag="pull_instead", frozen=True):
    """Instead of pushing a transfer: the sender holds its blocks for the receiver to pull over the device path
    the handshake found (`HelloReply.pull_instead`)."""

    transfer_id: str
    prompt: str = ""  # as in PushBlocks


class PushAbort(msgspec.Struct, tag="abort", frozen=True):
    """The sender gave up on a transfer; the receiver drops what it staged."""

    transfer_id: str
    reason: str


class RenewLeases(msgspec.Struct, tag="renew", frozen=True):
    """The decode side still wants these transfers (their requests wait in its queue for blocks): the offerer keeps
    the blocks of each one it still holds for a pull for another lease. No reply."""

    transfer_ids: list[str]


class PullRequest(msgspec.Struct, tag="pull", frozen=True):
    """GET mode: the decode side asks for blocks `first_block .. first_block+num_blocks` of an offered transfer;
    `by_reference`: it would rather copy them itself from the exported cache (cuda_ipc); `by_pipe`: it would
    rather receive them through the connection's pipe (nccl), in payload order (of the layers asked for, with
    `layers`; of the heads asked for, with `heads`)."""

    transfer_id: str
    first_block: int
    num_blocks: int
    by_reference: bool = False
    by_pipe: bool = False
    heads: tuple[int, int] | None = None  # only these heads (the offerer's numbering) of each block; empty: none
    layers: tuple[int, int] | None = None  # only these layers (the model's numbering); None: every layer held
    pullers: int = 1  # how many pulls of this transfer the offerer gets (one per decode rank that needs it)
    puller: int = 0  # the asking decode rank, so a repeated pull is told apart from another rank's


class PullReply(msgspec.Struct, tag="pull_reply", frozen=True):
    """Answer to a pull; when accepted, PushBlocks frames with the bytes follow on the same connection, or, with
    `by_reference` or `by_pipe`, one BlockPlaces frame, answered by PayloadCopied once the puller has copied or
    received them (by pipe, both sides then move the bytes in payload order, in the same chunks)."""

    transfer_id: str
    accepted: bool
    reason: str = ""
    by_reference: bool = False
    by_pipe: bool = False


class LayerPlace(msgspec.Struct, frozen=True, array_like=True):
    """Where one layer's blocks lie in a cache: in storage `storage` (of those the cache exports), block b's runs
    start at `base + b * block_stride + offset`, each (offset, length) of `inner`."""

    storage: int
    base: int
    block_stride: int
    inner: tuple[tuple[int, int], ...]


class BlockPlaces(msgspec.Struct, tag="places", frozen=True):
    """cuda_ipc (and nccl): the pulled blocks (`block_ids`, little-endian int32) and, per layer in payload order,
    where they lie in the offerer's exported storages: a few hundred bytes whatever the number of blocks, from which
    either side lists the blocks' rows with numpy. `digest` (integrity_check, a cache in host memory): the XXH3-64
    of those bytes, layer after layer, taken just before this frame went; the puller digests them where they
    landed."""

    transfer_id: str
    block_ids: bytes
    layers: list[LayerPlace]
    digest: int | None = None


class PeerRefused(msgspec.Struct, frozen=True, array_like=True):
    """In a heartbeat: a worker of another instance that a worker of this one refused at its hello (the address
    it names for its own listener), why, how many seconds ago it was last refused, and the start of its instance
    that was refused (its hello's `launch`; "": not said). A reader of three fields ignores the fourth."""

    address: str
    reason: str
    age_s: float
    launch: str = ""


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    """An instance announcing itself to the proxy: its role ("prefill", "decode" or "both"), its OpenAI address,
    its KV address (rank 0's control port) and how often it announces, so the proxy knows when it is overdue."""

    role: str
    http_address: str
    kv_address: str
    interval_s: float
    engine_id: str = ""
    tp_size: int = 0  # the instance's tensor-parallel size; 0: not said
    pp_size: int = 0  # the instance's pipeline-parallel size; 0: not said
    dp_rank: int = -1  # the data-parallel rank its API server reaches this engine by; -1: none (one engine)
    refused: tuple[PeerRefused, ...] = ()  # the latest refusals of its workers (`p2pkv.proxy.pairs`); a few at most
    pulls: bool = False  # a decode instance that takes its KV by pulls (its send_type GET), whatever the prefill's
    launch: str = ""  # this start of the instance (`p2pkv.config.launch_of`); "": not said
    kv_events: str = ""  # where its vLLM publishes KV cache events (a ZMQ endpoint); "": it does not


Message = (Hello | HelloReply | BlockPlaces | PushBlocks | PushAck | PushAbort | PullRequest | PullReply | Heartbeat
           | CmaStatus | PayloadCopied | PipeOpen | PullInstead | RenewLeases)
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


@dataclass(frozen=True)
class FrameLimits:
    max_message_bytes: int = 64 * 1024
    max_payload_bytes: int = 1 << 34


class FramePrefix(NamedTuple):  # a tuple: built for every frame, and cheaper than a frozen dataclass
    message_len: int
    payload_len: int
    mac: bytes


def _mac(secret: bytes, prefix: bytes, message: bytes) -> bytes:
    if not secret:
        return _NO_MAC
    return hmac.digest(secret, prefix + message, "sha256")  # one-shot: a fifth cheaper than hmac.new


def encode_frame(message: Message, payload_len: int, secret: bytes) -> bytes:
    """Prefix and message bytes of one frame standing alone (a datagram: no sequence, no connection key); the
    caller sends `payload_len` payload bytes after it. Connections sign theirs with `FrameAuth`."""
    body = _encoder.encode(message)
    prefix = _PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, len(body), payload_len)
    return prefix + _mac(secret, prefix, body) + body


class FrameAuth:
    """How one connection signs and checks its frames: each frame's MAC covers its sequence number in its direction
    (both sides count, nothing is sent), the prefix and the message. The hello and its reply are keyed with the
    secret; once the client has the reply, both sides `bind` the connection to its own keys, one per direction,
    HMAC(secret, "p2pkv connection" + direction + client nonce + listener nonce): a frame sent back to its sender
    fails too. Without a secret every MAC is zeros. One `hmac.digest` per frame, as for a datagram."""

    __slots__ = ("_received", "_receiving", "_secret", "_sending", "_sent")

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._sending = self._receiving = secret
        self._sent = 0
        self._received = 0

    def bind(self, client_nonce: bytes, server_nonce: bytes, client: bool) -> None:
        """`client`: this side sent the hello."""
        if self._secret:
            keys = [hmac.digest(self._secret, b"p2pkv connection" + way + client_nonce + server_nonce, "sha256")
                    for way in (b"client to listener", b"listener to client")]
            self._sending, self._receiving = keys if client else keys[::-1]

    @staticmethod
    def _mac(key: bytes, sequence: int, prefix: bytes, body: bytes) -> bytes:
        if not key:
            return _NO_MAC
        return hmac.digest(key, _SEQUENCE.pack(sequence) + prefix + body, "sha256")

    def encode(self, message: Message, payload_len: int) -> bytes:
        """The next frame's prefix and message; frames go on the wire in the order they are encoded."""
        body = _encoder.encode(message)
        prefix = _PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, len(body), payload_len)
        mac = self._mac(self._sending, self._sent, prefix, body)
        self._sent += 1
        return prefix + mac + body

    def decode(self, prefix_raw: bytes, prefix: FramePrefix, body: bytes) -> Message:
        """The next frame's message, once its MAC is checked (the sequence then moves on)."""
        expected = self._mac(self._receiving, self._received, bytes(prefix_raw[: _PREFIX.size]), body)
        if not hmac.compare_digest(expected, prefix.mac):
            raise ProtocolError("frame authentication failed")
        self._received += 1
        return _decode_body(body)


def decode_prefix(raw: bytes, limits: FrameLimits) -> FramePrefix:
    """Validate the fixed prefix before any buffer is sized from it."""
    if len(raw) != PREFIX_BYTES:
        raise ProtocolError(f"short frame prefix: {len(raw)} bytes")
    magic, version, _, message_len, payload_len = _PREFIX.unpack(raw[: _PREFIX.size])
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version}, expected {PROTOCOL_VERSION}")
    if message_len > limits.max_message_bytes:
        raise ProtocolError(f"message of {message_len} bytes exceeds the cap of {limits.max_message_bytes}")
    if payload_len > limits.max_payload_bytes:
        raise ProtocolError(f"payload of {payload_len} bytes exceeds the cap of {limits.max_payload_bytes}")
    return FramePrefix(message_len, payload_len, bytes(raw[_PREFIX.size :]))


def decode_message(prefix_raw: bytes, prefix: FramePrefix, body: bytes, secret: bytes) -> Message:
    expected = _mac(secret, bytes(prefix_raw[: _PREFIX.size]), body)
    if not hmac.compare_digest(expected, prefix.mac):
        raise ProtocolError("frame authentication failed")
    return _decode_body(body)


def _decode_body(body: bytes) -> Message:
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable message: {exc}") from None


def encode_datagram(message: Message, secret: bytes) -> bytes:
    """One whole frame without payload, for message transports (the proxy's discovery socket)."""
    return encode_frame(message, 0, secret)


def decode_datagram(raw: bytes, secret: bytes, limits: FrameLimits) -> Message:
    """The message of one whole frame without payload; ProtocolError for anything else."""
    prefix = decode_prefix(raw[:PREFIX_BYTES], limits)
    if prefix.payload_len:
        raise ProtocolError(f"a datagram carries no payload, this one claims {prefix.payload_len} bytes")
    if len(raw) != PREFIX_BYTES + prefix.message_len:
        raise ProtocolError(f"datagram of {len(raw)} bytes, its prefix says {PREFIX_BYTES + prefix.message_len}")
    return decode_message(raw[:PREFIX_BYTES], prefix, raw[PREFIX_BYTES:], secret)
