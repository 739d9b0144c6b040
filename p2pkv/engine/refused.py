"""Peers this engine's listener refused at their hello (another KV layout), by the address they name for their own
listener. A load of KV such a peer was to push fails at once instead of waiting out its deadline: the push is
refused at every try, so nothing of it will come. A later hello from that address that is accepted (the peer
restarted with a matching layout) clears the note."""

from __future__ import annotations

import threading

_MAX_NOTED = 1024  # addresses kept at most; the oldest note goes first


class RefusedPeers:
    """Thread-safe: reader threads note, the worker's step asks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reasons: dict[str, str] = {}

    def refused(self, address: str, reason: str) -> bool:
        """Note a refusal; whether it is news (the peer was not noted as refused for this reason), for the log."""
        if not address:
            return True
        with self._lock:
            news = self._reasons.pop(address, None) != reason
            self._reasons[address] = reason
            while len(self._reasons) > _MAX_NOTED:
                del self._reasons[next(iter(self._reasons))]
        return news

    def accepted(self, address: str) -> None:
        if not address:
            return
        with self._lock:
            self._reasons.pop(address, None)

    def reason(self, address: str) -> str | None:
        """Why the peer that names its listener `address` was last refused; None if it was not, or was accepted
        since."""
        with self._lock:
            return self._reasons.get(address)
