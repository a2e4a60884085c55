"""TcpPair framing on a real socket pair: one end a TcpPair, the other a TcpPair or raw bytes."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from hora.errors import TransportError
from hora.transport.base import CONTROL, DATA, MAX_MESSAGE, Pair, Work
from hora.transport.tcp import TcpPair
from hora.transport.tcp.wire import DATA_FRAME, HEADER, MAGIC, MSG_FRAME, VERSION, recv_exact

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pairs() -> Iterator[tuple[TcpPair, TcpPair]]:
    a, b = socket.socketpair()
    left, right = TcpPair(a, 1, DATA), TcpPair(b, 0, DATA)
    yield left, right
    left.close()
    right.close()


@pytest.fixture
def half() -> Iterator[tuple[TcpPair, socket.socket]]:
    a, b = socket.socketpair()
    pair = TcpPair(a, 2, CONTROL)
    yield pair, b
    pair.close()
    b.close()


def test_satisfies_protocols(pairs: tuple[TcpPair, TcpPair]) -> None:
    left, right = pairs
    assert isinstance(left, Pair)
    assert isinstance(left.isend(b""), Work)
    right.recv_into(bytearray(0))


def test_data_and_messages_in_order(pairs: tuple[TcpPair, TcpPair]) -> None:
    left, right = pairs
    payload = np.arange(300_000, dtype=np.float64)  # larger than the socket buffers

    def sender() -> None:
        left.send(payload)
        left.send_msg(b"hello")
        left.send(b"")
        left.send_msg(b"")

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    got = np.zeros_like(payload)
    right.recv_into(got)
    assert right.recv_msg() == b"hello"
    right.recv_into(bytearray(0))
    assert right.recv_msg() == b""
    thread.join(10)
    np.testing.assert_array_equal(got, payload)


def test_isend_irecv_keep_order_with_blocking_calls(pairs: tuple[TcpPair, TcpPair]) -> None:
    left, right = pairs
    sent = [np.full(1000 + i, i, dtype=np.int32) for i in range(20)]
    got = [np.zeros(1000 + i, dtype=np.int32) for i in range(21)]
    recvs = [right.irecv(g) for g in got[:20]]
    sends = [left.isend(s) for s in sent]
    left.send(np.full(1020, 20, dtype=np.int32))  # queued behind the isends
    right.recv_into(got[20])  # waits for the irecvs first
    for work in sends + recvs:
        work.wait(10)
        assert work.done()
    for i, g in enumerate(got):
        assert (g == i).all()


def test_wrong_length_closes_the_pair(pairs: tuple[TcpPair, TcpPair]) -> None:
    left, right = pairs
    left.send(bytearray(10))
    with pytest.raises(TransportError, match="malformed frame from rank 0.*expected 8 bytes"):
        right.recv_into(bytearray(8))
    assert right.closed
    with pytest.raises(TransportError, match="rank 0"):
        right.recv_into(bytearray(8))
    with pytest.raises(TransportError):
        right.isend(b"x").wait(5)


def test_message_where_data_expected_is_malformed(pairs: tuple[TcpPair, TcpPair]) -> None:
    left, right = pairs
    left.send_msg(b"abc")
    with pytest.raises(TransportError, match="expected a data frame, got message frame"):
        right.recv_into(bytearray(3))


def test_recv_msg_rejects_oversized_and_garbage(half: tuple[TcpPair, socket.socket]) -> None:
    pair, raw = half
    raw.sendall(HEADER.pack(MAGIC, VERSION, MSG_FRAME, MAX_MESSAGE + 1))
    with pytest.raises(TransportError, match="exceeds MAX_MESSAGE"):
        pair.recv_msg()
    a, b = socket.socketpair()
    other = TcpPair(a, 3, DATA)
    b.sendall(b"GARBAGE-GARBAGE-GARBAGE")
    with pytest.raises(TransportError, match="bad magic"):
        other.recv_into(bytearray(11))
    b.close()


def test_header_split_across_reads(half: tuple[TcpPair, socket.socket]) -> None:
    pair, raw = half
    buf = bytearray(4)
    thread = threading.Thread(target=pair.recv_into, args=(buf,), daemon=True)
    thread.start()
    frame = HEADER.pack(MAGIC, VERSION, DATA_FRAME, 4) + b"abcd"
    for i in range(len(frame)):
        raw.sendall(frame[i : i + 1])
    thread.join(10)
    assert buf == b"abcd"


def test_peer_close_raises_naming_the_rank(half: tuple[TcpPair, socket.socket]) -> None:
    pair, raw = half
    work = pair.irecv(bytearray(16))
    raw.close()
    with pytest.raises(TransportError, match=r"rank 2 \(control channel\) closed \(peer exited"):
        work.wait(10)


def test_close_unblocks_a_blocked_recv(pairs: tuple[TcpPair, TcpPair]) -> None:
    _, right = pairs
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            right.recv_into(bytearray(100))
        except TransportError as e:
            errors.append(e)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    thread.join(0.2)
    right.close()
    right.close()  # idempotent
    thread.join(5)
    assert not thread.is_alive()
    assert len(errors) == 1 and "closed by this rank" in str(errors[0])


def test_work_wait_timeout_leaves_pair_open(pairs: tuple[TcpPair, TcpPair]) -> None:
    left, right = pairs
    work = right.irecv(bytearray(3))
    with pytest.raises(TimeoutError):
        work.wait(0.05)
    left.send(b"xyz")
    work.wait(10)
    assert not right.closed


def test_bad_buffers_raise_type_error(pairs: tuple[TcpPair, TcpPair]) -> None:
    left, right = pairs
    with pytest.raises(TypeError, match="read-only"):
        right.recv_into(b"immutable")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="contiguous"):
        left.send(np.zeros((4, 4))[:, 0])
    with pytest.raises(TypeError, match="contiguous"):
        left.send(42)  # type: ignore[arg-type]


def test_large_isend_finishes_in_background_in_order(pairs: tuple[TcpPair, TcpPair]) -> None:
    left, right = pairs
    big = np.arange(4_000_000, dtype=np.int32)  # far more than the socket buffers hold
    work = left.isend(big)
    assert not work.done()  # nobody reads yet: the rest waits on the sender thread
    follow = left.isend(b"after")  # queued behind it, not sent inline
    got = np.zeros_like(big)
    right.recv_into(got)
    tail = bytearray(5)
    right.recv_into(tail)
    work.wait(10)
    follow.wait(10)
    np.testing.assert_array_equal(got, big)
    assert tail == b"after"


@pytest.mark.timeout(60)
def test_a_peer_that_stops_reading_for_12_s_keeps_the_connection() -> None:
    """A paused rank (SIGSTOP) still has a kernel that acknowledges probes but a shut receive
    window; Linux counts that against TCP_USER_TIMEOUT, so the timeout must outlast such pauses
    (the old 10 s broke connections whose peer was stopped for 25 s). Nor does the transport's
    watch for vanished hosts (hora.transport.tcp.liveness, here after 1 s of silence) take the
    paused peer for one: nothing stays unacknowledged."""
    from tcp_loopback import watched_pairs

    left, right, watch = watched_pairs(silence_s=1.0, check_s=0.1)
    payload = b"x" * (64 << 20)  # far more than both socket buffers hold
    outcome: list[BaseException | None] = []

    def send() -> None:
        try:
            left.send(payload)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            outcome.append(e)

    thread = threading.Thread(target=send, daemon=True)
    try:
        thread.start()
        silences = []
        for _ in range(60):  # the receiver reads nothing for 12 s: the window stays shut
            time.sleep(0.2)
            silences.append(left.unacked_silence())
        assert not outcome and not left.closed, f"the connection broke: {outcome}"
        assert all(s is None or s < 1.0 for s in silences), silences
        got = bytearray(len(payload))
        right.recv_into(got)
        thread.join(10.0)
        assert outcome == [None]
        assert got == payload
        time.sleep(0.2)  # the last acknowledgement comes back: nothing is in flight
        assert left.unacked_silence() is None
    finally:
        watch.stop()
        left.close()
        right.close()


def test_recv_exact_reads_a_message_sent_in_pieces_and_reports_an_early_close() -> None:
    """One read takes the whole message where the socket blocks; with a timeout set (the
    socket then does not block) or pieces that come apart, the rest is read after it."""
    for timeout in (None, 5.0):
        a, b = socket.socketpair()
        try:
            a.settimeout(timeout)
            late = threading.Timer(0.2, b.sendall, args=(b"world",))
            b.sendall(b"hello ")
            late.start()
            assert recv_exact(a, 11) == b"hello world"
            late.join()
            assert recv_exact(a, 0) == b""
            b.sendall(b"abc")
            b.close()
            with pytest.raises(EOFError):
                recv_exact(a, 10)
        finally:
            a.close()
            b.close()
