"""Every option of p2pkv and its default, parsed once from `kv_connector_extra_config`.

The old `P2pNcclConnector` keys keep working. Unknown keys and bad values stop start-up with an error that
names the key and what it accepts.
"""

from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

from p2pkv.errors import ConfigError
from p2pkv.params import Address

AUTH_SECRET_ENV = "P2PKV_AUTH_SECRET"
# How the proxy picks instances (`p2pkv.proxy.registry.Policy`): prefix only for prefill instances, whose blocks
# its KV cache events say.
DECODE_POLICIES = ("least-outstanding", "round-robin")
PREFILL_POLICIES = (*DECODE_POLICIES, "prefix")
T = TypeVar("T")


class SendType(enum.Enum):
    PUT = "PUT"
    PUT_ASYNC = "PUT_ASYNC"
    GET = "GET"


class Role(enum.Enum):
    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"


class LoadFailurePolicy(enum.Enum):
    RECOMPUTE = "recompute"
    FAIL = "fail"


class Transport(enum.Enum):
    AUTO = "auto"  # shm with peers on this host (cuda_ipc for pulls of GPU KV), tcp (nccl for such pulls) elsewhere
    TCP = "tcp"
    SHM = "shm"  # same-host peers; falls back to tcp, with a warning, where it cannot be set up
    CUDA_IPC = "cuda_ipc"  # GPU KV, same-host peers: pulls copy device to device; else as auto, with a warning
    NCCL = "nccl"  # GPU KV: pulls go through an NCCL communicator per peer pair; else as auto, with a warning


class HeartbeatFormat(enum.Enum):
    P2PKV = "p2pkv"  # a protocol frame, signed with `auth_secret` when set; says tensor- and pipeline-parallel sizes
    LEGACY = "legacy"  # the old connector's msgpack map, for its proxy (unsigned; P or D only)


@dataclass(frozen=True)
class ExtraConfig:
    """The keys of `kv_connector_extra_config`, with their defaults."""

    # Keys of the old connector.
    proxy_ip: str = ""
    proxy_port: int = 0
    http_port: int = 0
    send_type: SendType = SendType.PUT_ASYNC
    nccl_num_channels: int = 8
    mem_pool_size_gb: float = 32.0
    kv_buffer_size: float = 1e9
    # p2pkv's own keys.
    # With a GPU cache, how much of the pool is pinned at start-up: four 8k-token Llama-3-8B requests (1 GiB each)
    # staged at once, without waiting for pinning (0.5 s per GiB) on a transfer's path.
    mem_pool_pinned_gb: float = 4.0
    kv_host: str = "0.0.0.0"
    transport: Transport = Transport.AUTO
    pull_over_device: bool = True
    transfer_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    lease_s: float = 30.0
    staging_expiry_s: float = 120.0
    metrics_port: int = 0
    heartbeat_interval_s: float = 3.0
    heartbeat_format: HeartbeatFormat = HeartbeatFormat.P2PKV
    auth_secret: str = ""
    max_frame_bytes: int = 1 << 20
    max_connections: int = 256
    connection_idle_s: float = 300.0
    integrity_check: bool = False
    weights_check: bool = True
    huge_pages: bool = True
    # The interpreter's switch interval, lowered to this (never raised) in a process that runs an engine: each of
    # its threads waits for vLLM's busy thread that long at most to take the interpreter lock back. 0: left alone.
    switch_interval_ms: float = 0.5
    test_fault_injection: bool = False

    @property
    def proxies(self) -> list[Address]:
        """Where heartbeats go: `proxy_ip` names one proxy or several, comma-separated (proxies side by side, each
        told of every instance), each `HOST` (at `proxy_port`) or `HOST:PORT` (an IPv6 address with a port in
        brackets); none without `proxy_ip`. ConfigError for one that is not an address."""
        out: list[Address] = []
        for item in (part.strip() for part in self.proxy_ip.split(",")) if self.proxy_ip else ():
            if not item:
                raise ConfigError(f"proxy_ip {self.proxy_ip!r}: an empty address in the list")
            with_port = item.startswith("[") or item.count(":") == 1
            try:
                out.append(Address.parse(item) if with_port else Address(item, self.proxy_port))
            except ConfigError as exc:
                raise ConfigError(f"proxy_ip: {exc}") from None
        return out

    @property
    def proxy_host(self) -> str:
        """The first proxy's host ("" without one): a wildcard `kv_host` is named by this host's address on the route
        to it."""
        proxies = self.proxies
        return proxies[0].host if proxies else ""

    def kv_address(self, port: int) -> Address:
        """Where peers reach a KV listener of this instance on `port`: `kv_host`, or for a wildcard the address
        `p2pkv.hostaddr` picks."""
        return Address.advertised(self.kv_host, port, self.proxy_host)


def _as_int(key: str, lo: int, hi: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer in [{lo}, {hi}], got {value!r}")
        try:
            number = int(str(value), 10)
        except ValueError:
            raise ConfigError(f"{key}: expected an integer in [{lo}, {hi}], got {value!r}") from None
        if not lo <= number <= hi:
            raise ConfigError(f"{key}: expected an integer in [{lo}, {hi}], got {value!r}")
        return number

    return parse


def _as_float(key: str, lo: float, hi: float, *, open_low: bool = False) -> Callable[[Any], float]:
    bounds = f"{'(' if open_low else '['}{lo:g}, {hi:g}]"

    def parse(value: Any) -> float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number in {bounds}, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number in {bounds}, got {value!r}") from None
        low_ok = number > lo if open_low else number >= lo
        if not (low_ok and number <= hi):
            raise ConfigError(f"{key}: expected a number in {bounds}, got {value!r}")
        return number

    return parse


def _as_str(key: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value

    return parse


def _as_bool(key: str) -> Callable[[Any], bool]:
    def parse(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")

    return parse


def _as_enum(key: str, kind: type[enum.Enum]) -> Callable[[Any], Any]:
    accepted = ", ".join(str(m.value) for m in kind)

    def parse(value: Any) -> Any:
        for member in kind:
            if isinstance(value, str) and value.lower() == str(member.value).lower():
                return member
        raise ConfigError(f"{key}: expected one of {accepted}, got {value!r}")

    return parse


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "proxy_ip": _as_str("proxy_ip"),
    "proxy_port": _as_int("proxy_port", 0, 65535),
    "http_port": _as_int("http_port", 0, 65535),
    "send_type": _as_enum("send_type", SendType),
    "nccl_num_channels": _as_int("nccl_num_channels", 1, 64),
    "mem_pool_size_gb": _as_float("mem_pool_size_gb", 0.0, 4096.0),
    "kv_buffer_size": _as_float("kv_buffer_size", 0.0, 1e15, open_low=True),
    "mem_pool_pinned_gb": _as_float("mem_pool_pinned_gb", 0.0, 4096.0),
    "kv_host": _as_str("kv_host"),
    "transport": _as_enum("transport", Transport),
    "pull_over_device": _as_bool("pull_over_device"),
    "transfer_timeout_s": _as_float("transfer_timeout_s", 0.0, 3600.0, open_low=True),
    "connect_timeout_s": _as_float("connect_timeout_s", 0.0, 600.0, open_low=True),
    "lease_s": _as_float("lease_s", 0.0, 3600.0, open_low=True),
    "staging_expiry_s": _as_float("staging_expiry_s", 0.0, 86400.0, open_low=True),
    "metrics_port": _as_int("metrics_port", 0, 65535),
    "heartbeat_interval_s": _as_float("heartbeat_interval_s", 0.1, 60.0),  # proxies refuse longer
    "heartbeat_format": _as_enum("heartbeat_format", HeartbeatFormat),
    "auth_secret": _as_str("auth_secret"),
    "max_frame_bytes": _as_int("max_frame_bytes", 1024, 1 << 30),
    "max_connections": _as_int("max_connections", 1, 65536),
    "connection_idle_s": _as_float("connection_idle_s", 0.0, 86400.0, open_low=True),
    "integrity_check": _as_bool("integrity_check"),
    "weights_check": _as_bool("weights_check"),
    "huge_pages": _as_bool("huge_pages"),
    "switch_interval_ms": _as_float("switch_interval_ms", 0.0, 1000.0),
    "test_fault_injection": _as_bool("test_fault_injection"),
}
assert set(_PARSERS) == {f.name for f in fields(ExtraConfig)}


def parse_extra_config(raw: Mapping[str, Any] | None) -> ExtraConfig:
    """Validate every key of `kv_connector_extra_config` and build the frozen config."""
    values: dict[str, Any] = {}
    for key, value in (raw or {}).items():
        parser = _PARSERS.get(key)
        if parser is None:
            accepted = ", ".join(sorted(_PARSERS))
            raise ConfigError(f"unknown kv_connector_extra_config key {key!r}; accepted keys: {accepted}")
        values[key] = parser(value)
    if "auth_secret" not in values and os.environ.get(AUTH_SECRET_ENV):
        values["auth_secret"] = os.environ[AUTH_SECRET_ENV]
    config = ExtraConfig(**values)
    if config.proxy_ip and not config.http_port:
        raise ConfigError("http_port: required when proxy_ip is set (the instance's OpenAI port)")
    if bool(config.proxy_ip) != bool(config.proxy_port):
        raise ConfigError("proxy_ip and proxy_port: set both or neither")
    if config.proxy_ip and not config.proxies:  # each address is checked here, at start-up (ConfigError)
        raise ConfigError(f"proxy_ip {config.proxy_ip!r}: no address")
    return config


@dataclass(frozen=True)
class ConnectorConfig:
    """What one connector instance needs: its role, its control port and the extra options."""

    role: Role
    kv_port: int
    failure_policy: LoadFailurePolicy
    extra: ExtraConfig
    # This start of the instance (`launch_of` vLLM's KV transfer engine id and instance id, new at every start):
    # peers tell a restart by it; "": not known
    launch: str = ""

    @property
    def takes_pulls(self) -> bool:
        """A decode instance with `send_type` GET: it pulls its KV, and tells the proxy so (heartbeats, probe
        answers), which then asks every prefill instance to hold the KV for it, whatever their own `send_type`."""
        return self.role is not Role.PRODUCER and self.extra.send_type is SendType.GET

    def worker_port(self, rank: int) -> int:
        """Worker `rank` binds `kv_port + rank`, as the old connector did."""
        return self.kv_port + rank

    def for_data_parallel_rank(self, local_rank: int, workers: int) -> ConnectorConfig:
        """The config of data-parallel rank `local_rank` (on this host) of an instance whose engines have `workers`
        workers each: its workers bind `kv_port + local_rank * workers + r` (and metrics ports alike), so the ranks
        of one instance do not share ports."""
        if local_rank == 0:
            return self
        shift = local_rank * workers
        last = self.kv_port + shift + workers - 1
        if last > 65535:
            raise ConfigError(f"kv_port {self.kv_port}: data-parallel rank {local_rank} would bind up to {last}, "
                              f"past 65535 (its {workers} workers take kv_port + {shift} onwards)")
        extra = self.extra
        if extra.metrics_port:
            if extra.metrics_port + shift + workers - 1 > 65535:
                raise ConfigError(f"metrics_port {extra.metrics_port}: data-parallel rank {local_rank} would serve "
                                  "past port 65535")
            extra = replace(extra, metrics_port=extra.metrics_port + shift)
        return replace(self, kv_port=self.kv_port + shift, extra=extra)


def launch_of(start: str) -> str:
    """A start of an instance as peers name it: 16 hex digits of what tells the start apart (any text: the connector
    passes vLLM's KV transfer engine id and instance id); "" for ""."""
    return hashlib.blake2b(start.encode(), digest_size=8).hexdigest() if start else ""


def parse_connector_config(
    role: str | None, kv_port: int, failure_policy: str, extra: Mapping[str, Any] | None, start: str = ""
) -> ConnectorConfig:
    parsed_role = _as_enum("kv_role", Role)(role)
    port = _as_int("kv_port", 1, 65535)(kv_port)
    policy = _as_enum("kv_load_failure_policy", LoadFailurePolicy)(failure_policy)
    parsed = parse_extra_config(extra)
    if parsed.heartbeat_format is HeartbeatFormat.LEGACY and parsed_role is Role.BOTH:
        raise ConfigError("heartbeat_format: legacy heartbeats say P or D; a kv_both instance needs p2pkv's")
    return ConnectorConfig(role=parsed_role, kv_port=port, failure_policy=policy, extra=parsed,
                           launch=launch_of(start))
