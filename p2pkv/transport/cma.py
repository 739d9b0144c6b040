"""Cross-memory attach: read another process's memory with one `process_vm_readv` call, no socket in between.

A process proves that a peer may read it, and that both share a PID namespace, with a token: random bytes at a
known address of its own memory, named in its handshake offer. The peer reads them back before it trusts any
address it is later sent. Linux only; the kernel allows it between processes of one user (and, under the Yama
LSM, only towards processes that allowed it, which `allow_readers` does).
"""

from __future__ import annotations

import array
import ctypes
import os
import sys
from collections.abc import Sequence

import numpy as np

from p2pkv.errors import TransferError
from p2pkv.transport import held

IOV_MAX = 1024
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    # The iovec arrays are passed as addresses: built as `array.array("Q")` of (base, length) pairs, they cost a
    # fraction of ctypes structures (about 1 against 6 us for a few ranges).
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return libc


_LIBC = _libc()


def _iovecs(ranges: Sequence[tuple[int, int]]) -> array.array[int]:
    """(address, length) pairs as the kernel's iovec array; a TransferError for a range it cannot hold."""
    try:
        return array.array("Q", [x for r in ranges for x in r])
    except OverflowError:
        raise TransferError(f"a memory range is negative or too large: {list(ranges)[:4]}") from None


def _readv(pid: int, local: array.array[int], remote: array.array[int], nbytes: int) -> int:
    """Bytes read (negative on an error, in errno); callers have checked that the call exists. A copy of up to
    `held.COPY_MAX` bytes keeps the interpreter lock (`p2pkv.transport.held`)."""
    assert _LIBC is not None
    args = (pid, local.buffer_info()[0], len(local) // 2, remote.buffer_info()[0], len(remote) // 2)
    if nbytes <= held.COPY_MAX and held.AVAILABLE:
        return held.readv(*args)
    return int(_LIBC.process_vm_readv(*args, 0))


_TOKEN = ctypes.create_string_buffer(os.urandom(16), 16)


def available() -> bool:
    return _LIBC is not None


def boot_id() -> str:
    """Identifies this host's running kernel; two processes with different boot ids are on different hosts."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def token() -> tuple[int, bytes]:
    """Address and value of this process's token."""
    return ctypes.addressof(_TOKEN), bytes(_TOKEN.raw)


def allow_readers() -> None:
    """Under Yama's ptrace_scope 1, let peers of this user read this process; a no-op without Yama."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0)


def address_of(view: memoryview) -> int:
    """Address of the first byte of a contiguous buffer (read-only ones too: through numpy, about 7x slower)."""
    if not view.nbytes:
        return 0
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def read_remote(pid: int, local: memoryview, remote: Sequence[tuple[int, int]]) -> None:
    """Fill `local` from the peer's memory ranges (address, length), in order; their lengths must add up."""
    if _LIBC is None:
        raise TransferError("cross-memory attach is not available on this platform")
    if sum(n for _, n in remote) != local.nbytes:
        raise TransferError(f"remote ranges hold {sum(n for _, n in remote)} bytes, the buffer {local.nbytes}")
    dest = address_of(local)
    pending = [(a, n) for a, n in remote if n]
    while pending:
        batch, pending = pending[:IOV_MAX], pending[IOV_MAX:]
        want = sum(n for _, n in batch)
        got = _readv(pid, _iovecs([(dest, want)]), _iovecs(batch), want)
        if got < 0:
            err = ctypes.get_errno()
            raise TransferError(f"reading {want} bytes from process {pid} failed: {os.strerror(err)}")
        dest += got
        if got < want:  # a partial read stops at a range boundary or a fault: go on from where it stopped
            done = got
            rest: list[tuple[int, int]] = []
            for a, n in batch:
                if done >= n:
                    done -= n
                    continue
                rest.append((a + done, n - done))
                done = 0
            if got == 0:
                raise TransferError(f"process {pid} memory at {rest[0][0]:#x} could not be read")
            pending = rest + pending


def read_remote_scattered(pid: int, local: Sequence[memoryview], remote: Sequence[tuple[int, int]]) -> None:
    """Fill the `local` buffers in turn from the peer's ranges, with one system call where the kernel's iovec
    limit allows (and the peer's memory reads whole); otherwise buffer by buffer."""
    if _LIBC is None:
        raise TransferError("cross-memory attach is not available on this platform")
    views = [v for v in local if v.nbytes]
    ranges = [r for r in remote if r[1]]
    local_iov = _iovecs([(address_of(view), view.nbytes) for view in views])
    remote_iov = _iovecs(ranges)
    want = sum(local_iov[1::2])
    if sum(remote_iov[1::2]) != want:
        raise TransferError(f"remote ranges hold {sum(remote_iov[1::2])} bytes, the buffers {want}")
    if len(views) <= IOV_MAX and len(ranges) <= IOV_MAX and _readv(pid, local_iov, remote_iov, want) == want:
        return
    for view in views:  # too many pieces, or a partial read: the careful path, one buffer at a time
        take, ranges = split_ranges(ranges, view.nbytes)
        read_remote(pid, view, take)


def split_ranges(ranges: Sequence[tuple[int, int]], nbytes: int) -> tuple[list[tuple[int, int]],
                                                                          list[tuple[int, int]]]:
    """The first `nbytes` of `ranges` (a range may be cut in two), and the rest."""
    head: list[tuple[int, int]] = []
    at = 0
    while nbytes:
        address, length = ranges[at]
        step = min(length, nbytes)
        head.append((address, step))
        nbytes -= step
        if step < length:
            return head, [(address + step, length - step), *ranges[at + 1 :]]
        at += 1
    return head, list(ranges[at:])


def probe(pid: int, address: int, expected: bytes) -> str:
    """Why the peer's memory cannot be read (empty when it can): reads its token back."""
    if _LIBC is None:
        return "cross-memory attach is not available on this platform"
    buf = bytearray(len(expected))
    try:
        read_remote(pid, memoryview(buf), [(address, len(expected))])
    except TransferError as exc:
        return str(exc)
    return "" if bytes(buf) == expected else f"process {pid} is not the peer (another PID namespace?)"
