"""The shm transport's pieces: cross-memory reads, the handshake's proof and fallback to tcp."""

from __future__ import annotations

import logging
import os
import re
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from p2pkv.config import ExtraConfig, Transport
from p2pkv.engine import EngineSettings, TransferEngine
from p2pkv.engine.handshake import local_offer, why_unreadable
from p2pkv.engine.sender import OutState
from p2pkv.errors import TransferError
from p2pkv.params import Address
from p2pkv.protocol import CmaOffer
from p2pkv.transport import cma, held
from p2pkv.transport.shm import encode_ranges
from p2pkv.transport.split_read import SplitReader, split_views
from tests.helpers.peer import layout

pytestmark = pytest.mark.skipif(not cma.available(), reason="cross-memory attach needs Linux")


def test_read_remote_copies_ranges_in_order() -> None:
    src = np.random.default_rng(1).integers(0, 256, 3 * cma.IOV_MAX + 7, dtype=np.uint8)
    base = cma.address_of(memoryview(src))
    # More ranges than one system call takes, in a shuffled order, each one byte.
    order = np.random.default_rng(2).permutation(src.size)
    dest = bytearray(src.size)
    cma.read_remote(os.getpid(), memoryview(dest), [(base + int(i), 1) for i in order])
    assert bytes(dest) == src[order].tobytes()


@pytest.mark.parametrize("pieces", [7, 3 * cma.IOV_MAX])  # one system call; more pieces than one call takes
def test_read_remote_scattered_fills_each_buffer_in_turn(pieces: int) -> None:
    src = np.random.default_rng(3).integers(0, 256, 4 * pieces + 5, dtype=np.uint8)
    base = cma.address_of(memoryview(src))
    # Remote ranges and local buffers split the bytes at different places.
    cuts = sorted(set(np.random.default_rng(4).integers(1, src.size, pieces).tolist()))
    remote = [(base + a, b - a) for a, b in zip([0, *cuts], [*cuts, src.size], strict=True)]
    sizes = [3, 0, *([4] * (pieces - 1)), src.size - 3 - 4 * (pieces - 1)]
    local = [memoryview(bytearray(n)) for n in sizes]
    cma.read_remote_scattered(os.getpid(), local, remote)
    assert b"".join(bytes(v) for v in local) == src.tobytes()
    with pytest.raises(TransferError, match="hold"):
        cma.read_remote_scattered(os.getpid(), local, remote[:-1])


class _Releasing:
    """libc, whose `process_vm_readv` (the call that lets go of the interpreter lock) is counted."""

    def __init__(self, libc: object) -> None:
        self._libc = libc
        self.calls = 0

    def __getattr__(self, name: str) -> object:
        if name != "process_vm_readv":
            return getattr(self._libc, name)
        self.calls += 1
        return getattr(self._libc, name)


def test_a_small_copy_keeps_the_interpreter_lock_and_a_large_one_lets_go_of_it(monkeypatch: pytest.MonkeyPatch
                                                                            ) -> None:
    """A thread that runs Python without pause (vLLM's) makes each taking back of the lock wait up to the switch
    interval: a copy of a few microseconds keeps it; a long one lets other threads run meanwhile."""
    releasing = _Releasing(cma._LIBC)
    monkeypatch.setattr(cma, "_LIBC", releasing)
    for nbytes, calls in ((64 << 10, 0), (held.COPY_MAX, 0), (held.COPY_MAX + 1, 1)):
        src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
        dest = [memoryview(bytearray(nbytes // 2)), memoryview(bytearray(nbytes - nbytes // 2))]
        releasing.calls = 0
        cma.read_remote_scattered(os.getpid(), dest, [(cma.address_of(memoryview(src)), nbytes)])
        assert b"".join(bytes(v) for v in dest) == src.tobytes()
        assert releasing.calls == calls, nbytes


def test_a_descriptor_merges_ranges_that_touch() -> None:
    """Views lying back to back (a transfer's layers, often) go as one range; gaps and order are kept, empty views
    dropped; the cap counts ranges as sent."""
    src = np.arange(64, dtype=np.uint8)
    base = cma.address_of(memoryview(src))
    whole = memoryview(src)
    views = [whole[0:8], whole[8:16], whole[16:16], whole[20:24], whole[24:32], whole[0:4]]
    raw = encode_ranges(views)
    (count,) = struct.unpack("!I", raw[:4])
    flat = struct.unpack(f"!{2 * count}Q", raw[4:])
    assert list(zip(flat[::2], flat[1::2], strict=True)) == [(base, 16), (base + 20, 12), (base, 4)]
    dest = bytearray(32)
    cma.read_remote_scattered(os.getpid(), [memoryview(dest)], list(zip(flat[::2], flat[1::2], strict=True)))
    assert bytes(dest) == src[0:16].tobytes() + src[20:32].tobytes() + src[0:4].tobytes()
    adjacent = [whole[i : i + 1] for i in range(64)] * 2  # 128 views, two ranges
    assert struct.unpack("!I", encode_ranges(adjacent)[:4]) == (2,)


def test_read_remote_reports_errors() -> None:
    with pytest.raises(TransferError, match="hold 4 bytes"):
        cma.read_remote(os.getpid(), memoryview(bytearray(8)), [(1, 4)])
    with pytest.raises(TransferError, match=r"failed|could not be read"):
        cma.read_remote(os.getpid(), memoryview(bytearray(8)), [(8, 8)])  # unmapped address
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(TransferError, match="No such process"):
        cma.read_remote(gone.pid, memoryview(bytearray(8)), [(cma.token()[0], 8)])
    with pytest.raises(TransferError, match="hold 4 bytes"):
        cma.read_remote_scattered(os.getpid(), [memoryview(bytearray(8))], [(1, 4)])
    with pytest.raises(TransferError, match="negative or too large"):
        cma.read_remote_scattered(os.getpid(), [memoryview(bytearray(4))], [(-5, 4)])


def _copy_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("p2pkv-copy-")]


def test_split_reader_shares_large_reads_with_its_helper_and_keeps_the_bytes_in_order() -> None:
    src = np.random.default_rng(5).integers(0, 256, (1 << 20) + 12345, dtype=np.uint8)
    base = cma.address_of(src.data)
    # Remote ranges in a shuffled order, local buffers cut elsewhere: the halves split both lists mid-piece.
    cuts = sorted(set(np.random.default_rng(6).integers(1, src.size, 40).tolist()))
    pieces = list(zip([0, *cuts], [*cuts, src.size], strict=True))
    order = np.random.default_rng(7).permutation(len(pieces))
    remote = [(base + pieces[i][0], pieces[i][1] - pieces[i][0]) for i in order]
    expected = b"".join(src[pieces[i][0] : pieces[i][1]].tobytes() for i in order)
    sizes = [100_003, 0, 400_000, src.size - 500_003]
    buffers = [bytearray(n) for n in sizes]
    local = [memoryview(b) for b in buffers]
    reader = SplitReader(os.getpid(), split_from=64 << 10)
    try:
        reader.read(local, remote)
        assert b"".join(bytes(v) for v in local) == expected
        assert reader.split_reads == 1
        assert len(_copy_threads()) == 1
        for view, buffer in zip(local, buffers, strict=True):  # nothing holds a view of the destination after the read
            view.release()
            buffer.extend(b"!")
        small = memoryview(bytearray(32 << 10))
        reader.read([small], [(base, small.nbytes)])  # below split_from: on the caller's thread alone
        assert bytes(small) == src[: small.nbytes].tobytes()
        assert reader.split_reads == 1
    finally:
        reader.close()
    assert _copy_threads() == []
    reader.read([small], [(base + 1, small.nbytes)])  # closed: reads still work, on the caller's thread
    assert bytes(small) == src[1 : small.nbytes + 1].tobytes()
    assert _copy_threads() == []


def _failed_read(reader: SplitReader, buffer: bytearray, remote: list[tuple[int, int]]) -> str:
    """Why the read into `buffer` failed ("" if it did not); the error is gone when this returns."""
    try:
        reader.read([memoryview(buffer)], remote)
    except TransferError as exc:
        return str(exc)
    return ""


def test_split_reader_reports_a_failed_half_on_the_callers_thread() -> None:
    src = np.zeros(256 << 10, dtype=np.uint8)
    base = cma.address_of(src.data)
    reader = SplitReader(os.getpid(), split_from=64 << 10)
    try:
        half = src.size // 2
        for remote in ([(base, half), (8, half)], [(8, half), (base, half)]):  # the helper's half, then the caller's
            buffer = bytearray(src.size)
            assert re.search(r"failed|could not be read", _failed_read(reader, buffer, remote))
            buffer.extend(b"!")  # the failed read left no view of it behind
        local = memoryview(bytearray(src.size))
        reader.read([local], [(base, src.size)])  # the reader is still usable
        assert reader.split_reads == 3
        with pytest.raises(TransferError, match="hold"):
            reader.read([local], [(base, src.size - 1)])
    finally:
        reader.close()
    assert _copy_threads() == []


def test_split_views_cuts_a_buffer_list_at_a_byte_count() -> None:
    views = [memoryview(bytes(range(n, n + 3))) for n in (0, 10, 20)]
    head, rest = split_views(views, 4)
    assert [bytes(v) for v in head] == [bytes([0, 1, 2]), bytes([10])]
    assert [bytes(v) for v in rest] == [bytes([11, 12]), bytes([20, 21, 22])]
    assert split_views(views, 3) == (views[:1], views[1:])
    assert split_views(views, 9)[1] == []


def test_offers_prove_who_can_be_read() -> None:
    offer = local_offer()
    assert offer is not None and offer.pid == os.getpid()
    assert why_unreadable(offer) == ""
    assert "another host" in why_unreadable(CmaOffer(offer.pid, "other-boot", offer.token_address, offer.token))
    assert "not the peer" in why_unreadable(CmaOffer(offer.pid, offer.boot_id, offer.token_address, b"x" * 16))
    assert "does not offer" in why_unreadable(None)
    # A process of another PID namespace or one that is gone is no peer.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert why_unreadable(CmaOffer(gone.pid, offer.boot_id, offer.token_address, offer.token))


def _engine(transport: Transport) -> TransferEngine:
    settings = EngineSettings.from_config(ExtraConfig(kv_host="127.0.0.1", transport=transport), 0, 0)
    engine = TransferEngine(settings, layout(2, 4096))
    engine.start()
    return engine


def _push(sender: TransferEngine, receiver: TransferEngine, tid: str) -> str:
    data = np.arange(2 * 4096, dtype=np.uint16).astype(np.uint8).reshape(2, 4096)
    deadline = time.monotonic() + 10
    for layer in range(2):
        sender.push_layer(tid, Address.parse(receiver.address), layer, 1, (data[layer].data,), deadline)
    while (out := sender.outgoing(tid)) is not None and out.state is OutState.SENDING:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert out is not None and out.state is OutState.DONE
    item = receiver.take_staged(tid)
    assert item is not None and bytes(item.buffer) == data.tobytes()
    transport = item.transport
    receiver.release_staged(item)
    return transport


def test_shm_between_engines_and_fallback_to_tcp(caplog: pytest.LogCaptureFixture) -> None:
    shm, auto, tcp = _engine(Transport.SHM), _engine(Transport.AUTO), _engine(Transport.TCP)
    try:
        assert _push(shm, auto, "a") == "shm"
        assert _push(auto, shm, "b") == "shm"
        with caplog.at_level(logging.INFO, "p2pkv"):
            # A tcp-only peer: the shm engine warns once and uses tcp.
            assert _push(shm, tcp, "c") == "tcp"
            assert _push(tcp, auto, "d") == "tcp"
        warned = [r for r in caplog.records if "shm with" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING
        assert "does not offer shm" in warned[0].getMessage()
    finally:
        for engine in (shm, auto, tcp):
            engine.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_the_engine_example_runs(transport: str) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "engine_direct.py"
    out = subprocess.run([sys.executable, str(example), "--transport", transport], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert f"PUT: {4 * 6 * (64 << 10)} bytes over {transport}; sender says done" in out
    assert f"GET: {4 * 4 * (64 << 10)} bytes over {transport}; sender's offer is served" in out
