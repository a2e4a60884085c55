"""The loopback transport keeps the Pair contract of transport/base.py."""

from __future__ import annotations

import selectors
from collections.abc import Iterator

import numpy as np
import pytest

from hora.errors import TransportError
from hora.transport.base import CONTROL, DATA, Pair, Transport
from hora.transport.loopback import LoopbackWorld


@pytest.fixture
def world() -> Iterator[LoopbackWorld]:
    w = LoopbackWorld(3, timeout=5.0)
    yield w
    w.close()


@pytest.mark.timeout(30)
def test_protocols_and_ordering(world: LoopbackWorld) -> None:
    t0, t1 = world.transports[0], world.transports[1]
    assert isinstance(t0, Transport) and isinstance(t0.pair(1), Pair)
    assert t0.pair(1) is t0.pair(1, DATA) and t0.pair(1, CONTROL) is not t0.pair(1)
    a = t0.pair(1)
    b = t1.pair(0)
    data = bytearray(b"abcdef")
    a.send(data)
    data[:] = b"zzzzzz"  # send copied the frame
    a.isend(b"12").wait()
    works = [b.irecv(bytearray(6)), b.irecv(bytearray(2))]
    into = bytearray(3)
    posted = b.irecv(into)  # posted before the frame exists
    assert not posted.done()
    a.send(np.arange(3, dtype=np.uint8))
    posted.wait(timeout=1.0)
    for w in works:
        w.wait()
    assert bytes(into) == b"\x00\x01\x02"
    a.send_msg(b"hello")
    assert b.recv_msg() == b"hello"
    t1.pair(0, CONTROL).send_msg(b"ctl")
    assert t0.pair(1, CONTROL).recv_msg() == b"ctl"


@pytest.mark.timeout(30)
def test_length_mismatch_raises_and_closes(world: LoopbackWorld) -> None:
    a, b = world.transports[0].pair(1), world.transports[1].pair(0)
    a.send(b"abc")
    with pytest.raises(TransportError, match="3 bytes"):
        b.recv_into(bytearray(4))
    with pytest.raises(TransportError):
        b.recv_into(bytearray(3))
    with pytest.raises(TransportError):
        a.send(b"abc")


@pytest.mark.timeout(30)
def test_frame_kinds_are_not_mixed(world: LoopbackWorld) -> None:
    a, b = world.transports[0].pair(2), world.transports[2].pair(0)
    a.send_msg(b"xy")
    with pytest.raises(TransportError, match="message"):
        b.recv_into(bytearray(2))


@pytest.mark.timeout(30)
def test_posted_receive_with_wrong_length_fails_on_wait(world: LoopbackWorld) -> None:
    a, b = world.transports[0].pair(1), world.transports[1].pair(0)
    work = b.irecv(bytearray(8))
    a.send(b"short")
    with pytest.raises(TransportError, match="5 bytes"):
        work.wait()


@pytest.mark.timeout(30)
def test_timeouts(world: LoopbackWorld) -> None:
    quick = LoopbackWorld(2, timeout=0.2)
    b = quick.transports[1].pair(0)
    work = b.irecv(bytearray(1))
    with pytest.raises(TimeoutError):
        work.wait(timeout=0.05)  # pair stays open
    with pytest.raises(TransportError, match="timed out"):
        work.wait()
    with pytest.raises(TransportError):
        b.recv_into(bytearray(1))
    quick.close()


@pytest.mark.timeout(30)
def test_close_wakes_the_peer_and_fileno_signals_frames(world: LoopbackWorld) -> None:
    a, b = world.transports[0].pair(1), world.transports[1].pair(0)
    sel = selectors.DefaultSelector()
    sel.register(b.fileno(), selectors.EVENT_READ)
    assert sel.select(timeout=0) == []
    a.send(b"1")
    a.send(b"2")
    assert len(sel.select(timeout=1.0)) == 1
    b.recv_into(bytearray(1))
    assert len(sel.select(timeout=0)) == 1  # still one frame queued
    b.recv_into(bytearray(1))
    assert sel.select(timeout=0) == []
    pending = b.irecv(bytearray(1))
    world.transports[0].close()
    with pytest.raises(TransportError, match="closed"):
        pending.wait()
    assert len(sel.select(timeout=1.0)) == 1  # a closed connection reads as readable
    sel.close()
    for work in (a.isend(b"x"), a.irecv(bytearray(1)), b.isend(b"y")):
        with pytest.raises(TransportError):
            work.wait()  # failures surface on wait, like the TCP transport


@pytest.mark.timeout(30)
def test_run_reports_the_root_error_and_rejects_self_pairs() -> None:
    world = LoopbackWorld(3, timeout=10.0)

    def body(t: Transport) -> int:
        if t.rank == 2:
            raise RuntimeError("rank 2 broke")
        t.pair((t.rank + 1) % 3).recv_into(bytearray(1))  # would wait for rank 2 forever
        return t.rank

    with pytest.raises(RuntimeError, match="rank 2 broke"):
        world.run(body)
    late = world.transports[0].pair(2)  # made after the world closed: born closed
    with pytest.raises(TransportError, match="closed"):
        late.recv_into(bytearray(1))
    assert LoopbackWorld(2).run(lambda t: t.rank * 10) == [0, 10]
    with pytest.raises(ValueError, match="no pair"):
        LoopbackWorld(2).transports[0].pair(0)
    with pytest.raises(ValueError):
        LoopbackWorld(0)
