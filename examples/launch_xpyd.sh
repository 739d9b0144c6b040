#!/usr/bin/env bash
# xPyD on one host with N GPUs (or on vLLM's CPU build): P prefill and D decode vLLM servers with the p2pkv
# connector, and the p2pkv proxy, which finds them by their heartbeats. Ctrl-C stops everything.
#
#   MODEL=/models/Llama-3.1-8B-Instruct P=1 D=1 examples/launch_xpyd.sh      # 1P1D on GPUs 0 and 1
#   MODEL=/models/Llama-3.1-8B-Instruct P=2 D=2 examples/launch_xpyd.sh      # 2P2D on GPUs 0..3
#   MODEL=/models/Llama-3.1-8B-Instruct DP=2 examples/launch_xpyd.sh         # 1P1D, 2 engines each, GPUs 0..3
#
# Environment: MODEL (required), P, D (default 1 each), DP (each instance's --data-parallel-size, 1: the proxy then
# routes to each engine of an instance apart, see docs/deployment.md), FIRST_GPU (0), HOST (this host's address, default
# 127.0.0.1), PROXY_PORT (10001), DISCOVERY_PORT (30001), BASE_HTTP (8100), BASE_KV (21001), EXTRA_ARGS (more vLLM
# arguments, e.g. "--max-model-len 8192"), READY_TIMEOUT (seconds, 900), P2PKV_AUTH_SECRET (signs every control frame and heartbeat; required where HOST is not loopback),
# FAILURE_POLICY (kv_load_failure_policy, recompute): with "fail" a decode instance whose KV did not arrive fails the
# request instead of prefilling it among its decodes, and the proxy sends it again as a new transfer through another
# prefill instance (p2pkv proxy --transfer-retries, 1). DECODE_SEND_TYPE (optional): GET has the decode instances pull
# their KV (they say so in their heartbeats, and the proxy asks the prefill instances to hold it for them), where the
# prefill instances push by default (PUT_ASYNC).
# On vLLM's CPU build also export VLLM_CPU_KVCACHE_SPACE (GiB of KV per instance, e.g. 1),
# ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 and VLLM_USE_AOT_COMPILE=0 (see docs/deployment.md); CUDA_VISIBLE_DEVICES is then
# ignored. tests/integration/test_examples.py runs launch_1p1d.sh so, with the tiny model.
# For hosts of their own, run one instance per host with the same command and point proxy_ip at the proxy's host;
# with GPUs there, install CuPy (pip install cupy-cuda12x, or cupy-cuda13x) so that pulls go through NCCL: the decode
# side then asks for pulls instead of pushes (pull_over_device, on by default), and PUT_ASYNC transfers go GPU to GPU.
# This script gives each instance one GPU. Instances of several ranks (--tensor-parallel-size T,
# --pipeline-parallel-size S, sizes may differ between prefill and decode) need T*S GPUs each and bind kv_port + r
# for each of their ranks r: give them their GPUs in CUDA_VISIBLE_DEVICES and keep BASE_KV's spacing of 100.
set -euo pipefail
: "${MODEL:?set MODEL to a model directory or name}"
P="${P:-1}" D="${D:-1}" DP="${DP:-1}" FIRST_GPU="${FIRST_GPU:-0}" HOST="${HOST:-127.0.0.1}"
PROXY_PORT="${PROXY_PORT:-10001}" DISCOVERY_PORT="${DISCOVERY_PORT:-30001}"
BASE_HTTP="${BASE_HTTP:-8100}" BASE_KV="${BASE_KV:-21001}" EXTRA_ARGS="${EXTRA_ARGS:-}"
FAILURE_POLICY="${FAILURE_POLICY:-recompute}"
LOGS="$(mktemp -d -t p2pkv-xpyd-XXXX)"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; echo "stopped; logs in $LOGS"; }
trap cleanup EXIT
trap 'exit 130' INT TERM  # the EXIT trap then stops everything, once

p2pkv proxy --host "$HOST" --port "$PROXY_PORT" --discovery-port "$DISCOVERY_PORT" >"$LOGS/proxy.log" 2>&1 &
pids+=($!)

for ((i = 0; i < P + D; i++)); do
  if ((i < P)); then role=kv_producer; name="prefill$i"; else role=kv_consumer; name="decode$((i - P))"; fi
  http=$((BASE_HTTP + i)) kv=$((BASE_KV + 100 * i))  # worker rank r of engine d binds kv + d * (its ranks) + r
  send=""
  if ((i >= P)) && [ -n "${DECODE_SEND_TYPE:-}" ]; then send=",\"send_type\":\"$DECODE_SEND_TYPE\""; fi
  config=$(printf '{"kv_connector":"P2pNcclConnector","kv_connector_module_path":"p2pkv.vllm","kv_role":"%s",'\
'"kv_port":%d,"kv_load_failure_policy":"%s","kv_connector_extra_config":{"kv_host":"%s",'\
'"proxy_ip":"%s","proxy_port":%d,"http_port":%d%s}}' "$role" "$kv" "$FAILURE_POLICY" "$HOST" "$HOST" \
    "$DISCOVERY_PORT" "$http" "$send")
  # This instance's GPUs first (vLLM uses the first ones it sees; engine d of a data-parallel instance its d-th),
  # then the others: pulls between instances (GET, and PUT_ASYNC transfers left for pulls) can then open each
  # other's KV cache with CUDA IPC (cuda_ipc), which needs the peer's GPU to be visible.
  gpus=""
  for ((g = 0; g < (P + D) * DP; g++)); do
    k=$(((i * DP + g) % ((P + D) * DP)))
    gpus="${gpus:+$gpus,}$((FIRST_GPU + k))"
  done
  dp_args=()
  ((DP > 1)) && dp_args=(--data-parallel-size "$DP")
  # shellcheck disable=SC2086  # EXTRA_ARGS is a list of arguments
  CUDA_VISIBLE_DEVICES=$gpus python -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --host "$HOST" --port "$http" --kv-transfer-config "$config" "${dp_args[@]}" $EXTRA_ARGS \
    >"$LOGS/$name.log" 2>&1 &
  pids+=($!)
  echo "$name: http://$HOST:$http (KV port $kv), log $LOGS/$name.log"
done

engines=$(((P + D) * DP))  # each engine of a data-parallel instance announces itself
echo "waiting until the proxy has heard from all $engines engines..."
deadline=$((SECONDS + ${READY_TIMEOUT:-900}))
until [ "$(curl -s "http://$HOST:$PROXY_PORT/instances" | python -c 'import json,sys; print(len(json.load(sys.stdin)["instances"]))' 2>/dev/null || echo 0)" -ge "$engines" ]; do
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || { echo "a process exited; see $LOGS"; exit 1; }; done
  ((SECONDS < deadline)) || { echo "not ready after ${READY_TIMEOUT:-900} s; see $LOGS"; exit 1; }
  sleep 2
done
echo "ready: http://$HOST:$PROXY_PORT/v1/completions (Ctrl-C stops everything)"
wait -n "${pids[@]}"
