"""The TCP connection's framing: batched sends, buffered reads, queued replies and deadlines, over a real socket
pair (plus the sender's merging of consecutive layers into one frame)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from p2pkv.engine.sender import PushJob, _frames
from p2pkv.errors import TransferTimeout
from p2pkv.params import Address
from p2pkv.protocol import FrameLimits, PayloadCopied, PushAck, PushBlocks
from p2pkv.transport import held
from p2pkv.transport.tcp import TcpConnection, tune_socket


@pytest.fixture
def pair() -> Iterator[tuple[TcpConnection, TcpConnection]]:
    a, b = socket.socketpair()
    left = TcpConnection(a, "left", b"k", FrameLimits())
    right = TcpConnection(b, "right", b"k", FrameLimits())
    yield left, right
    left.close()
    right.close()


def soon() -> float:
    return time.monotonic() + 5


def test_several_frames_in_one_send_arrive_whole_and_in_order(pair: tuple[TcpConnection, TcpConnection]) -> None:
    left, right = pair
    rng = np.random.default_rng(3)
    payloads = [rng.integers(0, 256, n, np.uint8) for n in (10, 0, 70_000, 3)]
    frames = [(PushBlocks(f"t{i}", i, 0, 1, 1, 4), (memoryview(p.data),) if p.size else ())
              for i, p in enumerate(payloads)]
    left.send_frames(frames, soon())
    for i, expected in enumerate(payloads):
        got = right.recv_frame(5, soon())
        assert got is not None
        message, payload_len = got
        assert isinstance(message, PushBlocks) and message.transfer_id == f"t{i}" and payload_len == expected.size
        out = bytearray(payload_len)
        right.recv_payload_into(memoryview(out), soon())
        assert bytes(out) == expected.tobytes()
    assert right.recv_frame(0, soon()) is None


def test_a_payload_larger_than_the_socket_buffers_is_resumed_after_partial_writes(
        pair: tuple[TcpConnection, TcpConnection]) -> None:
    left, right = pair
    data = np.random.default_rng(4).integers(0, 256, 24 << 20, np.uint8)
    views = tuple(memoryview(data[i : i + (3 << 20)].data) for i in range(0, data.size, 3 << 20))
    sender = threading.Thread(target=left.send_frames, args=([(PushBlocks("big", 0, 0, 8, 8, 1), views)], soon()))
    sender.start()
    got = right.recv_frame(5, soon())
    assert got is not None and got[1] == data.size
    out = np.empty(data.size, np.uint8)
    right.recv_payload_into(memoryview(out.data), soon())
    sender.join(5)
    assert not sender.is_alive() and np.array_equal(out, data)


def test_queued_replies_go_out_before_the_connection_waits_and_before_later_frames(
        pair: tuple[TcpConnection, TcpConnection]) -> None:
    left, right = pair
    right.queue_frame(PushAck("t", True))
    assert left.recv_frame(0.05, soon()) is None  # queued, not sent yet
    assert right.recv_frame(0.01, soon()) is None  # waiting for input flushes the queue first
    got = left.recv_frame(5, soon())
    assert got is not None and got[0] == PushAck("t", True)
    right.queue_frame(PayloadCopied("t", 0, 2))
    right.send_frame(PushAck("u", False, "full"), (), soon())
    first, second = left.recv_frame(5, soon()), left.recv_frame(5, soon())
    assert first is not None and first[0] == PayloadCopied("t", 0, 2)
    assert second is not None and second[0] == PushAck("u", False, "full")


def test_a_peer_that_stops_reading_times_the_send_out_at_its_deadline(
        pair: tuple[TcpConnection, TcpConnection]) -> None:
    left, _ = pair
    data = memoryview(bytes(64 << 20))
    started = time.monotonic()
    with pytest.raises(TransferTimeout):
        left.send_frames([(PushBlocks("t", 0, 0, 1, 1, 1), (data,))], time.monotonic() + 0.5)
    assert time.monotonic() - started < 3


def test_a_silent_peer_times_the_receive_out_at_its_deadline(pair: tuple[TcpConnection, TcpConnection]) -> None:
    left, right = pair
    left.send_frame(PushBlocks("t", 0, 0, 1, 1, 1), (memoryview(b"only part"),), soon())
    assert right.recv_frame(5, soon()) is not None
    started = time.monotonic()
    with pytest.raises(TransferTimeout):
        right.recv_payload_into(memoryview(bytearray(100)), time.monotonic() + 0.3)
    assert time.monotonic() - started < 3


def _job(tid: str, layer: int, blocks: int = 2) -> PushJob:
    return PushJob(tid, Address("127.0.0.1", 1), layer, 4, blocks, (memoryview(bytes([layer])),), soon())


def test_consecutive_layers_of_a_transfer_merge_into_one_frame() -> None:
    jobs = [_job("a", 0), _job("a", 1), _job("a", 2), _job("b", 0), _job("a", 3), _job("b", 2), _job("b", 3)]
    frames = _frames(jobs)
    heads = [(f.transfer_id, f.layer, f.layers) for f, _ in frames]
    assert heads == [("a", 0, 3), ("b", 0, 1), ("a", 3, 1), ("b", 2, 2)]
    assert [bytes(v) for v in frames[0][1]] == [b"\x00", b"\x01", b"\x02"]
    assert all(f.first_block == 0 and f.num_blocks == f.total_blocks == 2 for f, _ in frames)


def test_queued_replies_go_out_once_old_even_while_input_keeps_arriving(
        pair: tuple[TcpConnection, TcpConnection]) -> None:
    left, right = pair
    left.send_frames([(PushBlocks(f"t{i}", 0, 0, 1, 1, 1), ()) for i in range(3)], soon())
    first = right.recv_frame(5, soon())  # reads the whole burst into the buffer
    assert first is not None and right.buffered
    right.queue_frame(PushAck("t0", True))
    time.sleep(0.01)
    assert right.recv_frame(5, soon()) is not None  # input still buffered (no wait), but the queue is old: sent
    assert right.buffered
    got = left.recv_frame(5, soon())
    assert got is not None and got[0] == PushAck("t0", True)


class _CountingSocket(socket.socket):
    """A TCP socket that counts the requests for prompt ACKs made on it."""

    quick_acks = 0

    def setsockopt(self, level: int, option: int, value: int | bytes) -> None:  # type: ignore[override]
        if (level, option, value) == (socket.IPPROTO_TCP, getattr(socket, "TCP_QUICKACK", -1), 1):
            self.quick_acks += 1
        super().setsockopt(level, option, value)


@pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK"), reason="TCP_QUICKACK is Linux's")
def test_the_receiving_side_asks_for_prompt_acks_after_each_payload_and_after_its_replies() -> None:
    # Replies on a stream that flows the other way put TCP into its interactive mode, which delays the ACKs that
    # open the sender's window (a 1 MiB push stream ran about 15% slower): the receiver leaves that mode each time.
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname()[:2])
        accepted, _ = server.accept()
    counted = _CountingSocket(fileno=accepted.detach())
    sender = TcpConnection(client, "receiver", b"k", FrameLimits())
    receiver = TcpConnection(counted, "sender", b"k", FrameLimits())
    try:
        payload = np.random.default_rng(5).integers(0, 256, 300_000, np.uint8)
        sender.send_frame(PushBlocks("t", 0, 0, 1, 1, 1), (memoryview(payload.data),), soon())
        got = receiver.recv_frame(5, soon())
        assert got is not None and got[1] == payload.size
        out = np.empty(payload.size, np.uint8)
        receiver.recv_payload_into(memoryview(out.data), soon())
        assert np.array_equal(out, payload)
        after_payload = counted.quick_acks
        assert after_payload >= 1
        receiver.queue_frame(PushAck("t", True))
        receiver.flush(soon())
        assert counted.quick_acks == after_payload + 1
        ack = sender.recv_frame(5, soon())
        assert ack is not None and ack[0] == PushAck("t", True)
        receiver.flush(soon())  # nothing queued: nothing sent, nothing asked
        assert counted.quick_acks == after_payload + 1
        sender.send_frame(PushBlocks("u", 0, 0, 1, 1, 1), (memoryview(payload.data),), soon())  # a pull's answer
        got = receiver.recv_frame(5, soon())
        assert got is not None and got[1] == payload.size
        halves = np.empty(payload.size, np.uint8)
        before = counted.quick_acks
        receiver.recv_payload_into_all([memoryview(halves[:1000].data), memoryview(halves[1000:].data)], soon())
        assert np.array_equal(halves, payload) and counted.quick_acks >= before + 1
    finally:
        sender.close()
        receiver.close()


class _LowatSocket(socket.socket):
    """A TCP socket that records the low-water marks set on it."""

    def setsockopt(self, level: int, option: int, value: int | bytes) -> None:  # type: ignore[override]
        if (level, option) == (socket.SOL_SOCKET, socket.SO_RCVLOWAT):
            self.marks = [*getattr(self, "marks", []), value]
        super().setsockopt(level, option, value)


def test_a_large_payload_is_waited_for_by_the_mib_never_past_its_end_and_later_frames_are_not_held() -> None:
    # The reader is woken once a MiB has arrived, not every few segments (fewer wake-ups of the reading thread: 4 MiB
    # pushes ran about a fifth faster); the mark is never above the bytes still due, which would stall the payload's
    # tail until its deadline, and is back at one byte for the frames that follow.
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname()[:2])
        accepted, _ = server.accept()
    recorded = _LowatSocket(fileno=accepted.detach())
    for sock in (client, recorded):
        tune_socket(sock)
    sender = TcpConnection(client, "receiver", b"k", FrameLimits())
    receiver = TcpConnection(recorded, "sender", b"k", FrameLimits())
    cap = min(1 << 20, recorded.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 2)
    tail = cap // 2
    payload = np.random.default_rng(6).integers(0, 256, 2 * cap + tail, np.uint8)

    def send_in_three() -> None:  # each part arrives once the reader already waits for it
        sender.send_buffers([sender.encode(PushBlocks("t", 0, 0, 1, 1, 1), payload.size),
                             memoryview(payload[:cap].data)], soon())
        time.sleep(0.3)
        sender.send_buffers([memoryview(payload[cap : 2 * cap].data)], soon())
        time.sleep(0.3)
        sender.send_buffers([memoryview(payload[2 * cap :].data)], soon())

    parts = threading.Thread(target=send_in_three)
    parts.start()
    try:
        got = receiver.recv_frame(5, soon())
        assert got is not None and got[1] == payload.size
        out = np.empty(payload.size, np.uint8)
        started = time.monotonic()
        receiver.recv_payload_into(memoryview(out.data), time.monotonic() + 3)
        parts.join(5)
        assert time.monotonic() - started < 2 and np.array_equal(out, payload)
        marks = getattr(recorded, "marks", [])
        assert cap in marks and tail in marks and marks[-1] == 1 and all(m <= payload.size for m in marks)
        assert recorded.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        later = threading.Timer(0.2, sender.send_frame, (PushAck("t", True), (), soon()))
        later.start()
        started = time.monotonic()
        ack = receiver.recv_frame(3, soon())
        later.join()
        assert ack is not None and ack[0] == PushAck("t", True) and time.monotonic() - started < 1
    finally:
        parts.join(5)
        sender.close()
        receiver.close()


class _Calls:
    """A socket whose calls that let go of the interpreter lock (`recv_into`, `recv`, `sendmsg`) are counted."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.counted: list[str] = []

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._sock, name)
        if name in ("recv_into", "recv", "sendmsg", "send", "sendall"):
            def call(*args: object) -> object:
                self.counted.append(name)
                return attr(*args)
            return call
        return attr


def test_short_frames_are_sent_and_frames_that_arrived_read_keeping_the_interpreter_lock(
        pair: tuple[TcpConnection, TcpConnection]) -> None:
    """A thread that runs Python without pause (vLLM's) holds the lock for up to the switch interval each time one
    of ours lets go of it around a system call: the calls that cannot block keep it."""
    left, right = pair
    sent, got = _Calls(left._sock), _Calls(right._sock)
    left._sock, right._sock = sent, got  # type: ignore[assignment]
    payload = np.arange(3000, dtype=np.uint8)
    left.send_frames([(PushAck("t0", True, ""), ()), (PushBlocks("t1", 0, 0, 1, 1, 4), (memoryview(payload.data),))],
                     soon())
    first = right.recv_frame(5, soon())
    assert first is not None and first[0] == PushAck("t0", True, "")
    frame = right.recv_frame(5, soon())
    assert frame is not None and frame[1] == payload.nbytes
    into = np.zeros(payload.nbytes, np.uint8)
    right.recv_payload_into(memoryview(into.data), soon())
    assert (into == payload).all()
    assert sent.counted == [] and got.counted == []
    # A longer send lets go of the lock (it may wait for room); its bytes, there when read, are still read holding it
    longer = np.random.default_rng(5).integers(0, 256, held.SEND_MAX + 1, np.uint8)
    left.send_frame(PushBlocks("t2", 0, 0, 1, 1, 4), (memoryview(longer.data),), soon())
    frame = right.recv_frame(5, soon())
    assert frame is not None and frame[1] == longer.nbytes
    into = np.zeros(longer.nbytes, np.uint8)
    right.recv_payload_into(memoryview(into.data), soon())
    assert (into == longer).all()
    assert sent.counted == ["sendmsg"] and got.counted == []
