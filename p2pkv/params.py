"""`kv_transfer_params` as typed values: the one place where vLLM's params dict becomes a dataclass.

The proxy writes `PrefillParams` into the prefill request; the prefill instance answers `DecodeParams`, which the
proxy forwards to the decode instance. Transfers are keyed by `transfer_id`, never by vLLM's request id.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np
import xxhash

from p2pkv.errors import ConfigError
from p2pkv.hostaddr import advertised_host

MARKER = "p2pkv"
PARAMS_VERSION = 1
_TRANSFER_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_DIGEST = re.compile(r"^[0-9a-f]{16}$")
# The old connector's proxy named both instances' KV addresses in the request id it sent both of them (as
# X-Request-Id): `___prefill_addr_<host:port>___decode_addr_<host:port>_<32 hex>`. vLLM wraps that id (`cmpl-`, a
# prompt's index in a batch, a random suffix), so it is searched for, and the transfer keyed on its hex part (and
# the prompt's index), which both instances see alike.
_LEGACY_ID = re.compile(r"___prefill_addr_(?P<prefill>[^_\s]+)___decode_addr_(?P<decode>[^_\s]+)_(?P<id>[0-9a-f]{32})"
                        r"(?:-(?P<index>\d{1,6})(?=-))?")


def hex16_or_empty(value: object) -> TypeGuard[str]:
    """16 hex digits (a prompt's digest, or a start of an instance: `p2pkv.config.launch_of`), or "" (not said)."""
    return isinstance(value, str) and (not value or bool(_DIGEST.match(value)))


def prompt_digest(token_ids: Sequence[int]) -> str:
    """Which prompt a transfer's KV was computed for: XXH3-64 of its token ids (as int64), 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(np.asarray(token_ids, dtype=np.int64).tobytes())


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Address:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"address {text!r}: expected HOST:PORT")
        return cls(host.strip("[]"), int(port))

    def offset(self, delta: int) -> Address:
        return Address(self.host, self.port + delta)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @classmethod
    def advertised(cls, kv_host: str, port: int, towards: str = "") -> Address:
        """Where peers reach a KV listener bound to `kv_host` (`p2pkv.hostaddr`; `towards`: the proxy's host). The
        prefill side names its rank-0 listener so in `DecodeParams`, each engine its own in `Hello`, and heartbeats
        the instance's."""
        return cls(advertised_host(kv_host, towards), port)


@dataclass(frozen=True)
class PrefillParams:
    """Sent by the proxy to a prefill instance: compute, then push the KV to `decode_kv` (rank-0 address).

    With `pull` (or no `decode_kv`) the prefill instance holds the blocks instead, for the decode side to pull.
    """

    transfer_id: str
    decode_kv: Address | None
    pull: bool = False
    inline: bool = False  # PUT: the prefill step waits until its push is sent
    decode_tp: int = 0  # the decode instance's tensor-parallel size, when the proxy knows it (0: not known)
    decode_pp: int = 0  # the decode instance's pipeline-parallel size, when the proxy knows it (0: not known)
    # which start of the decode instance will pull (`p2pkv.config.launch_of`), when the proxy knows it: a refusal
    # of an earlier start of it (before a restart) does not keep the blocks from being held for it
    decode_launch: str = ""
    # read from vLLM's standard disaggregation params (a router's, not p2pkv's proxy's): the answer adds the
    # standard fields (`remote_host`, `remote_port`, `remote_engine_id`) to p2pkv's; never sent
    standard: bool = False

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {MARKER: PARAMS_VERSION, "transfer_id": self.transfer_id, "do_remote_decode": True}
        if self.decode_kv is not None:
            out["decode_kv_address"] = str(self.decode_kv)
        if self.decode_tp:
            out["decode_tp_size"] = self.decode_tp
        if self.decode_pp:
            out["decode_pp_size"] = self.decode_pp
        if self.decode_launch:
            out["decode_launch"] = self.decode_launch
        if self.pull:
            out["send_type"] = "GET"
        elif self.inline:
            out["send_type"] = "PUT"
        return out


def _held_at(out: dict[str, Any], prefill_kv: Address | None, pull: bool, prefill_tp: int,
             prefill_pp: int) -> dict[str, Any]:
    """`out` with where a prefill instance holds a transfer's KV: its KV address, its parallel sizes when said,
    and whether it holds the KV for a pull (GET)."""
    if prefill_kv is not None:
        out["prefill_kv_address"] = str(prefill_kv)
    if prefill_tp:
        out["prefill_tp_size"] = prefill_tp
    if prefill_pp:
        out["prefill_pp_size"] = prefill_pp
    if pull:
        out["send_type"] = "GET"
    return out


@dataclass(frozen=True)
class DecodeParams:
    """Returned by the prefill instance and forwarded to the decode instance: where the KV is.

    The key is `load_remote_kv`, not NIXL's `do_remote_prefill`: with the latter vLLM would report the prefill
    instance's cache hits as the decode instance's, hiding that the decode instance loaded the prompt.
    """

    transfer_id: str
    num_prompt_tokens: int
    prefill_kv: Address | None
    test_corrupt: bool = False
    pull: bool = False
    prefill_tp: int = 0  # the prefill instance's tensor-parallel size (0: not said, taken to equal ours)
    prefill_pp: int = 0  # the prefill instance's pipeline-parallel size (0: not said, taken to equal ours)
    # `prompt_digest` of the prompt the KV was computed for ("": not said; then only the length is compared)
    prompt: str = ""
    # how long the prefill instance holds the blocks without word from the decode side, in seconds (its `lease_s`;
    # 0: not said, taken to equal ours): the decode side renews a waiting request's lease before it runs out
    lease_s: float = 0.0
    # which start of the prefill instance holds the KV (`p2pkv.config.launch_of`; "": not said): a refusal of an
    # earlier start of it (before a restart) does not fail the load
    prefill_launch: str = ""
    # Sent by the proxy alongside the prefill request, before the prefill answered (0: after it): the prompt's
    # length and digest are not known yet (`num_prompt_tokens` 0), so the push must say its prompt's digest, which
    # the decode side compares with its own; the push may take this many seconds (the prefill) to begin.
    alongside_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            MARKER: PARAMS_VERSION,
            "transfer_id": self.transfer_id,
            "load_remote_kv": True,
            "num_prompt_tokens": self.num_prompt_tokens,
        }
        if self.alongside_s:
            out["alongside_s"] = self.alongside_s
        if self.prompt:
            out["prompt_digest"] = self.prompt
        if self.test_corrupt:
            out["test_corrupt"] = True
        if self.lease_s:
            out["prefill_lease_s"] = self.lease_s
        if self.prefill_launch:
            out["prefill_launch"] = self.prefill_launch
        return _held_at(out, self.prefill_kv, self.pull, self.prefill_tp, self.prefill_pp)


@dataclass(frozen=True)
class ProbeParams:
    """Sent by a proxy that was not told an instance's KV address: the instance answers with its KV port."""

    def to_dict(self) -> dict[str, Any]:
        return {MARKER: PARAMS_VERSION, "probe": True}


@dataclass(frozen=True)
class ProbeAnswer:
    kv_port: int
    kv_host: str
    tp_size: int = 0
    pp_size: int = 0
    pulls: bool = False  # it takes its KV by pulls (send_type GET on the decode instance)
    # What a heartbeat says too, for a proxy that lists the instance statically and asks (`p2pkv.proxy.poll`): the
    # id of its engine (another one: it restarted), the address its first worker names itself by to peers (which
    # their refusals name), and the workers of other instances its workers refused: (address, why, seconds since,
    # the start of their instance that was refused or ""). The starts go under a key of their own
    # (`refused_launches`, one for each refusal), so a proxy that reads three fields a refusal reads these answers.
    engine_id: str = ""
    kv_named: str = ""
    refused: tuple[tuple[str, str, float, str], ...] = ()
    launch: str = ""  # this start of the instance (`p2pkv.config.launch_of`)
    kv_events: str = ""  # where its vLLM publishes KV cache events (`p2pkv.discovery.events`); "": nowhere

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {MARKER: PARAMS_VERSION, "kv_port": self.kv_port, "kv_host": self.kv_host}
        if self.tp_size:
            out["tp_size"] = self.tp_size
        if self.pp_size:
            out["pp_size"] = self.pp_size
        if self.pulls:
            out["pulls"] = True
        if self.engine_id:
            out["engine_id"] = self.engine_id
        if self.kv_named:
            out["kv_named"] = self.kv_named
        if self.refused:
            out["refused"] = [[address, reason, age] for address, reason, age, _ in self.refused]
        if any(launch for *_, launch in self.refused):
            out["refused_launches"] = [launch for *_, launch in self.refused]
        if self.launch:
            out["launch"] = self.launch
        if self.kv_events:
            out["kv_events"] = self.kv_events
        return out


@dataclass(frozen=True)
class DiscardParams:
    """Sent by the proxy to a decode instance, in a request of its own, for a transfer whose request will never
    come (its client went away): the staged push is freed when it arrives, and blocks a prefill instance holds for
    the pull are released, rather than either being held until expiry. With the prefill's answer (`of`) it says
    where those blocks are; without one (the client went away during the prefill), only the transfer id."""

    transfer_id: str
    prefill_kv: Address | None = None
    pull: bool = False
    prefill_tp: int = 0
    prefill_pp: int = 0

    @classmethod
    def of(cls, decode: DecodeParams) -> DiscardParams:
        return cls(decode.transfer_id, decode.prefill_kv, decode.pull, decode.prefill_tp, decode.prefill_pp)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {MARKER: PARAMS_VERSION, "transfer_id": self.transfer_id, "discard_transfer": True}
        return _held_at(out, self.prefill_kv, self.pull, self.prefill_tp, self.prefill_pp)


AnyParams = PrefillParams | DecodeParams | ProbeParams | DiscardParams


def standard_prefill(raw: Any) -> bool:
    """vLLM's standard prefill params, as a router that does not know p2pkv sends them (llm-d's sidecar, vLLM's
    NIXL test proxy): `do_remote_decode` true, no p2pkv marker. The decode instance is not named: the KV is held
    for its pull."""
    return isinstance(raw, dict) and MARKER not in raw and raw.get("do_remote_decode") is True


def standard_transfer_id(launch: str, request_id: str) -> str:
    """The transfer id of a standard prefill request: the same for every hook that reads the request, unique
    across instances (this start's `launch`, vLLM's request id)."""
    readable = re.sub(r"[^A-Za-z0-9_.:-]", "_", request_id)
    tid = f"std-{launch or 'x'}-{readable}"
    return tid if len(tid) <= 128 else f"std-{launch or 'x'}-{xxhash.xxh3_128_hexdigest(request_id.encode())}"


def standard_answer(out: dict[str, Any], engine_id: str, kv: Address) -> dict[str, Any]:
    """`out` (p2pkv's decode params) with the standard fields a router may log or inspect. Not `do_remote_prefill`:
    with it vLLM would report the prefill instance's cache hits as the decode instance's cached tokens."""
    return {**out, "do_remote_decode": False, "remote_engine_id": engine_id or None, "remote_host": kv.host,
            "remote_port": kv.port}


def foreign_params(raw: Any, producer: bool) -> tuple[str, str] | None:
    """For a request p2pkv does not take as a transfer: why it loads nothing, and from which peer (for warning once
    per peer); None for a request with nothing to say. `producer`: the instance prefills (standard prefill params
    are a transfer there)."""
    if isinstance(raw, dict) and MARKER in raw:
        return None
    if not raw:
        return None if producer else ("none", "")
    if not isinstance(raw, dict):
        return "foreign", ""
    if raw.get("do_remote_decode") is True:
        return None if producer else ("prefill", "")
    host, port, engine = raw.get("remote_host"), raw.get("remote_port"), raw.get("remote_engine_id")
    peer = f"{host}:{port}" if host and port else str(engine or "")
    return "foreign", peer


def legacy_params(request_id: str, producer: bool, num_prompt_tokens: int,
                  pull: bool) -> PrefillParams | DecodeParams | None:
    """The params an old proxy's request id stands for (it sends no `kv_transfer_params`); None for any other id.

    On a prefill instance (`producer`) the KV goes to the decode address (or is held for a pull with `pull`, the
    instance's `send_type` GET); on a decode instance the whole prompt comes from the prefill address."""
    found = _LEGACY_ID.search(request_id)
    if found is None:
        return None
    try:
        prefill, decode = Address.parse(found["prefill"]), Address.parse(found["decode"])
    except ConfigError:
        return None
    transfer_id = f"legacy-{found['id']}" + (f"-{found['index']}" if found["index"] else "")
    if producer:
        return PrefillParams(transfer_id, decode, pull=pull)
    return DecodeParams(transfer_id, num_prompt_tokens, prefill, pull=pull) if num_prompt_tokens > 0 else None


def _pull(raw: dict[str, Any]) -> bool:
    mode = raw.get("send_type", "PUT_ASYNC")
    if mode not in ("PUT", "PUT_ASYNC", "GET"):
        raise ConfigError(f"kv_transfer_params.send_type: expected PUT, PUT_ASYNC or GET, got {mode!r}")
    return bool(mode == "GET")


def _size(raw: dict[str, Any], key: str) -> int:
    """A tensor- or pipeline-parallel size; 0 when not given."""
    value = raw.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 4096:
        kind = "tensor" if key.endswith("tp_size") else "pipeline"
        raise ConfigError(f"kv_transfer_params.{key}: expected a {kind}-parallel size, got {value!r}")
    return value


def _hex16(raw: dict[str, Any], key: str) -> str:
    """16 hex digits, or "" when not said."""
    value = raw.get(key, "")
    if not hex16_or_empty(value):
        raise ConfigError(f"kv_transfer_params.{key}: expected 16 hex digits, got {value!r}")
    return value


def _seconds(raw: dict[str, Any], key: str) -> float:
    """Seconds from 0 to 3600; 0 when not said."""
    value = raw.get(key, 0.0)
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 3600:
        raise ConfigError(f"kv_transfer_params.{key}: expected seconds from 0 to 3600, got {value!r}")
    return float(value)


def parse_transfer_params(raw: Any) -> AnyParams | None:
    """Turn vLLM's `kv_transfer_params` into typed params; None when the request is not a p2pkv transfer.

    Raises ConfigError for a p2pkv dict that is malformed, so bad input fails the request loudly.
    """
    if not isinstance(raw, dict) or MARKER not in raw:
        return None
    if raw[MARKER] != PARAMS_VERSION:
        raise ConfigError(f"kv_transfer_params: p2pkv version {raw[MARKER]!r}, expected {PARAMS_VERSION}")
    if raw.get("probe") is True:
        return ProbeParams()
    transfer_id = raw.get("transfer_id")
    if not isinstance(transfer_id, str) or not _TRANSFER_ID.match(transfer_id):
        raise ConfigError(f"kv_transfer_params.transfer_id: expected 1-128 of [A-Za-z0-9_.:-], got {transfer_id!r}")
    if raw.get("do_remote_decode"):
        decode = raw.get("decode_kv_address")
        return PrefillParams(transfer_id, Address.parse(decode) if isinstance(decode, str) else None,
                             _pull(raw), raw.get("send_type") == "PUT", _size(raw, "decode_tp_size"),
                             _size(raw, "decode_pp_size"), _hex16(raw, "decode_launch"))
    if raw.get("load_remote_kv"):
        alongside = _seconds(raw, "alongside_s")
        tokens = raw.get("num_prompt_tokens", 0 if alongside else None)
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < (0 if alongside else 1):
            raise ConfigError(f"kv_transfer_params.num_prompt_tokens: expected a positive integer, got {tokens!r}")
        prefill = raw.get("prefill_kv_address")
        params = DecodeParams(transfer_id, tokens, Address.parse(prefill) if isinstance(prefill, str) else None,
                              bool(raw.get("test_corrupt", False)), _pull(raw), _size(raw, "prefill_tp_size"),
                              _size(raw, "prefill_pp_size"), _hex16(raw, "prompt_digest"),
                              _seconds(raw, "prefill_lease_s"), _hex16(raw, "prefill_launch"), alongside)
        if params.pull and params.prefill_kv is None:
            raise ConfigError("kv_transfer_params: send_type GET needs prefill_kv_address")
        if params.pull and alongside:
            raise ConfigError("kv_transfer_params: alongside_s (sent before the prefill answered) takes a push, "
                              "not send_type GET")
        return params
    if raw.get("discard_transfer") is True:
        prefill = raw.get("prefill_kv_address")
        discard = DiscardParams(transfer_id, Address.parse(prefill) if isinstance(prefill, str) else None, _pull(raw),
                                _size(raw, "prefill_tp_size"), _size(raw, "prefill_pp_size"))
        if discard.pull and discard.prefill_kv is None:
            raise ConfigError("kv_transfer_params: send_type GET needs prefill_kv_address")
        return discard
    raise ConfigError("kv_transfer_params: p2pkv params need do_remote_decode, load_remote_kv or discard_transfer")
