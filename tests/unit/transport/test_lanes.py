"""Lane: operations run in order on one daemon thread, which keeps nothing of an operation once
it is done and ends when its lane is closed. A buffer over a torch tensor that a daemon thread
drops while the interpreter shuts down aborts the process ("terminate called without an active
exception"), so neither an idle lane nor a closed pair may hold one."""

from __future__ import annotations

import socket
import threading
import time
import weakref
from functools import partial

import numpy as np
import pytest

from hora.errors import TransportError
from hora.transport.base import DATA
from hora.transport.lanes import Lane
from hora.transport.tcp import TcpPair

pytestmark = pytest.mark.timeout(60)


def _closed() -> TransportError:
    return TransportError("lane closed")


def _gone(ref: weakref.ref[np.ndarray], within: float = 10.0) -> bool:
    """Whether ``ref``'s array is freed within ``within`` seconds (it is let go by another
    thread, just after its operation reports done)."""
    deadline = time.monotonic() + within
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    return ref() is None


def test_operations_run_in_order_and_errors_reach_their_waiter() -> None:
    lane = Lane("test-lane", _closed)
    seen: list[int] = []
    works = [lane.submit(partial(seen.append, i)) for i in range(5)]
    failing = lane.submit(partial(int, "not a number"))
    for work in works:
        work.wait(10)
    with pytest.raises(TransportError, match=r"test-lane: ValueError: invalid literal"):
        failing.wait(10)
    assert seen == [0, 1, 2, 3, 4]
    lane.close()
    with pytest.raises(TransportError, match="lane closed"):
        lane.submit(partial(seen.append, 5)).wait(10)
    lane.join()
    assert lane._thread is not None and not lane._thread.is_alive()


def test_an_idle_lane_keeps_no_buffer_of_a_finished_operation() -> None:
    lane = Lane("test-lane", _closed)
    buf = np.zeros(1000)
    ref = weakref.ref(buf)
    lane.submit(partial(memoryview(buf).cast("B").__len__)).wait(10)
    del buf
    assert _gone(ref), "the lane thread still holds the finished operation's buffer"
    assert lane._thread is not None and lane._thread.is_alive()  # idle, not ended
    lane.close()
    lane.join()


def test_a_closed_tcp_pair_has_no_thread_left_and_holds_no_buffer() -> None:
    before = set(threading.enumerate())
    a, b = socket.socketpair()
    left, right = TcpPair(a, 1, DATA), TcpPair(b, 0, DATA)
    sent, got = np.arange(50_000, dtype=np.float64), np.zeros(50_000)
    refs = weakref.ref(sent), weakref.ref(got)
    receive = right.irecv(memoryview(got).cast("B"))
    left.isend(sent).wait(10)
    receive.wait(10)
    assert np.array_equal(got, sent)
    del sent, got
    assert all(_gone(r) for r in refs), "a lane thread still holds a finished transfer's buffer"
    lanes = {t for t in set(threading.enumerate()) - before if t.name.startswith("hora-tcp-")}
    assert lanes  # the transfers above ran on these two pairs' lane threads
    left.close()
    right.close()
    assert not [t.name for t in lanes if t.is_alive()]
