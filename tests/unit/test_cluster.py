"""How `p2pkv up` starts its children: each in a process group of its own, stopped as one, in the launcher's
session (a session of its own would put each vLLM instance in a scheduling autogroup of its own, under which
engine threads were measured waiting seconds for a core)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from p2pkv.cli.cluster import Process

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
