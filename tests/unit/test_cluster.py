"""How `p2pkv up` starts its children: each in a process group of its own, stopped as one, in the launcher's
session (a session of its own would put each vLLM instance in a scheduling autogroup of its own, under which
engine threads were measured waiting seconds for a core); and the environment vLLM gets."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from p2pkv.bench.cluster import Cluster, Process, vllm_cpu_build, wait_for_huge_pages

# The child starts a grandchild (as vLLM's server starts its engine and workers), prints its pid, and waits.
_FAMILY = ("import subprocess, sys, time; "
           "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
           "print(g.pid, flush=True); time.sleep(60)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _grandchild(log: Path, deadline: float) -> int:
    while time.monotonic() < deadline:
        text = log.read_text().strip() if log.exists() else ""
        if text:
            return int(text.splitlines()[0])
        time.sleep(0.05)
    raise AssertionError("the child never reported its grandchild")


def test_children_share_the_launchers_session_in_a_group_of_their_own(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    proc = Process("child", [sys.executable, "-c", _FAMILY], log, dict(os.environ), "http://127.0.0.1:1/health")
    proc.start()
    assert proc.popen is not None
    try:
        child = proc.popen.pid
        grandchild = _grandchild(log, time.monotonic() + 30)
        assert os.getsid(child) == os.getsid(0)  # no session (and so no autogroup) of its own
        assert os.getpgid(child) == child != os.getpgid(0)
        assert os.getpgid(grandchild) == child
    finally:
        proc.stop(grace_s=5)
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)  # the whole group went


def test_cpu_builds_start_with_aot_compilation_off_unless_the_user_set_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's CPU build fails to load the AOT artifact it saves, so every start compiled twice over.
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    cluster = Cluster("model", tmp_path)
    assert cluster.env().get("VLLM_USE_AOT_COMPILE") == ("0" if vllm_cpu_build() else None)
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert cluster.env()["VLLM_USE_AOT_COMPILE"] == "1"


def test_the_cpu_build_is_recognised_by_its_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def version(name: str) -> str:
        if name == "vllm-cpu":
            return "0.32.0"
        raise importlib.metadata.PackageNotFoundError(name)

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert vllm_cpu_build()
    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert not vllm_cpu_build()


def test_ready_waits_for_this_starts_huge_page_fault_in_only(tmp_path: Path) -> None:
    """A worker's log says when its KV cache was handed back for huge pages and when it was faulted in again;
    ready waits for the second. A log folder used again keeps an earlier start's lines, one stopped mid fault-in
    among them: only this start's lines count."""
    log = tmp_path / "decode.log"
    log.write_text("KV cache: 1024 MiB advised for 2 MiB pages, 1024 MiB of it handed back\n")  # stopped before the end
    script = ("import sys, time; print('KV cache: 1024 MiB advised for 2 MiB pages', flush=True); time.sleep(0.5); "
              "print('KV cache: 1024 MiB faulted in again, 1024 MiB now in huge pages', flush=True); time.sleep(30)")
    proc = Process("decode", [sys.executable, "-c", script], log, dict(os.environ), "http://127.0.0.1:1/health", 1)
    proc.start()
    try:
        deadline = time.monotonic() + 10  # as the instance serves: it has said that its cache was handed back
        while log.read_text().count("advised for") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        started = time.monotonic()
        assert wait_for_huge_pages([proc], timeout_s=10, progress=lambda line: None)
        assert "now in huge pages" in log.read_text(), "ready before its own fault-in ended"
        assert time.monotonic() - started < 5, "ready only at the deadline, waiting on an earlier start's lines"
    finally:
        assert proc.popen is not None
        proc.popen.kill()
        proc.popen.wait(10)


def test_a_nixl_peer_instance_runs_vllms_nixl_connector_with_its_own_side_channel(tmp_path: Path) -> None:
    """`p2pkv bench serve --via nixl`: vLLM's NixlConnector (both roles, DRAM on a CPU build), each instance's
    handshake on its own side-channel port; a p2pkv instance beside it keeps p2pkv's connector."""
    import json

    from p2pkv.bench.cluster import InstanceSpec, vllm_argv

    cluster = Cluster("model", tmp_path)
    prefill = cluster.add_vllm("prefill", InstanceSpec("kv_producer", 8100, 8200, connector="nixl"))
    decode = cluster.add_vllm("decode", InstanceSpec("kv_consumer", 8101, 8201, connector="nixl"))
    ours = cluster.add_vllm("ours", InstanceSpec("kv_consumer", 8102, 8202))
    configs = [json.loads(p.argv[p.argv.index("--kv-transfer-config") + 1]) for p in (prefill, decode, ours)]
    device = "cpu" if vllm_cpu_build() else "cuda"
    assert configs[:2] == [{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": device}] * 2
    assert configs[2]["kv_connector"] == "P2pNcclConnector" and configs[2]["kv_role"] == "kv_consumer"
    assert [p.env.get("VLLM_NIXL_SIDE_CHANNEL_PORT") for p in (prefill, decode, ours)] == ["8200", "8201", None]
    assert prefill.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert "NixlConnector" not in " ".join(vllm_argv("model", InstanceSpec("", 8103), "127.0.0.1", "float32"))
