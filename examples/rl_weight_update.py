"""Update the weights of a whole disaggregated cluster through p2pkv's proxy, as an RL trainer does between steps.

    python examples/rl_weight_update.py --proxy http://localhost:10001 --weights /ckpt/step-2

1. `POST /pause`: the proxy drops the KV its prefill instances hold for pulls, pauses them (each once its pushes
   in flight have gone), then the decode instances, whose caches are cleared with the KV staged for them.
2. `POST /collective_rpc` with vLLM's `reload_weights`: every worker of every instance loads the checkpoint in
   `--weights` (a directory of safetensors every instance can read) in place.
3. `POST /resume`, also when the reload failed (the cluster then serves on with the weights it has; where the
   reload failed on some instances only, the proxy pairs no prefill and decode instances across that split until
   a reload reaches them all: run this again once the checkpoint is readable everywhere).

The instances must serve vLLM's dev-mode endpoints (`VLLM_SERVER_DEV_MODE=1`). These are the proxy's admin routes:
run this on the proxy's host, or give the proxy's admin key (`--admin-key`, or `P2PKV_PROXY_ADMIN_KEY`). Exit status
0 only if all three steps succeeded on every instance.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import httpx


def step(client: httpx.Client, what: str, path: str, **kwargs: Any) -> bool:
    started = time.monotonic()
    try:
        resp = client.post(path, **kwargs)
    except httpx.HTTPError as exc:
        print(f"{what}: no answer from the proxy ({type(exc).__name__}: {exc})", flush=True)
        return False
    print(f"{what}: HTTP {resp.status_code} in {time.monotonic() - started:.2f} s", flush=True)
    try:
        instances = resp.json().get("instances", [])
    except ValueError:
        instances = []
    for answer in instances:
        print(f"  {answer['role']:<8} {answer['instance']:<22} {answer['status_code']} "
              f"{answer.get('body', answer.get('error'))}", flush=True)
    return resp.status_code == 200


def update(proxy: str, weights: str, admin_key: str = "", timeout_s: float = 600.0) -> bool:
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": weights}}
    with httpx.Client(base_url=proxy, headers=headers, timeout=timeout_s) as client:
        if not step(client, "pause", "/pause"):
            return False  # the proxy resumed whatever it had paused
        try:
            reloaded = step(client, "reload", "/collective_rpc", json=rpc)
        finally:
            resumed = step(client, "resume", "/resume")
    return reloaded and resumed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--proxy", default="http://127.0.0.1:10001", help="p2pkv proxy URL")
    parser.add_argument("--weights", required=True, help="checkpoint directory every instance can read")
    parser.add_argument("--admin-key", default=os.environ.get("P2PKV_PROXY_ADMIN_KEY", ""),
                        help="the proxy's admin key, if it has one (default: $P2PKV_PROXY_ADMIN_KEY)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds each step may take")
    args = parser.parse_args()
    return 0 if update(args.proxy, args.weights, args.admin_key, args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
