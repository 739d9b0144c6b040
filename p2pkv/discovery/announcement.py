"""What a heartbeat says, read from either wire format the proxy accepts.

- p2pkv's own: one protocol frame holding a `Heartbeat` message, with an HMAC when a shared secret is set.
- The old connector's: a msgpack map `{"type": "P" | "D", "http_address": "ip:port", "zmq_address": "ip:port"}`,
  sent every 3 s. It cannot be authenticated, so a proxy with a secret refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from p2pkv.discovery.events import MAX_ENDPOINT_BYTES
from p2pkv.errors import ConfigError, ProtocolError
from p2pkv.params import Address, hex16_or_empty
from p2pkv.protocol import MAGIC, FrameLimits, Heartbeat, decode_datagram

ROLES = ("prefill", "decode", "both")
LEGACY_INTERVAL_S = 3.0
# The longest interval a heartbeat may announce: an instance is kept that many intervals after its last heartbeat,
# so a longer one would keep a dead (or forged) instance listed for hours.
MAX_INTERVAL_S = 60.0
# Shorter intervals would let one sender cycle instances through the pools (each expiring at once) as fast as it sends.
MIN_INTERVAL_S = 0.1
MAX_ANNOUNCEMENT_BYTES = 4096
MAX_REFUSED = 16  # refused peers one heartbeat may name (instances send 8 at most)
_LEGACY_ROLES = {"P": "prefill", "D": "decode"}
_LIMITS = FrameLimits(max_message_bytes=MAX_ANNOUNCEMENT_BYTES, max_payload_bytes=0)


@dataclass(frozen=True)
class Announcement:
    role: str
    http: Address
    kv: Address | None
    interval_s: float
    legacy: bool = False
    tp_size: int = 0  # 0: not said
    pp_size: int = 0  # 0: not said
    dp_rank: int | None = None  # the data-parallel rank behind `http` (X-data-parallel-rank); None: the only one
    # Workers of other instances its workers refused at their hello: (their listener, why, seconds since, the
    # start of their instance that was refused or "").
    refused: tuple[tuple[Address, str, float, str], ...] = ()
    engine_id: str = ""  # another one from the same address: the instance restarted
    pulls: bool = False  # a decode instance that takes its KV by pulls
    launch: str = ""  # this start of the instance (`p2pkv.config.launch_of`); "": not said
    kv_events: str = ""  # where its vLLM publishes KV cache events (`p2pkv.discovery.events`); "": not said


def _address(value: object, key: str) -> Address:
    if not isinstance(value, str):
        raise ProtocolError(f"heartbeat {key}: expected 'host:port', got {type(value).__name__}")
    try:
        return Address.parse(value)
    except ConfigError as exc:
        raise ProtocolError(f"heartbeat {key}: {exc}") from None


def _typed(raw: bytes, secret: bytes) -> Announcement:
    message = decode_datagram(raw, secret, _LIMITS)
    if not isinstance(message, Heartbeat):
        raise ProtocolError(f"expected a heartbeat, got {type(message).__name__}")
    if message.role not in ROLES:
        raise ProtocolError(f"heartbeat role {message.role!r}: expected one of {', '.join(ROLES)}")
    if not MIN_INTERVAL_S <= message.interval_s <= MAX_INTERVAL_S:
        raise ProtocolError(f"heartbeat interval {message.interval_s!r} s is out of range ({MIN_INTERVAL_S:g} to "
                            f"{MAX_INTERVAL_S:g})")
    kv = _address(message.kv_address, "kv_address") if message.kv_address else None
    for key, size in (("tp_size", message.tp_size), ("pp_size", message.pp_size)):
        if not 0 <= size <= 4096:
            raise ProtocolError(f"heartbeat {key} {size!r} is out of range")
    if not -1 <= message.dp_rank < 4096:
        raise ProtocolError(f"heartbeat dp_rank {message.dp_rank!r} is out of range")
    if not hex16_or_empty(message.launch):
        raise ProtocolError(f"heartbeat launch {message.launch[:40]!r}: expected 16 hex digits")
    if len(message.refused) > MAX_REFUSED:
        raise ProtocolError(f"heartbeat names {len(message.refused)} refused peers; {MAX_REFUSED} at most")
    refused = []
    for peer in message.refused:
        if not 0 <= peer.age_s <= 1e9:  # also NaN
            raise ProtocolError(f"heartbeat refusal age {peer.age_s!r} s is out of range")
        if not hex16_or_empty(peer.launch):
            raise ProtocolError(f"heartbeat refusal launch {peer.launch[:40]!r}: expected 16 hex digits")
        refused.append((_address(peer.address, "refused address"), peer.reason, peer.age_s, peer.launch))
    if message.kv_events and not (len(message.kv_events) <= MAX_ENDPOINT_BYTES
                                  and message.kv_events.startswith(("tcp://", "ipc://"))):
        raise ProtocolError(f"heartbeat kv_events {message.kv_events[:40]!r}: expected a tcp:// or ipc:// endpoint "
                            f"of at most {MAX_ENDPOINT_BYTES} bytes")
    return Announcement(message.role, _address(message.http_address, "http_address"), kv, message.interval_s,
                        tp_size=message.tp_size, pp_size=message.pp_size,
                        dp_rank=message.dp_rank if message.dp_rank >= 0 else None, refused=tuple(refused),
                        engine_id=message.engine_id[:64], pulls=message.pulls, launch=message.launch,
                        kv_events=message.kv_events)


def _legacy(raw: bytes) -> Announcement:
    try:
        data = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"heartbeat is neither a p2pkv frame nor msgpack: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"legacy heartbeat: expected a map, got {type(data).__name__}")
    role = _LEGACY_ROLES.get(data.get("type"))  # type: ignore[arg-type]
    if role is None:
        raise ProtocolError(f"legacy heartbeat type {data.get('type')!r}: expected 'P' or 'D'")
    http = _address(data.get("http_address"), "http_address")
    return Announcement(role, http, _address(data.get("zmq_address"), "zmq_address"), LEGACY_INTERVAL_S, True)


def parse_announcement(raw: bytes, secret: bytes) -> Announcement:
    """The announcement in one discovery message; ProtocolError for anything malformed or unauthenticated."""
    if len(raw) > MAX_ANNOUNCEMENT_BYTES + 64:
        raise ProtocolError(f"heartbeat of {len(raw)} bytes is too large")
    if raw.startswith(MAGIC):
        return _typed(raw, secret)
    if secret:
        raise ProtocolError("unauthenticated legacy heartbeat refused: this proxy requires a shared secret")
    return _legacy(raw)
