"""Copies between a KV cache and other memory, queued and awaited: markers (when queued copies are done), the copy
stream that orders them after the forward pass, and moving whole rows of blocks by index."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

log = logging.getLogger(__name__)
Marker = Callable[[], bool]  # True once the copies queued before it have finished
Ready = Callable[[float], bool]  # wait until an absolute monotonic deadline; False if it passed first


def done() -> bool:
    return True


SPIN_S = 300e-6  # markers are asked without sleeping this long: a short copy is seen done within microseconds


def wait_marker(marker: Marker, deadline: float) -> bool:
    """Until the marker says done (True) or the deadline passes (False). First asked in a loop that yields the GIL
    and the core but does not sleep (a sleep lasts 50 us or more past what it asks); then between sleeps of an
    eighth of the time waited so far (1 ms at most), so the wait ends within about an eighth of the copy's time
    after it."""
    if marker():
        return True
    started = time.monotonic()
    spin_until = started + SPIN_S
    while not marker():
        now = time.monotonic()
        if now >= deadline:
            return False
        if now < spin_until:
            os.sched_yield()  # lets other threads run; time.sleep(0) would sleep 50 us or more (timer slack)
            continue
        time.sleep(min(max((now - started) / 8, 20e-6), 1e-3, deadline - now))
    return True


def _word_bytes(*views: torch.Tensor) -> int:
    """The widest integer word (8, 4, 2 or 1 bytes) that every [rows, bytes] uint8 view can be read as: rows and
    starts aligned to it, bytes contiguous."""
    for size in (8, 4, 2):
        if all(v.stride(-1) == 1 and v.shape[-1] % size == 0 and v.data_ptr() % size == 0
               and all(s % size == 0 for s in v.stride()[:-1]) for v in views):
            return size
    return 1


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def gather_rows(blocks: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a [rows, bytes] uint8 view, as one contiguous [len(ids), bytes] uint8 tensor. The indexing
    kernel moves 8-byte words where the layout allows: as bytes it runs at a fraction of a plain copy."""
    word = _WORDS[_word_bytes(blocks)]
    return blocks.view(word).index_select(0, ids).view(torch.uint8)


BYTEWISE_UP_TO = 4 << 20  # scatters of at most this many bytes go as bytes: that kernel launches sooner


def scatter_rows(blocks: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Write contiguous `rows` ([len(ids), bytes] uint8) into rows `ids` of a [rows, bytes] uint8 view. On an H200,
    1 MiB: 12 us a call as bytes, 15.5 us as 8-byte words; from 16 MiB the words run at 2 to 4 times the bytes."""
    if rows.numel() <= BYTEWISE_UP_TO:
        blocks.index_copy_(0, ids, rows)
        return
    word = _WORDS[_word_bytes(blocks, rows)]
    blocks.view(word).index_copy_(0, ids, rows.view(word))


def settle(markers: Sequence[Marker], deadline: float, grace_s: float) -> bool:
    """Wait for the markers to the deadline. When it passes first, wait up to `grace_s` more before answering False,
    so that no copy is still writing when its caller gives the memory back or reports the load failed."""
    if all(wait_marker(m, deadline) for m in markers):
        return True
    if not all(wait_marker(m, time.monotonic() + grace_s) for m in markers):
        log.error("device copies still running after their deadline and %.0f s more", grace_s)
    return False


class Copier(Protocol):
    def after_compute(self) -> contextlib.AbstractContextManager[None]:
        """Copies issued inside run after the work queued so far on the compute stream."""

    def mark(self) -> Marker:
        """A marker for the copies issued so far."""

    def mark_compute(self) -> Marker:
        """A marker for the work queued so far on the calling thread's current stream (the forward pass)."""


class HostCopier:
    """Host tensors: `copy_` is synchronous, every copy is done when it returns."""

    def after_compute(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def mark(self) -> Marker:
        return done

    def mark_compute(self) -> Marker:
        return done


def event_marker(event: torch.cuda.Event, device: torch.device) -> Marker:
    """A marker for a recorded CUDA event, queried with its device current: the engine's threads wait on markers,
    and a thread's current device is GPU 0 until it is set (a query there could make a CUDA context on GPU 0 for a
    worker on another GPU)."""

    def query() -> bool:
        with torch.cuda.device(device):
            return bool(event.query())

    return query


class CudaCopier:
    """One copy stream per worker, ordered after the compute stream; markers are CUDA events (no host sync)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device=device)

    @contextlib.contextmanager
    def after_compute(self) -> Iterator[None]:
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            yield

    def mark(self) -> Marker:
        event = torch.cuda.Event()
        event.record(self._stream)
        return event_marker(event, self._device)

    def mark_compute(self) -> Marker:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event_marker(event, self._device)


