"""Where an instance's vLLM publishes KV cache events, as its heartbeats name it to the proxy.

vLLM's ZMQ publisher binds endpoints with a wildcard host (`tcp://*:PORT`) or an `ipc://` path, and connects out to
any other. Only a bound one can be subscribed to: the proxy is told it with the wildcard replaced by the instance's
own address, and a data-parallel engine's port offset by its rank, as vLLM offsets it.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)
MAX_ENDPOINT_BYTES = 200


def announced_endpoint(endpoint: str, enabled: bool, publisher: str, dp_index: int, host: str) -> str:
    """The endpoint to announce for vLLM's `KVEventsConfig` (`enable_kv_cache_events`, `publisher`, `endpoint`) of
    data-parallel engine `dp_index`, reached at `host`; "" where nothing can be subscribed to."""
    if not enabled or publisher != "zmq" or not endpoint:
        return ""
    if endpoint.startswith("ipc://"):
        return endpoint if dp_index == 0 and len(endpoint) <= MAX_ENDPOINT_BYTES else ""
    if not endpoint.startswith("tcp://"):
        return ""  # inproc: inside the engine's own process
    hostpart, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not port.isdigit() or int(port) == 0:
        # Port 0 is chosen at bind time, inside vLLM; nothing outside it learns which.
        log.info("KV cache events at %s are not announced: the proxy cannot tell their port", endpoint)
        return ""
    if hostpart not in ("*", "[::]", "::", "0.0.0.0"):
        log.info("KV cache events at %s are not announced: vLLM's publisher connects out to that address rather "
                 "than listening (bind with tcp://*:PORT for the proxy to subscribe)", endpoint)
        return ""
    bracketed = f"[{host}]" if ":" in host else host
    return f"tcp://{bracketed}:{int(port) + dp_index}"
