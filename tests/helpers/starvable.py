"""A receiving engine in a process of its own, whose threads or file descriptors a test takes away and gives back
(the listener's security tests).

    python tests/helpers/starvable.py SECRET MAX_CONNECTIONS HANDSHAKE_S
        prints {"address": ...}, then answers each stdin line with a JSON line:
        "threads off" / "threads on"   no thread can be started (address space capped) / as before
        "fds off" / "fds on"           no descriptor can be opened (RLIMIT_NOFILE) / as before
        "totals"                       the engine's counters
        "check TID SEED BLOCKS"        the pushed transfer's state, and whether its bytes are the ones sent
"""

from __future__ import annotations

import json
import os
import re
import resource
import select
import subprocess
import sys
from dataclasses import replace

import numpy as np

from tests.helpers.peer import engine_config, layout, payload
from tests.helpers.procs import BLOCK_BYTES, LAYERS, ROOT

_MARGIN = 2 << 20  # address space left: small allocations go on, a thread's 8 MiB stack does not fit


def _address_space() -> int:
    with open("/proc/self/status") as status:
        found = re.search(r"VmSize:\s+(\d+) kB", status.read())
    assert found is not None
    return int(found.group(1)) * 1024


def _lowest_free_fd() -> int:
    probe = os.dup(0)  # the kernel gives the lowest free number
    os.close(probe)
    return probe


def main(secret: str, max_connections: int, handshake_s: float) -> None:
    from p2pkv.engine import EngineSettings, TransferEngine

    settings = EngineSettings.from_config(engine_config(kv_host="127.0.0.1", auth_secret=secret,
                                                        transfer_timeout_s=handshake_s), 0, 0)
    engine = TransferEngine(replace(settings, max_connections=max_connections), layout(LAYERS, BLOCK_BYTES))
    engine.start()
    address_space = resource.getrlimit(resource.RLIMIT_AS)
    files = resource.getrlimit(resource.RLIMIT_NOFILE)
    print(json.dumps({"address": engine.address}), flush=True)
    try:
        for line in sys.stdin:
            words = line.split()
            out: dict[str, object] = {"ok": True}
            if words == ["threads", "off"]:
                resource.setrlimit(resource.RLIMIT_AS, (_address_space() + _MARGIN, address_space[1]))
            elif words == ["threads", "on"]:
                resource.setrlimit(resource.RLIMIT_AS, address_space)
            elif words == ["fds", "off"]:
                resource.setrlimit(resource.RLIMIT_NOFILE, (_lowest_free_fd(), files[1]))
            elif words == ["fds", "on"]:
                resource.setrlimit(resource.RLIMIT_NOFILE, files)
            elif words == ["totals"]:
                out = engine.metrics.totals()  # type: ignore[assignment]
            elif words and words[0] == "check":
                tid, seed, blocks = words[1], int(words[2]), int(words[3])
                state = engine.wait_staged(tid, 10)
                item = engine.take_staged(tid)
                exact = False
                if item is not None:
                    want = payload(seed, LAYERS, blocks, BLOCK_BYTES)
                    exact = all(np.array_equal(np.frombuffer(item.layer_view(layer), dtype=np.uint8), want[layer])
                                for layer in range(LAYERS))
                    engine.release_staged(item)
                out = {"state": None if state is None else state.value, "exact": exact,
                       "staging": engine.store.bytes_in_use}
            print(json.dumps(out), flush=True)
    finally:
        engine.close()


class Starvable:
    """Drives the process above line by line; every answer is waited for with a deadline."""

    def __init__(self, secret: str = "", max_connections: int = 8, handshake_s: float = 5.0) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, __file__, secret, str(max_connections), str(handshake_s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.address = str(self._answer(20)["address"])

    def _answer(self, timeout_s: float) -> dict[str, object]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        assert ready, "the engine process did not answer in time"
        got: dict[str, object] = json.loads(self.proc.stdout.readline())
        return got

    def ask(self, line: str, timeout_s: float = 15) -> dict[str, object]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout_s)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
