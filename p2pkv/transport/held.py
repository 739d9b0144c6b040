"""System calls made without letting go of the interpreter lock, for calls that cannot block and take a few
microseconds: a socket read of bytes that have arrived, a short send, a small copy from a peer's memory.

Python lets go of the lock around every system call, and taking it back waits for the thread that holds it; one
that runs Python without pause (vLLM's, between its steps) keeps it for up to the interpreter's switch interval
(`p2pkv.engine.engine.lower_switch_interval`). A 64 KiB transfer took 6.8 to 21 ms here with such a thread in the
receiving process, against 0.13 to 0.31 ms without it (docs/design.md, "The cost of one transfer"). Linux only:
elsewhere `AVAILABLE` is False and callers make the usual call.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import sys
from collections.abc import Callable

# Each call holds the lock for a few microseconds at most (a copy of 64 KiB): longer, the threads it holds off
# would lose more than the release costs.
READ_MAX = 64 << 10  # bytes one read copies holding the lock; a longer payload takes several calls
SEND_MAX = 64 << 10  # frames this short in all are joined and sent in one call holding the lock
COPY_MAX = 64 << 10  # a cross-process copy this small holds the lock (`p2pkv.transport.cma`)

_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
_WOULD_BLOCK = (errno.EAGAIN, errno.EWOULDBLOCK)


def _lib() -> ctypes.PyDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the call keeps the interpreter lock
        for name in ("recv", "send", "read", "write", "process_vm_readv"):
            getattr(lib, name)
    except (OSError, AttributeError):
        return None
    lib.recv.argtypes = lib.send.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.recv.restype = lib.send.restype = ctypes.c_ssize_t
    lib.read.argtypes = lib.write.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    lib.read.restype = lib.write.restype = ctypes.c_ssize_t
    lib.process_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                                     ctypes.c_ulong]
    lib.process_vm_readv.restype = ctypes.c_ssize_t
    return lib


_LIB = _lib()
AVAILABLE = _LIB is not None


def _call(fn: Callable[..., int], *args: object) -> int | None:
    """`fn(*args)` again while a signal interrupts it: its count, or None where it would block. An OSError for any
    other failure."""
    while True:
        got = int(fn(*args))
        if got >= 0:
            return got
        err = ctypes.get_errno()
        if err in _WOULD_BLOCK:
            return None
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))


def recv(fd: int, address: int, nbytes: int) -> int | None:
    """Read up to `nbytes` that have arrived on socket `fd` into memory at `address`, at most READ_MAX: the count
    (0: the peer closed), or None when nothing has arrived. An OSError for a broken socket."""
    assert _LIB is not None
    return _call(_LIB.recv, fd, address, min(nbytes, READ_MAX), socket.MSG_DONTWAIT)


def peek(fd: int) -> bool:
    """Whether socket `fd` still looks open: nothing has arrived, or bytes have (not read); False once the peer
    closed it. An OSError for a broken socket."""
    assert _LIB is not None
    got = _call(_LIB.recv, fd, ctypes.create_string_buffer(1), 1, socket.MSG_DONTWAIT | socket.MSG_PEEK)
    return got is None or got > 0


def send(fd: int, data: bytes) -> int:
    """Send what the socket takes of `data` at once: the count (0 when its buffer is full). An OSError for a broken
    socket."""
    assert _LIB is not None
    return _call(_LIB.send, fd, data, len(data), socket.MSG_DONTWAIT | _NOSIGNAL) or 0


def write(fd: int, data: bytes) -> int:
    """`write` to a non-blocking pipe: the count, 0 when it is full. An OSError for a closed one."""
    assert _LIB is not None
    return _call(_LIB.write, fd, data, len(data)) or 0


def read(fd: int, nbytes: int) -> bytes | None:
    """`read` from a non-blocking pipe: the bytes (empty: closed), None when none are there."""
    assert _LIB is not None
    buf = ctypes.create_string_buffer(nbytes)
    got = _call(_LIB.read, fd, buf, nbytes)
    return None if got is None else buf.raw[:got]


def readv(pid: int, local: int, local_count: int, remote: int, remote_count: int) -> int:
    """`process_vm_readv` of iovec arrays at these addresses; bytes read, or -1 with errno set."""
    assert _LIB is not None
    return int(_LIB.process_vm_readv(pid, local, local_count, remote, remote_count, 0))
