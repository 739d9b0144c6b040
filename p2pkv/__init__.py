"""p2pkv: peer-to-peer KV cache transfer for disaggregated prefill/decode serving with vLLM."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 11
