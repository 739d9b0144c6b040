"""The launch scripts of `examples/`, run as a user runs them (here on vLLM's CPU build, with the environment their
comments ask for there): `examples/launch_1p1d.sh`, which runs `examples/launch_xpyd.sh`, with the decode instance
pulling (`DECODE_SEND_TYPE=GET`). The proxy finds both instances by their heartbeats, a request through it moves its
KV and is answered as the colocated instance answers it, and Ctrl-C stops every process the script started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from p2pkv.bench.cluster import free_ports
from tests.integration.conftest import Oracle, complete, prompt, vllm_series

pytestmark = pytest.mark.vllm
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
READY_S = 300.0


def test_the_1p1d_launch_script_serves_through_the_proxy_with_pulls_and_stops_everything_on_ctrl_c(
        tiny_model: str, tmp_path: Path, oracle: Oracle) -> None:
    # Every port the script derives is free: the proxy's and discovery (P, P+1), the instances' OpenAI ports (H,
    # H+1) and KV ports (K, K+100: the script spaces them by 100).
    proxy_port, http_base = free_ports(2, run=2)
    (kv_base,) = free_ports(1, run=101, avoid=(proxy_port, proxy_port + 1, http_base, http_base + 1))
    discovery_port = proxy_port + 1
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "MODEL": tiny_model, "HOST": "127.0.0.1", "PROXY_PORT": str(proxy_port),
           "DISCOVERY_PORT": str(discovery_port), "BASE_HTTP": str(http_base), "BASE_KV": str(kv_base),
           "EXTRA_ARGS": "--dtype float32", "DECODE_SEND_TYPE": "GET", "READY_TIMEOUT": str(int(READY_S)),
           # what the script's comments ask for on vLLM's CPU build
           "VLLM_CPU_KVCACHE_SPACE": "1", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "VLLM_USE_AOT_COMPILE": "0"}
    out = tmp_path / "launch.log"
    with out.open("w") as log:
        script = subprocess.Popen(["bash", str(EXAMPLES / "launch_1p1d.sh")], env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    started = psutil.Process(script.pid)
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + READY_S + 30
        while "ready: " not in out.read_text():
            assert script.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(1)
        children = started.children(recursive=True)
        proxy = f"http://127.0.0.1:{proxy_port}"
        listed = httpx.get(f"{proxy}/instances", timeout=10).json()["instances"]
        assert sorted((i["role"], i["source"]) for i in listed) == [("decode", "heartbeat"), ("prefill", "heartbeat")]
        decode = next(i["address"] for i in listed if i["role"] == "decode")
        body = {"model": tiny_model, "prompt": prompt("launch-script", 300), "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        answer = complete(proxy, body)
        assert answer["choices"][0]["token_ids"] == complete(oracle.url(), body)["choices"][0]["token_ids"]
        assert vllm_series(decode, "vllm:p2pkv_transfers_total", direction="pull", outcome="ok") == 1
        assert vllm_series(decode, "vllm:p2pkv_transfers_total", direction="load", outcome="ok") == 1
        assert vllm_series(decode, "vllm:p2pkv_bytes_total", kind="loaded") > 0
        script.send_signal(signal.SIGINT)  # Ctrl-C, as the script says
        script.wait(60)
        assert out.read_text().count("stopped; logs in") == 1
        _gone, alive = psutil.wait_procs(children, timeout=60)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
            script.wait(30)
        for proc in children:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
