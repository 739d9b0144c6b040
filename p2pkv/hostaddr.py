"""Which address of this host peers should use for a socket bound to a wildcard (`kv_host` 0.0.0.0, the default).

One rule for everything that names this instance's KV port: heartbeats to the proxy, the `prefill_kv_address` in
`DecodeParams` (where the decode side pulls from), and each engine's `Hello.kv_address`. So the three agree, and a
decode worker can match a refused hello with the prefill instance a load names. The rule: the bound address unless
it is a wildcard; else `VLLM_HOST_IP` (vLLM's own setting for the address its processes use); else this host's
address on the route to the proxy (or, with none, to a public address: no packet is sent); else the address its
name resolves to; else loopback. The name comes last because `/etc/hosts` often maps it to 127.0.1.1, which no
other host can reach."""

from __future__ import annotations

import ipaddress
import os
import socket

WILDCARDS = ("", "0.0.0.0", "::")
HOST_IP_ENV = "VLLM_HOST_IP"
_PUBLIC = "8.8.8.8"  # only routed to, never sent to


def local_ip_towards(host: str) -> str | None:
    """This host's address on the route to `host` (no packet is sent); None when there is no route."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def advertised_host(bound: str, towards: str = "") -> str:
    """The address peers should use for a socket bound to `bound`; `towards`: the proxy's host, when there is one."""
    if bound not in WILDCARDS:
        return bound
    if os.environ.get(HOST_IP_ENV):
        return os.environ[HOST_IP_ENV]
    routed = local_ip_towards(towards or _PUBLIC)
    if routed is not None:
        return routed
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether `host` (an address to bind or a client's address) is on loopback only: 127.0.0.0/8, ::1 (also as
    an IPv4-mapped address) or `localhost`. A wildcard or any other name is not."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]").partition("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback
