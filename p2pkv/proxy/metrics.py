"""Prometheus metrics of one proxy app, in a registry of its own."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from p2pkv.proxy.trace import RequestTrace, SlowRequests


@dataclass
class ProxyMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("p2pkv_proxy_requests", "Client requests by outcome", ["outcome"], registry=r)
        self.prefill_seconds = Histogram("p2pkv_proxy_prefill_seconds", "Prefill request latency", registry=r)
        self.decode_seconds = Histogram("p2pkv_proxy_decode_seconds", "Decode request latency (to the end)",
                                        registry=r)
        self.ttft_seconds = Histogram("p2pkv_proxy_time_to_first_token_seconds",
                                      "From the client's request to the decode answer's first body bytes (a "
                                      "stream's first token)", registry=r)
        self.slow_requests = Counter("p2pkv_proxy_slow_requests",
                                     "Requests whose first token took over 1 s and 10 times the median of the last "
                                     "256 (each logged with where its time went, at most one line every 10 s)",
                                     registry=r)
        self.slow = SlowRequests(self.slow_requests.inc)
        self.retries = Counter("p2pkv_proxy_prefill_retries", "Prefill attempts retried on another instance",
                               registry=r)
        self.decode_resends = Counter("p2pkv_proxy_decode_resends",
                                      "Decode requests sent again after their connection broke before any answer",
                                      registry=r)
        self.reroutes = Counter("p2pkv_proxy_reroutes",
                                "Requests prefilled and decoded again, as a new transfer, after their decode instance "
                                "failed before answering (KV lost under kv_load_failure_policy=fail, a 5xx, a broken "
                                "connection)", registry=r)
        self.stream_resumes = Counter("p2pkv_proxy_stream_resumes",
                                      "Completion streams resumed as a new transfer from the tokens they had streamed, "
                                      "after their decode instance broke off", registry=r)
        self.passed_over = Counter("p2pkv_proxy_pairs_passed_over",
                                   "Prefill instances passed over for a request: they and its decode instance "
                                   "refused each other's KV workers (another layout or model settings), or a weight "
                                   "update through the proxy reached one and not the other", registry=r)
        self.fallbacks = Counter("p2pkv_proxy_decode_only_fallbacks",
                                 "Requests sent to a decode instance alone because no prefill succeeded", registry=r)
        self.decode_only = Counter("p2pkv_proxy_decode_only",
                                   "Requests sent to a decode instance alone because it computes their prompt anyway "
                                   "(prompt logprobs)", registry=r)
        self.decode_only_cheaper = Counter("p2pkv_proxy_decode_only_cheaper",
                                           "Requests sent to a decode instance alone because fewer than "
                                           "--decode-only-below of their prompt tokens were left to compute there: "
                                           "short (a short prompt), cached (its prefix cache holds the rest)",
                                           ["reason"], registry=r)
        self.alongside = Counter("p2pkv_proxy_decode_alongside",
                                 "Decode requests sent while their prefill ran (--decode-alongside), by outcome: "
                                 "answered, prefill_failed and decode_failed (the request went again the other way), "
                                 "unsuited (the pair's KV does not go as a checked push, or the prefill instance's "
                                 "KV address is not known: sent after the prefill)", ["outcome"], registry=r)
        self.discards = Counter("p2pkv_proxy_discards",
                                "Discards sent to instances (a transfer to free: its client went away before the "
                                "decode answer), by outcome (sent, refused, failed)", ["outcome"],
                                registry=r)
        self.heartbeats = Counter("p2pkv_proxy_heartbeats", "Discovery messages by outcome (accepted, refused)",
                                  ["outcome"], registry=r)
        self.prefill_tokens = Counter("p2pkv_proxy_prefill_prompt_tokens",
                                      "Prompt tokens routed to each prefill instance (prefix policy, where the proxy "
                                      "knew the prompt's tokens)", ["instance"], registry=r)
        self.expected_cached = Counter("p2pkv_proxy_prefill_expected_cached_tokens",
                                       "Of those, the tokens the instance was expected to hold in its prefix cache",
                                       ["instance"], registry=r)
        self.prefix_choices = Counter("p2pkv_proxy_prefix_choices",
                                      "Prefill choices of the prefix policy by what decided them: indexed (the "
                                      "instances' cached blocks and loads), no_events (no instance has published "
                                      "its blocks: by load), no_tokens (the prompt could not be tokenized: by load)",
                                      ["outcome"], registry=r)
        self.kv_events = Counter("p2pkv_proxy_kv_events", "KV cache events received from each instance, by outcome "
                                 "(applied; bad: an event, or a whole batch, that could not be read)",
                                 ["instance", "outcome"], registry=r)
        self.index_blocks = Gauge("p2pkv_proxy_kv_index_blocks", "Blocks the prefix index holds for each instance",
                                  ["instance"], registry=r)
        self.instance_cache_hits = Gauge("p2pkv_proxy_instance_prefix_cache_hits",
                                         "Prompt tokens each instance found in its prefix cache, as its vLLM "
                                         "reports them (vllm:prefix_cache_hits_total, read every 15 s)",
                                         ["instance"], registry=r)
        self.instance_cache_queries = Gauge("p2pkv_proxy_instance_prefix_cache_queries",
                                            "Prompt tokens each instance looked up in its prefix cache "
                                            "(vllm:prefix_cache_queries_total, read every 15 s)", ["instance"],
                                            registry=r)
        self.instances = Gauge("p2pkv_proxy_instances", "Known instances by role", ["role"], registry=r)
        self.unpaired = Gauge("p2pkv_proxy_unpaired", "Prefill and decode instance pairs not used now: their KV "
                              "workers refused each other (another layout or model settings), or their weights "
                              "differ after a weight update through the proxy", registry=r)

    def first_token(self, trace: RequestTrace, seconds: float) -> None:
        """A request's first token reached the client `seconds` after its request."""
        self.ttft_seconds.observe(seconds)
        self.slow.note(trace, seconds)
