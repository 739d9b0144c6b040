"""The one exception tree of p2pkv. Foreign exceptions are translated into these at the boundary."""


class P2pkvError(Exception):
    """Base of every error p2pkv raises on purpose."""


class ConfigError(P2pkvError, ValueError):
    """A configuration key is unknown or its value is invalid. The message names the key."""


class ProtocolError(P2pkvError):
    """A frame from a peer is malformed, too large, of another version, or fails authentication."""


class IncompatiblePeerError(P2pkvError):
    """The peer's KV layout differs from ours (block size, dtype, layers, bytes per block)."""


class TransferError(P2pkvError):
    """A transfer failed: peer unreachable, connection lost, or deadline passed."""


class TransferTimeout(TransferError):
    """A transfer did not finish before its deadline."""


class UnsupportedCacheError(P2pkvError):
    """vLLM handed over a KV cache p2pkv cannot move (a raw buffer, several cache groups, layers of different
    page sizes). Raised at start-up; the message names the layer and what is unsupported."""
