"""Starts and stops a local xPyD cluster: vLLM servers with the p2pkv connector, and the proxy.

Each child runs in its own process group and is told to die with its parent, so nothing is orphaned when the
launcher exits, is interrupted, or is killed.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2pkv.config import AUTH_SECRET_ENV
from p2pkv.errors import ConfigError, P2pkvError

_PR_SET_PDEATHSIG = 1


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int, host: str = "127.0.0.1", run: int = 1, avoid: Sequence[int] = ()) -> list[int]:
    """`count` distinct ports that are free now, below the ephemeral range and not in `avoid`; with `run`, each is
    the first of `run` consecutive free ports (an instance's tensor-parallel ranks bind its KV port plus their
    rank).

    Ports from the ephemeral range (what binding port 0 gives) can be taken by any process's outgoing connection
    or auto-bound socket in the minute before vLLM binds them; seen here as "Address already in use".
    """
    low, high = 10000, _ephemeral_low() - run
    rng = random.SystemRandom()
    chosen: list[int] = []
    for _ in range(_MAX_TRIES):
        if len(chosen) == count:
            return chosen
        port = rng.randrange(low, high)
        if any(abs(port - c) < run for c in chosen) or any(port <= a < port + run for a in avoid):
            continue
        if all(_bindable(host, p) for p in range(port, port + run)):
            chosen.append(port)
    if len(chosen) == count:
        return chosen
    raise ConfigError(f"found {len(chosen)} of {count} free ports on {host} in {_MAX_TRIES} tries: is {host} an "
                      "address of this host?")


_MAX_TRIES = 4096  # a host this machine cannot bind finds no port: said, not looped on for ever


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def _die_with_parent() -> None:
    # A process group of its own (stopped as one), but the launcher's session: a new session would give each
    # instance a scheduling autogroup of its own, and the kernel then shares each core between those groups as
    # wholes. vLLM's CPU workers are pinned to cores and spin between steps; with the instances in separate groups,
    # engine I/O threads on those cores were measured waiting 1 to 30 s to run (pulls failed at their deadline).
    os.setpgid(0, 0)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Process:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    health_url: str
    ranks: int = 0  # vLLM worker processes (tensor- x pipeline- x data-parallel size); 0 for the proxy
    popen: subprocess.Popen[bytes] | None = None
    log_start: int = 0  # where this start's lines begin in its log (a log folder used again is appended to)

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.log_start = log.tell()
        try:
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                          stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        finally:
            log.close()

    def exited(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 15.0) -> None:
        """Terminate the process's whole group, then kill what is left of it: whether or not its leader has exited
        (vLLM's API server killed, its EngineCore and workers live on in its group)."""
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
        except ProcessLookupError:  # nothing of the group is left
            self.popen.poll()
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _group_alive(self.popen.pid):
            self.popen.poll()  # reaps the leader, so that the group's liveness counts its other members only
            time.sleep(0.1)
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (failure tests)."""
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)


@dataclass
class InstanceSpec:
    role: str  # "kv_producer", "kv_consumer" or "" for an instance without the connector
    http_port: int
    kv_port: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    vllm_args: tuple[str, ...] = ()
    failure_policy: str = "recompute"
    tp_size: int = 1  # tensor-parallel size: ranks bind kv_port + rank (and metrics_port + rank)
    pp_size: int = 1  # pipeline-parallel size: stage s's ranks come after the earlier stages' (s * tp_size + rank)
    dp_size: int = 1  # data-parallel size: engine d's ranks come after the earlier engines' (d * tp * pp + ...)
    # "p2pkv", or "nixl": vLLM's own NixlConnector (kv_both; its side channel on kv_port), a peer to measure against
    connector: str = "p2pkv"

    @property
    def ranks(self) -> int:
        """Workers over all its engines: each binds a KV port (and a metrics port, and on a CPU build a core)."""
        return self.tp_size * self.pp_size * self.dp_size


def vllm_argv(model: str, spec: InstanceSpec, host: str, dtype: str) -> list[str]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
            "--port", str(spec.http_port), "--dtype", dtype, "--enable-prompt-tokens-details"]
    if spec.role and spec.connector == "nixl":
        nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                "kv_buffer_device": "cpu" if vllm_cpu_build() else "cuda"}
        argv += ["--kv-transfer-config", json.dumps(nixl)]
    elif spec.role:
        config = {"kv_connector": "P2pNcclConnector", "kv_connector_module_path": "p2pkv.vllm",
                  "kv_role": spec.role, "kv_port": spec.kv_port, "kv_load_failure_policy": spec.failure_policy,
                  "kv_connector_extra_config": {"kv_host": host, **spec.extra}}
        argv += ["--kv-transfer-config", json.dumps(config)]
    if spec.tp_size > 1:
        argv += ["--tensor-parallel-size", str(spec.tp_size)]
    if spec.pp_size > 1:
        argv += ["--pipeline-parallel-size", str(spec.pp_size)]
    if spec.dp_size > 1:
        argv += ["--data-parallel-size", str(spec.dp_size)]
    return argv + list(spec.vllm_args)


def vllm_cpu_build() -> bool:
    """vLLM's CPU build is installed (its distribution is `vllm-cpu`); found without importing vLLM."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@dataclass
class Cluster:
    model: str
    log_dir: Path
    host: str = "127.0.0.1"
    dtype: str = "float32"
    kv_cache_gb: float = 1.0  # 0: none set here (each instance sizes its cache by --kv-cache-memory-bytes)
    processes: list[Process] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)  # set in every process it starts

    def env(self) -> dict[str, str]:
        env = {**os.environ, **self.extra_env}
        if self.kv_cache_gb:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.kv_cache_gb:g}")
        else:  # vLLM's CPU build would take it over each instance's own --kv-cache-memory-bytes
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        # vLLM's CPU linear layers keep their own cache of 32 oneDNN GEMM kernels per layer, keyed by the number of
        # tokens in the batch. oneDNN's global primitive cache (1024 entries by default) keeps a second copy of each,
        # about 256 KiB of JIT code apiece: a prefill instance, which sees many batch sizes, grows by ~400 MiB
        # before that cache is full (found with memray; see docs/design.md, "Memory"). Without it memory stays flat
        # and throughput is unchanged.
        env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")
        if vllm_cpu_build():
            # vLLM's CPU build (0.32) compiles the model and saves it as an AOT artifact at every start, then fails
            # to load that artifact at the next one ("'function' object has no attribute 'finalize_loading'") and
            # compiles and saves it again: 18 to 31 s of engine start-up for one tiny-model instance here, against
            # 6 to 7 s with AOT compilation off.
            env.setdefault("VLLM_USE_AOT_COMPILE", "0")
        # The package must import in vLLM's spawned EngineCore and worker processes.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        return env

    def add_vllm(self, name: str, spec: InstanceSpec) -> Process:
        env = self.env()
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vLLM's CPU build pins every instance to the same cores by default, where their idle loops spin;
            # spread the instances of this host over its cores instead.
            # One core per rank ("0|1" binds rank 0 to core 0, rank 1 to core 1).
            cores = sorted(os.sched_getaffinity(0))
            index = sum(p.ranks for p in self.processes)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cores[(index + r) % len(cores)])
                                                        for r in range(spec.ranks))
        if spec.connector == "nixl":  # NIXL's handshake listens on its side channel, one port per instance
            env.update(VLLM_NIXL_SIDE_CHANNEL_HOST=self.host, VLLM_NIXL_SIDE_CHANNEL_PORT=str(spec.kv_port))
        proc = Process(name, vllm_argv(self.model, spec, self.host, self.dtype), self.log_dir / f"{name}.log",
                       env, f"http://{self.host}:{spec.http_port}/health", spec.ranks)
        self.processes.append(proc)
        return proc

    def add_proxy(self, port: int, prefill: Sequence[str], decode: Sequence[str], discovery_port: int = 0,
                  secret: str = "", args: Sequence[str] = (), name: str = "proxy") -> Process:
        """The proxy, with static instance lists, discovery on `discovery_port`, or both; `secret` is the shared
        secret heartbeats must be signed with; `args`: more of its options; `name`: its process's (and log's)."""
        argv = [sys.executable, "-m", "p2pkv", "proxy", "--host", self.host, "--port", str(port),
                "--discovery-port", str(discovery_port), *args]
        if prefill:
            argv += ["--prefill", *prefill]
        if decode:
            argv += ["--decode", *decode]
        env = self.env()
        if secret:
            env[AUTH_SECRET_ENV] = secret
        proc = Process(name, argv, self.log_dir / f"{name}.log", env, f"http://{self.host}:{port}/health")
        self.processes.append(proc)
        return proc

    def add_router(self, port: int, prefill: Sequence[str], decode: Sequence[str]) -> Process:
        """`p2pkv.bench.router` (vLLM's standard disaggregation protocol) in front of instances given by base URL."""
        argv = [sys.executable, "-m", "p2pkv.bench.router", "--host", self.host, "--port", str(port),
                "--prefill", *prefill, "--decode", *decode]
        proc = Process("router", argv, self.log_dir / "router.log", self.env(), f"http://{self.host}:{port}/health")
        self.processes.append(proc)
        return proc

    def start(self, timeout_s: float = 900.0, progress: Callable[[str], None] | None = None) -> None:
        """Start every process not yet running and wait until all are healthy, or raise with the log tail."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for proc in self.processes:
            if proc.popen is None:
                proc.start()
        self.wait_healthy(self.processes, timeout_s, progress)

    def wait_healthy(self, procs: Sequence[Process], timeout_s: float,
                     progress: Callable[[str], None] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        started = time.monotonic()
        last_report = 0.0
        pending = list(procs)
        while pending:
            for proc in list(pending):
                code = proc.exited()
                if code is not None:
                    raise P2pkvError(f"{proc.name} exited with code {code}; last log lines:\n{proc.log_tail()}")
                if proc.healthy():
                    pending.remove(proc)
                    if progress:
                        progress(f"{proc.name} is ready ({time.monotonic() - started:.0f} s)")
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                raise P2pkvError(f"not healthy after {timeout_s:.0f} s: {names}; see {self.log_dir}")
            if progress and time.monotonic() - last_report > 10:
                last_report = time.monotonic()
                waiting = ", ".join(p.name for p in pending)
                progress(f"waiting for {waiting} ({time.monotonic() - started:.0f} s)")
            time.sleep(0.5)

    def stop(self) -> None:
        """Proxy first, then the instances, each process group terminated then killed after a grace period."""
        for proc in reversed(self.processes):
            proc.stop()


HUGE_PAGES_WAIT_S = 300.0
_ADVISED = "advised for 2 MiB pages"  # p2pkv.memory.huge's log lines: a worker's KV cache handed back ...
_ENDED = ("now in huge pages", "faulting in huge pages failed")  # ... and faulted in again, or not


def wait_for_huge_pages(procs: list[Process], timeout_s: float = HUGE_PAGES_WAIT_S,
                        progress: Callable[[str], None] = print) -> bool:
    """Until each worker whose KV cache was handed back to be faulted in again in 2 MiB pages (`huge_pages`) has
    faulted it in, as its log says: that runs on a thread of its own while the instance serves (about 20 s for
    1 GiB on two busy cores): resident memory noted meanwhile would count the rest of it as growth, and requests
    timed meanwhile share the host with it. False if the time ran out (the caller goes on)."""
    started, said = time.monotonic(), 0.0
    for proc in procs:
        while not _faulted_in(proc):
            waited = time.monotonic() - started
            if waited >= timeout_s:
                progress(f"{proc.name}: its KV cache was not faulted in again within {timeout_s:.0f} s; going on")
                return False
            if waited >= said + 10:
                said = waited
                progress(f"waiting for {proc.name}'s KV cache to be faulted in again in huge pages ({waited:.0f} s)")
            time.sleep(0.2)
    return True


def _faulted_in(proc: Process) -> bool:
    try:
        with proc.log_path.open("rb") as log:
            log.seek(proc.log_start)
            text = log.read().decode(errors="replace")
    except OSError:  # no log yet: nothing said to wait for
        return True
    return sum(text.count(line) for line in _ENDED) >= text.count(_ADVISED)
