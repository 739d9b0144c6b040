"""Peers this engine's listener refused at their hello (another KV layout), by the address they name for their own
listener. A load of KV such a peer was to push fails at once instead of waiting out its deadline: the push is
refused at every try, so nothing of it will come. A later hello from that address that is accepted (the peer
restarted with a matching layout) clears the note; until that hello comes, a load that names a later start of the
peer's instance than the one refused (`Hello.launch`) is not failed on the note. The notes also go to the proxy
(in the instance's heartbeats), which then pairs this instance with other ones for a while (`p2pkv.proxy.pairs`)."""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

_MAX_NOTED = 1024  # addresses kept at most; the oldest note goes first


class Refusal(NamedTuple):
    reason: str
    at: float  # time.monotonic() of the latest refusal (the system's clock: the same in every process of a host)
    launch: str = ""  # the start of the peer's instance that was refused (`Hello.launch`); "": not said


class RefusedPeers:
    """Thread-safe: reader threads note, the worker's step asks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._notes: dict[str, Refusal] = {}
        self._version = 0  # bumped by every refusal and every note cleared

    def refused(self, address: str, reason: str, launch: str = "") -> bool:
        """Note a refusal (of the start `launch` of the peer's instance); whether it is news (the peer was not noted
        as refused for this reason, or another start of it was), for the log."""
        if not address:
            return True
        with self._lock:
            before = self._notes.pop(address, None)
            self._notes[address] = Refusal(reason, time.monotonic(), launch)
            self._version += 1
            while len(self._notes) > _MAX_NOTED:
                del self._notes[next(iter(self._notes))]
        return before is None or before.reason != reason or before.launch != launch

    def accepted(self, address: str) -> None:
        if not address:
            return
        with self._lock:
            if self._notes.pop(address, None) is not None:
                self._version += 1

    def reason(self, address: str, launch: str = "") -> str | None:
        """Why the peer that names its listener `address` was last refused; None if it was not, or was accepted
        since, or if `launch` names another start of its instance than the one refused (it restarted since: its
        next hello decides)."""
        with self._lock:
            note = self._notes.get(address)
        if note is None or (launch and note.launch and launch != note.launch):
            return None
        return note.reason

    @property
    def version(self) -> int:
        """Changes whenever the notes do (read without the lock: an int, asked every step)."""
        return self._version

    def snapshot(self) -> tuple[int, dict[str, Refusal]]:
        """A version (it changes whenever the notes do) and the notes, the latest refusal last."""
        with self._lock:
            return self._version, dict(self._notes)
