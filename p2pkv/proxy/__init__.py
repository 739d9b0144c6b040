"""OpenAI-compatible router for disaggregated prefill/decode serving."""

from p2pkv.proxy.app import create_app
from p2pkv.proxy.instances import Instance, ProxyConfig

__all__ = ["Instance", "ProxyConfig", "create_app"]
