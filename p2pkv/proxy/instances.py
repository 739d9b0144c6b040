"""The proxy's view of its vLLM instances: addresses, KV addresses, and how to pick one."""

from __future__ import annotations

from dataclasses import dataclass

from p2pkv.errors import ConfigError
from p2pkv.params import Address

DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM's: which of the API server's engines serves the request
MAX_DP_RANK = 4095


@dataclass(frozen=True)
class Instance:
    """One vLLM engine the proxy can route to: its OpenAI address; for decode instances, its KV address (learned
    if not given); and where one API server fronts several data-parallel engines, the rank that reaches this one."""

    http: Address
    kv: Address | None = None
    dp_rank: int | None = None

    @classmethod
    def parse(cls, text: str) -> Instance:
        """`HOST:PORT`, optionally `HOST:PORT@KVHOST:KVPORT`, then optionally `#RANK` (a data-parallel rank);
        an `http://` prefix is accepted."""
        text = text.removeprefix("http://").rstrip("/")
        addresses, hashed, rank = text.partition("#")
        http, sep, kv = addresses.partition("@")
        expected = "expected HOST:PORT[@KVHOST:KVPORT][#RANK]"
        if hashed and not (rank.isdigit() and int(rank) <= MAX_DP_RANK):
            raise ConfigError(f"instance {text!r}: {expected}, RANK a data-parallel rank from 0 to {MAX_DP_RANK}")
        try:
            return cls(Address.parse(http), Address.parse(kv) if sep else None, int(rank) if hashed else None)
        except ConfigError as exc:
            raise ConfigError(f"instance {text!r}: {expected} ({exc})") from None

    @property
    def url(self) -> str:
        return f"http://{self.http}"

    @property
    def name(self) -> str:
        """How logs and trace headers name it: `HOST:PORT`, or `HOST:PORT#RANK` for a data-parallel engine."""
        return str(self.http) if self.dp_rank is None else f"{self.http}#{self.dp_rank}"

    def same_engine(self, other: Instance) -> bool:
        return self.http == other.http and self.dp_rank == other.dp_rank

    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        """`headers` for a request to this engine: with the rank that pins it there, for a data-parallel one."""
        return headers if self.dp_rank is None else {**headers, DP_RANK_HEADER: str(self.dp_rank)}


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
    stream_resumes: int = 1  # times a completion stream that broke off after its answer began is resumed (resume.py)
    prefill_policy: str = "least-outstanding"
    decode_policy: str = "least-outstanding"
    api_key: str = ""
    discovery_host: str = ""  # empty: the same as `host`
    discovery_port: int = 0  # 0: no discovery, static lists only
    heartbeat_misses: float = 3.0
    secret: str = ""  # shared secret: heartbeats must carry a valid HMAC
    probe_interval_s: float = 10.0  # how often static instances without heartbeats are asked for them (0: never)

    def __post_init__(self) -> None:
        if not self.discovery_port and not self.prefill:
            raise ConfigError("--prefill: at least one prefill instance is required without discovery")
        if not self.discovery_port and not self.decode:
            raise ConfigError("--decode: at least one decode instance is required without discovery")
        if not 0 <= self.discovery_port < 65536:
            raise ConfigError("--discovery-port: expected 0 (off) or a port number")
        if not 0 <= self.probe_interval_s <= 3600:
            raise ConfigError("--probe-interval: expected 0 (off) to 3600 seconds")
        if self.heartbeat_misses < 1:
            raise ConfigError("--heartbeat-misses: expected at least 1")
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in ("least-outstanding", "round-robin"):
                raise ConfigError(f"--{name.replace('_', '-')}: expected least-outstanding or round-robin")
        if self.prefill_retries < 0:
            raise ConfigError("--prefill-retries: expected 0 or more")
        if self.transfer_retries < 0:
            raise ConfigError("--transfer-retries: expected 0 or more")
        if self.stream_resumes < 0:
            raise ConfigError("--stream-resumes: expected 0 or more")
