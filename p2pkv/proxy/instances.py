"""The proxy's view of its vLLM instances: addresses, KV addresses, and how to pick one."""

from __future__ import annotations

from dataclasses import dataclass

from p2pkv.errors import ConfigError
from p2pkv.params import Address


@dataclass(frozen=True)
class Instance:
    """One vLLM server: its OpenAI address and, for decode instances, its KV address (learned if not given)."""

    http: Address
    kv: Address | None = None

    @classmethod
    def parse(cls, text: str) -> Instance:
        """`HOST:PORT`, optionally `HOST:PORT@KVHOST:KVPORT`; an `http://` prefix is accepted."""
        text = text.removeprefix("http://").rstrip("/")
        http, sep, kv = text.partition("@")
        try:
            return cls(Address.parse(http), Address.parse(kv) if sep else None)
        except ConfigError as exc:
            raise ConfigError(f"instance {text!r}: expected HOST:PORT or HOST:PORT@KVHOST:KVPORT ({exc})") from None

    @property
    def url(self) -> str:
        return f"http://{self.http}"


@dataclass(frozen=True)
class ProxyConfig:
    prefill: tuple[Instance, ...]
    decode: tuple[Instance, ...]
    host: str = "127.0.0.1"
    port: int = 10001
    request_timeout_s: float = 600.0
    prefill_timeout_s: float = 120.0
    connect_timeout_s: float = 5.0
    prefill_retries: int = 2
    transfer_retries: int = 1  # times a request whose decode failed before answering is prefilled and decoded again
    prefill_policy: str = "least-outstanding"
    decode_policy: str = "least-outstanding"
    api_key: str = ""
    discovery_host: str = ""  # empty: the same as `host`
    discovery_port: int = 0  # 0: no discovery, static lists only
    heartbeat_misses: float = 3.0
    secret: str = ""  # shared secret: heartbeats must carry a valid HMAC

    def __post_init__(self) -> None:
        if not self.discovery_port and not self.prefill:
            raise ConfigError("--prefill: at least one prefill instance is required without discovery")
        if not self.discovery_port and not self.decode:
            raise ConfigError("--decode: at least one decode instance is required without discovery")
        if not 0 <= self.discovery_port < 65536:
            raise ConfigError("--discovery-port: expected 0 (off) or a port number")
        if self.heartbeat_misses < 1:
            raise ConfigError("--heartbeat-misses: expected at least 1")
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in ("least-outstanding", "round-robin"):
                raise ConfigError(f"--{name.replace('_', '-')}: expected least-outstanding or round-robin")
        if self.prefill_retries < 0:
            raise ConfigError("--prefill-retries: expected 0 or more")
        if self.transfer_retries < 0:
            raise ConfigError("--transfer-retries: expected 0 or more")
