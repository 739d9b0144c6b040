"""By hand: a 1P1D cluster whose decode instance runs in bfloat16 (the prefill instance in float32, so every push is
refused at the decode worker's hello), N requests through the proxy one at a time. Prints each request's seconds
and how many of them the prefill instance computed. Measures the p2pkv it imports (set PYTHONPATH to a worktree to
measure another commit).

    python scripts/measure_mismatch.py LABEL [N] [PROMPT_TOKENS]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx

from p2pkv.tinymodel import tiny_prompt


def finished(address: str) -> float:
    for line in httpx.get(f"http://{address}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:e2e_request_latency_seconds_count"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def main() -> None:
    label = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    length = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
    ready = f"/tmp/measure-{label}.json"
    if os.path.exists(ready):
        os.remove(ready)
    up = [sys.executable, "-m", "p2pkv", "up", "--decode-vllm-args", "--dtype bfloat16", "--extra-config",
          json.dumps({"transfer_timeout_s": 60}), "--ready-file", ready, "--log-dir", f"/tmp/measure-{label}-logs"]
    proc = subprocess.Popen(up, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(ready):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the cluster did not start")
            time.sleep(1)
        time.sleep(1)
        with open(ready) as f:
            info = json.load(f)
        prefill = next(i for i in info["instances"] if i["role"] == "kv_producer")
        before, times = finished(prefill["http"]), []
        for i in range(n):
            body = {"model": info["model"], "prompt": tiny_prompt(f"{label}-{i}", length), "max_tokens": 16,
                    "temperature": 0, "ignore_eos": True}
            started = time.perf_counter()
            reply = httpx.post(f"{info['proxy']}/v1/completions", json=body, timeout=120)
            times.append(time.perf_counter() - started)
            if reply.status_code != 200:
                raise SystemExit(f"request {i}: {reply.status_code} {reply.text}")
            if i == 0:
                time.sleep(4)  # a heartbeat is due every 3 s: the refusal reaches the proxy
        rest = sorted(times[1:])
        print(label, "seconds per request:", " ".join(f"{t:.3f}" for t in times))
        print(label, "prefill instance requests:", int(finished(prefill["http"]) - before), "of", n)
        if rest:
            print(label, f"median of requests 2..{n}: {rest[len(rest) // 2]:.3f}")
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
