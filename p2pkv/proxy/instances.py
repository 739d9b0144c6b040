"""The proxy's view of its vLLM instances: addresses, KV addresses, and how to pick one."""

from __future__ import annotations

from dataclasses import dataclass

from p2pkv.config import AUTH_SECRET_ENV, DECODE_POLICIES, PREFILL_POLICIES
from p2pkv.errors import ConfigError
from p2pkv.hostaddr import is_loopback
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
    prefill_policy: str = "prefix"  # by least outstanding where no instance publishes KV cache events
    decode_policy: str = "least-outstanding"
    api_key: str = ""
    discovery_host: str = ""  # empty: the same as `host`
    discovery_port: int = 0  # 0: no discovery, static lists only
    heartbeat_misses: float = 3.0
    secret: str = ""  # shared secret: heartbeats must carry a valid HMAC
    probe_interval_s: float = 10.0  # how often static instances without heartbeats are asked for them (0: never)
    # Discovery beyond loopback without `secret`: anyone who reaches the port could join the cluster, so only this.
    allow_unauthenticated_discovery: bool = False
    max_instances: int = 256  # instances known at once: heartbeats of new ones beyond are refused
    admin_key: str = ""  # opens the admin routes (`p2pkv.proxy.admin`); without it only loopback clients reach them
    max_body_mb: float = 16.0  # larger request bodies are answered 413
    max_prompts: int = 256  # prompts in one completion request; more are answered 400
    max_connections: int = 1024  # connections and requests served at once; more are answered 503
    body_timeout_s: float = 30.0  # for a client to send its whole request body; slower ones are answered 408
    # Prompts with fewer tokens than this left to compute on their decode instance (its prefix cache counted, as its
    # KV cache events say) go to it alone: no prefill hop, no transfer. 0: never.
    decode_only_below: int = 0
    # Send the decode request while its prefill runs, so that its intake and block allocation overlap the prefill and
    # the push lands in blocks already allocated; a failure of either side cancels the other.
    decode_alongside: bool = True

    @property
    def discovery_bind(self) -> str:
        return self.discovery_host or self.host

    @property
    def unauthenticated_beyond_loopback(self) -> bool:
        """Heartbeats from anyone who reaches the discovery port are taken (allowed by the flag)."""
        return bool(self.discovery_port) and not self.secret and not is_loopback(self.discovery_bind)

    def __post_init__(self) -> None:
        if not self.discovery_port and not self.prefill:
            raise ConfigError("--prefill: at least one prefill instance is required without discovery")
        if not self.discovery_port and not self.decode:
            raise ConfigError("--decode: at least one decode instance is required without discovery")
        if not 0 <= self.discovery_port < 65536:
            raise ConfigError("--discovery-port: expected 0 (off) or a port number")
        if not 0 <= self.probe_interval_s <= 3600:
            raise ConfigError("--probe-interval: expected 0 (off) to 3600 seconds")
        if self.unauthenticated_beyond_loopback and not self.allow_unauthenticated_discovery:
            raise ConfigError(f"discovery on {self.discovery_bind}:{self.discovery_port} listens beyond loopback: set "
                              f"{AUTH_SECRET_ENV} (the instances' auth_secret) so that only signed heartbeats count, "
                              "or pass --allow-unauthenticated-discovery to take anyone's")
        if self.max_instances < 1:
            raise ConfigError("--max-instances: expected at least 1")
        if self.admin_key and self.admin_key == self.api_key:
            raise ConfigError("P2PKV_PROXY_ADMIN_KEY: must differ from P2PKV_PROXY_API_KEY (clients must not reach "
                              "the admin routes)")
        if not 0 < self.max_body_mb <= 4096:
            raise ConfigError("--max-body-mb: expected more than 0 and at most 4096")
        if self.max_prompts < 1:
            raise ConfigError("--max-prompts: expected at least 1")
        if self.max_connections < 1:
            raise ConfigError("--max-connections: expected at least 1")
        if not 0 < self.body_timeout_s <= 3600:
            raise ConfigError("--body-timeout: expected more than 0 and at most 3600 seconds")
        if not 0 <= self.decode_only_below <= 1 << 20:
            raise ConfigError("--decode-only-below: expected 0 (off) to 1048576 tokens")
        if self.heartbeat_misses < 1:
            raise ConfigError("--heartbeat-misses: expected at least 1")
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ConfigError(f"--prefill-policy: expected one of {', '.join(PREFILL_POLICIES)}")
        if self.decode_policy not in DECODE_POLICIES:
            raise ConfigError(f"--decode-policy: expected one of {', '.join(DECODE_POLICIES)}")
        if self.prefill_retries < 0:
            raise ConfigError("--prefill-retries: expected 0 or more")
        if self.transfer_retries < 0:
            raise ConfigError("--transfer-retries: expected 0 or more")
        if self.stream_resumes < 0:
            raise ConfigError("--stream-resumes: expected 0 or more")
