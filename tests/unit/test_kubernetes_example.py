"""`examples/kubernetes/p2pkv-1p1d.yaml` against the project's own parsers and docs: every vLLM container's
kv-transfer-config is one the connector accepts (its keys, its role, its ports on the container and the Service),
names the proxy's Service and discovery port, and uses the keys `docs/deployment.md` documents for it; the proxy's
command line is one `p2pkv proxy` takes."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from p2pkv.cli.main import build_parser
from p2pkv.config import Role, parse_connector_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "kubernetes" / "p2pkv-1p1d.yaml"


def _documents() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(EXAMPLE.read_text()) if doc]


def _by(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in _documents() if doc["kind"] == kind}


def _script(deployment: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["/bin/sh", "-c"]
    (script,) = container["args"]
    # Kubernetes expands $(VAR) from the container's env before the shell runs.
    env = {e["name"]: e for e in container.get("env", [])}
    for name in re.findall(r"\$\((\w+)\)", script):
        assert name in env, f"$({name}) has no env entry"
    script = re.sub(r"\$\((\w+)\)", "10.1.2.3", script)
    install, _, run = script.partition("&&")
    assert install.split() == ["pip", "install", "p2pkv"]
    argv = shlex.split(run)
    assert argv[0] == "exec"
    return container, argv[1:]


def _documented_kv_config() -> dict[str, Any]:
    """The kv-transfer-config of the deployment page's section on other routers."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    section = text[text.index("## Behind another router"):]
    section = section[:section.index("\n## ")]
    quoted = re.search(r"--kv-transfer-config '([^']*)'", section, re.S)
    assert quoted is not None
    parsed: dict[str, Any] = json.loads(quoted[1])
    return parsed


def test_every_kind_the_example_promises_is_there() -> None:
    assert sorted(_by("Deployment")) == ["p2pkv-proxy", "vllm-decode", "vllm-prefill"]
    assert sorted(_by("Service")) == ["p2pkv-proxy", "vllm-decode", "vllm-prefill"]
    for name, deployment in _by("Deployment").items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"] == labels
        assert _by("Service")[name]["spec"]["selector"] == labels


def test_each_vllm_container_is_configured_as_the_connector_and_the_docs_expect() -> None:
    services = _by("Service")
    proxy_ports = {p["name"]: p["port"] for p in services["p2pkv-proxy"]["spec"]["ports"]}
    documented = _documented_kv_config()
    for name, role in (("vllm-prefill", Role.PRODUCER), ("vllm-decode", Role.CONSUMER)):
        container, argv = _script(_by("Deployment")[name])
        assert argv[:2] == ["vllm", "serve"]
        port = int(argv[argv.index("--port") + 1])
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == documented["kv_connector"] == "P2pNcclConnector"
        assert kv["kv_connector_module_path"] == documented["kv_connector_module_path"] == "p2pkv.vllm"
        assert set(documented["kv_connector_extra_config"]) <= set(kv["kv_connector_extra_config"])
        config = parse_connector_config(kv["kv_role"], kv["kv_port"], "recompute", kv["kv_connector_extra_config"])
        assert config.role is role
        assert config.extra.http_port == port and config.extra.kv_host == "10.1.2.3"
        assert [(a.host, a.port) for a in config.extra.proxies] == [("p2pkv-proxy", proxy_ports["discovery"])]
        container_ports = {p["containerPort"] for p in container["ports"]}
        assert {port, kv["kv_port"]} <= container_ports
        assert [p["targetPort"] for p in services[name]["spec"]["ports"]] == [port]


def test_the_proxy_runs_as_p2pkv_proxy_takes_it_on_its_services_ports() -> None:
    container, argv = _script(_by("Deployment")["p2pkv-proxy"])
    assert argv[:2] == ["p2pkv", "proxy"]
    args = build_parser().parse_args(argv[1:])
    ports = {p["name"]: p["targetPort"] for p in _by("Service")["p2pkv-proxy"]["spec"]["ports"]}
    assert (args.port, args.discovery_port) == (ports["http"], ports["discovery"])
    assert {args.port, args.discovery_port} <= {p["containerPort"] for p in container["ports"]}


def test_every_container_signs_with_one_secret() -> None:
    """The proxy listens for heartbeats beyond loopback, which it does only with a secret; the instances sign theirs
    (and their KV frames) with the same one."""
    sources = []
    for deployment in _by("Deployment").values():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in container.get("env", [])}
            sources.append(json.dumps(env["P2PKV_AUTH_SECRET"]["valueFrom"], sort_keys=True))
    assert len(sources) == 3 and len(set(sources)) == 1

