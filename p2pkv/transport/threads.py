"""Threads of the engine: named, daemonic, and free to run on any CPU.

vLLM's CPU worker pins its process to the cores it computes on, and its idle loop spins there; an I/O thread
left on those cores can wait seconds to be scheduled. Engine threads therefore widen their own affinity.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


def _widen_affinity() -> None:
    cpus = os.cpu_count() or 1
    try:
        os.sched_setaffinity(0, range(cpus))  # 0 is the calling thread on Linux
    except (AttributeError, OSError) as exc:
        log.debug("could not widen thread affinity: %s", exc)


def engine_thread(target: Callable[[], None], name: str) -> threading.Thread:
    def run() -> None:
        _widen_affinity()
        target()

    return threading.Thread(target=run, name=name, daemon=True)
