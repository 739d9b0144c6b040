"""`p2pkv up`: a local xPyD cluster with the proxy in front, stopped cleanly on Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Any

from p2pkv.bench.cluster import Cluster, InstanceSpec, free_port, free_ports, wait_for_huge_pages
from p2pkv.config import AUTH_SECRET_ENV, parse_extra_config
from p2pkv.errors import ConfigError, P2pkvError
from p2pkv.hostaddr import is_loopback
from p2pkv.models import ModelUnavailable, resolve_model
from p2pkv.proxy.admin import ADMIN_KEY_ENV
from p2pkv.proxy.trace import TRANSFER_HEADER

DISCOVERY_TIMEOUT_S = 30.0
REFUSALS_WAIT_S = 8.0  # for the proxy to hear of a refusal after the demo request (a heartbeat every 3 s by default)
DEMO_PROMPT = "Disaggregated serving moves the KV cache from the prefill instance to the decode instance."
DEMO_QUESTION = "What is the capital of France? Answer in one sentence."


def _say(text: str) -> None:
    print(f"[p2pkv up] {text}", flush=True)


def _ports(base: int, count: int, host: str) -> list[int]:
    return [base + i for i in range(count)] if base else free_ports(count, host)


# Keys every instance must share (the proxy is one, and checks one secret), so not given per role. `send_type` may
# differ: a link pulls when either side's is GET (decode instances with GET tell the proxy, which asks for pulls).
_SHARED_KEYS = ("auth_secret", "proxy_ip", "proxy_port")


def _extra_config(text: str, option: str = "--extra-config", base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON object of an extra-config option, checked as the instances will check it (merged over `base`,
    the keys for every instance, for a role's own option)."""
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{option}: not valid JSON ({exc})") from None
    if not isinstance(extra, dict):
        raise ConfigError(f"{option}: expected a JSON object of kv_connector_extra_config keys")
    if base is not None and (shared := [k for k in _SHARED_KEYS if k in extra]):
        raise ConfigError(f"{option}: {', '.join(shared)} must be the same on every instance: give it in "
                          "--extra-config")
    try:
        parse_extra_config({**(base or {}), **extra})  # fail here, with the key named, rather than in every vLLM
    except ConfigError as exc:
        raise ConfigError(f"{option}: {exc}") from None
    return extra


def _vllm_args(text: str, option: str) -> tuple[str, ...]:
    """`text` split as a shell splits it."""
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:
        raise ConfigError(f"{option}: {exc}") from None


def _events_dir(args: argparse.Namespace, vllm_args: tuple[str, ...]) -> Path | None:
    """A folder of this user's own (a socket's path has room for about 100 bytes, so not under the log folder)
    where the instances publish their KV cache events on ipc sockets (only this host can subscribe), when the proxy
    routes by them and the vLLM arguments do not configure them already; None otherwise."""
    wanted = args.prefill_policy == "prefix" or args.decode_only_below
    if not wanted or any(a.startswith("--kv-events-config") for a in vllm_args):
        return None
    return Path(tempfile.gettempdir()) / f"p2pkv-events-{secrets.token_hex(8)}"  # made by `run_up` at start


def _events_args(folder: Path | None, name: str, dp_size: int) -> tuple[str, ...]:
    if folder is None:
        return ()
    if dp_size > 1:
        # vLLM offsets a data-parallel engine's endpoint by its rank for tcp ports only; the proxy routes these by
        # load (or pass --kv-events-config with a tcp://*:PORT endpoint, which listens beyond loopback).
        _say(f"{name}: data-parallel engines publish no KV cache events here; the proxy routes them by load")
        return ()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{folder}/{name}"}
    return ("--kv-events-config", json.dumps(config))


def build_cluster(args: argparse.Namespace, model: str, log_dir: Path) -> tuple[Cluster, dict[str, Any]]:
    """The cluster to start, and what the ready file will say about it."""
    cluster = Cluster(model=model, log_dir=log_dir, host=args.host, dtype=args.dtype, kv_cache_gb=args.kv_cache_gb)
    shared = _extra_config(args.extra_config)
    if not shared.get("auth_secret") and not os.environ.get(AUTH_SECRET_ENV):
        # Heartbeats and KV frames are signed, also on loopback: any local user could otherwise join the cluster.
        # Passed in the environment (read by the connector and the proxy), not on command lines anyone can list.
        cluster.extra_env[AUTH_SECRET_ENV] = secrets.token_hex(32)
    if not is_loopback(args.host) and not os.environ.get(ADMIN_KEY_ENV):
        # Its own calls to the proxy's admin routes (`/instances`) come from beyond loopback: they need a key.
        cluster.extra_env[ADMIN_KEY_ENV] = secrets.token_hex(32)
    n = args.prefill + args.decode
    # Rank r of an instance (over its pipeline stages and data-parallel engines) binds its KV and metrics ports + r.
    ranks = max(args.prefill_tp * args.prefill_pp * args.prefill_dp, args.decode_tp * args.decode_pp * args.decode_dp)
    if args.base_port:
        http_ports = _ports(args.base_port, n, args.host)
        kv_ports, metrics_ports = ([args.base_port + k * 1000 + i * ranks for i in range(n)] for k in (1, 2))
        discovery_port = args.base_port + 3000
    else:
        ports = free_ports(n + 2, args.host)
        http_ports = ports[:n]
        args.port = args.port or ports[-1]
        discovery_port = ports[-2]
        blocks = free_ports(2 * n, args.host, run=ranks, avoid=ports)
        kv_ports, metrics_ports = blocks[:n], blocks[n:]
    extra_vllm = tuple(a for a in args.vllm_args if a != "--")
    own_vllm = {role: _vllm_args(text, f"--{role}-vllm-args")
                for role, text in (("prefill", args.prefill_vllm_args), ("decode", args.decode_vllm_args))}
    # The instances find the proxy by heartbeats, as in a real deployment; nothing is listed statically.
    extra = {"send_type": args.send_type, "proxy_ip": args.host, "proxy_port": discovery_port, **shared}
    own = {role: _extra_config(text, f"--{role}-extra-config", shared)
           for role, text in (("prefill", args.prefill_extra_config), ("decode", args.decode_extra_config))}
    described = []
    events = _events_dir(args, extra_vllm)
    for i in range(n):
        is_prefill = i < args.prefill
        role = "kv_producer" if is_prefill else "kv_consumer"
        name = f"prefill{i}" if is_prefill else f"decode{i - args.prefill}"
        spec = InstanceSpec(role, http_ports[i], kv_ports[i],
                            {**extra, **own["prefill" if is_prefill else "decode"], "metrics_port": metrics_ports[i],
                             "http_port": http_ports[i]},
                            # the user's arguments last: one of theirs overrides ours
                            _events_args(events, name, args.prefill_dp if is_prefill else args.decode_dp)
                            + extra_vllm + own_vllm["prefill" if is_prefill else "decode"],
                            args.kv_load_failure_policy,
                            args.prefill_tp if is_prefill else args.decode_tp,
                            args.prefill_pp if is_prefill else args.decode_pp,
                            args.prefill_dp if is_prefill else args.decode_dp)
        cluster.add_vllm(name, spec)
        described.append({"name": name, "role": role, "http": f"{args.host}:{http_ports[i]}",
                          "kv": f"{args.host}:{kv_ports[i]}", "metrics": f"{args.host}:{metrics_ports[i]}",
                          "tp_size": spec.tp_size, "pp_size": spec.pp_size, "dp_size": spec.dp_size})
    proxy_port = args.port or free_port(args.host)
    cluster.add_proxy(proxy_port, [], [], discovery_port, secret=extra.get("auth_secret", ""),
                      args=("--prefill-policy", args.prefill_policy,
                            "--decode-only-below", str(args.decode_only_below),
                            "--decode-alongside", args.decode_alongside))
    described_cluster = {"proxy": f"http://{args.host}:{proxy_port}", "discovery": f"{args.host}:{discovery_port}",
                         "model": model, "instances": described, "log_dir": str(log_dir)}
    if events is not None:
        described_cluster["kv_events_dir"] = str(events)
    return cluster, described_cluster


def _listed(proxy_url: str, admin_key: str = "") -> list[dict[str, Any]]:
    """The instances the proxy lists (`GET /instances`, an admin route); none if it does not answer."""
    headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{proxy_url}/instances", headers=headers),
                                    timeout=2) as resp:
            instances: list[dict[str, Any]] = json.loads(resp.read())["instances"]
            return instances
    except (OSError, ValueError, KeyError, TypeError):
        return []


def wait_discovered(proxy_url: str, expected: int, timeout_s: float, admin_key: str = "") -> None:
    """Wait until the proxy has heard from every instance."""
    deadline = time.monotonic() + timeout_s
    while True:
        known = len(_listed(proxy_url, admin_key))
        if known >= expected:
            return
        if time.monotonic() > deadline:
            raise P2pkvError(f"the proxy heard heartbeats from {known} of {expected} instances in {timeout_s:.0f} s")
        time.sleep(0.2)


def has_chat_template(model: str) -> bool:
    """A model directory whose tokenizer has a chat template (the tiny test model's has none)."""
    root = Path(model)
    if (root / "chat_template.jinja").exists():
        return True
    try:
        return bool(json.loads((root / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def send_demo_request(proxy_url: str, model: str, chat: bool = False) -> tuple[str, bool]:
    """One request through the proxy (`chat`: a question to the chat API): a line describing its answer, and
    whether its prompt's KV moved (the decode instance found prompt tokens cached: those it loaded)."""
    if chat:
        body = {"model": model, "messages": [{"role": "user", "content": DEMO_QUESTION}], "max_tokens": 40,
                "temperature": 0}
    else:
        body = {"model": model, "prompt": DEMO_PROMPT, "max_tokens": 16, "temperature": 0}
    request = urllib.request.Request(f"{proxy_url}/v1/{'chat/' if chat else ''}completions",
                                     data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as resp:
        answer = json.loads(resp.read())
        transfer = resp.headers.get(TRANSFER_HEADER, "")
    choice = answer["choices"][0]
    text: str = choice["message"]["content"] if chat else choice["text"]
    cached = answer["usage"].get("prompt_tokens_details", {}) or {}
    asked = f"asked {DEMO_QUESTION!r}: answer={text.strip()!r}" if chat else f"completion={text!r}"
    line = (f"{asked} prompt_tokens={answer['usage']['prompt_tokens']} cached_on_decode={cached.get('cached_tokens')} "
            f"transfer={transfer} (every log line about its KV names it)")
    return line, bool(cached.get("cached_tokens"))


def listed_refusals(proxy_url: str, wait_s: float, admin_key: str = "") -> list[str]:
    """The refusals the proxy lists (`GET /instances`: instances whose KV workers refused another's at their
    hello), one line each; waited for up to `wait_s` (a heartbeat carries them), none if none came."""
    deadline = time.monotonic() + wait_s
    while True:
        lines = [f"{i['role']} instance {i['address']} refused the KV worker at {r['address']}: {r['reason']}"
                 for i in _listed(proxy_url, admin_key) for r in i.get("refused") or ()]
        if lines or time.monotonic() >= deadline:
            return lines
        time.sleep(0.5)


def run_up(args: argparse.Namespace) -> int:
    if args.prefill < 1 or args.decode < 1:
        raise SystemExit("p2pkv up: --prefill and --decode must be at least 1")
    if min(args.prefill_tp, args.decode_tp, args.prefill_pp, args.decode_pp, args.prefill_dp, args.decode_dp) < 1:
        raise SystemExit("p2pkv up: --prefill-tp, --decode-tp, --prefill-pp, --decode-pp, --prefill-dp and "
                         "--decode-dp must be at least 1")
    try:
        model = resolve_model(args.model, _say)
    except ModelUnavailable as exc:
        print(f"p2pkv up: {exc}", file=sys.stderr)
        return 1
    _say(f"serving the model in {model}")
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="p2pkv-up-"))
    cluster, description = build_cluster(args, model, log_dir)
    proxy_url = description["proxy"]
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    if AUTH_SECRET_ENV in cluster.extra_env:
        _say(f"heartbeats and KV frames are signed with a secret generated for this cluster (set {AUTH_SECRET_ENV} "
             "or auth_secret in --extra-config to choose it)")
    if ADMIN_KEY_ENV in cluster.extra_env:
        _say(f"the proxy's admin routes need a key beyond loopback: one was generated (set {ADMIN_KEY_ENV} to "
             "choose it and use them)")
    admin_key = cluster.env().get(ADMIN_KEY_ENV, "")
    _say(f"starting {args.prefill} prefill and {args.decode} decode vLLM instances; logs in {log_dir}")
    try:
        if "kv_events_dir" in description:  # this user's only; an existing one (not ours) is an error
            Path(description["kv_events_dir"]).mkdir(mode=0o700)
        cluster.start(args.ready_timeout, progress=_say)
        # A worker's KV cache in host memory is faulted in again in 2 MiB pages on a thread of its own (huge_pages):
        # ready once that is over, so that it does not share the cores with the first requests.
        wait_for_huge_pages([p for p in cluster.processes if p.ranks], progress=_say)
        # Each data-parallel engine announces itself: the proxy routes to each.
        engines = args.prefill * args.prefill_dp + args.decode * args.decode_dp
        wait_discovered(proxy_url, engines, DISCOVERY_TIMEOUT_S, admin_key)
        _say(f"proxy ready at {proxy_url}; it found every instance by its heartbeats")
        if args.ready_file:
            description["pids"] = [p.popen.pid for p in cluster.processes if p.popen is not None]
            Path(args.ready_file).write_text(json.dumps(description, indent=2))
        chat = has_chat_template(model)
        if chat:
            curl = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32})
        else:
            curl = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 16})
        _say(f"try: curl -s {proxy_url}/v1/{'chat/' if chat else ''}completions -H 'content-type: application/json' "
             f"-d '{curl}'")
        if args.demo:
            line, moved = send_demo_request(proxy_url, model, chat=chat)
            _say("demo request: " + line)
            if not moved:
                _say(f"the demo request's KV did not move: the decode instance computed its prompt itself (look for "
                     f"'load failed' and 'refusing peer' in {log_dir}/decode0.log and prefill0.log)")
                for refusal in listed_refusals(proxy_url, REFUSALS_WAIT_S, admin_key):
                    _say(refusal)
            if args.exit_after_demo:
                return 0 if moved else 1
        _say("serving; Ctrl-C stops everything")
        reported: set[str] = set()
        while not stop.is_set():
            for proc in cluster.processes:
                code = proc.exited()
                if code is None or proc.name in reported:
                    continue
                reported.add(proc.name)
                _say(f"{proc.name} exited with code {code}. Last log lines:\n{proc.log_tail()}")
            # The proxy routes around lost instances (with no prefill instance left a decode instance prefills
            # locally; a request sent to a lost decode instance goes again to another), so the cluster serves on
            # while the proxy and at least one decode instance are up.
            alive = {p.name for p in cluster.processes if p.exited() is None}
            if "proxy" not in alive or not any(n.startswith("decode") for n in alive):
                _say("the proxy or every decode instance is gone; stopping")
                return 1
            stop.wait(1.0)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _say("stopping all processes")
        cluster.stop()
        if "kv_events_dir" in description:  # the instances' event sockets
            shutil.rmtree(description["kv_events_dir"], ignore_errors=True)
        _say("stopped")
        sys.stdout.flush()
