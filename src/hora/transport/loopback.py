"""In-process transport: ``LoopbackWorld(size)`` connects ``size`` Transports through memory.

For tests (one thread per rank) and for a world of size 1. Every Pair keeps the contract of
``transport/base.py``: frames in order, ``recv_into`` raises TransportError when a frame's
length differs from the buffer's, ``isend``/``irecv`` return Work objects, data frames and
``send_msg`` messages are told apart, and ``fileno()`` is a real descriptor (one end of a
``socket.socketpair``, created on first use) that is readable exactly while a frame is queued
or the connection is closed.

A send copies the frame straight into the buffer of a receive that is already posted, or else
into a queue; so ``send``/``isend`` never block and an ``isend`` is done when it returns.
Receives wait at most the world's ``timeout`` (then TransportError, pair closed);
``Work.wait(timeout)`` raises TimeoutError and leaves the pair open, like the TCP transport.

Thread-safety: each Pair is meant for one thread (its rank's), but the two ends of a connection
run concurrently; shared state is guarded by one lock per connection. ``close`` is safe from
any thread.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from hora.errors import TransportError
from hora.transport.base import DATA, MAX_MESSAGE, Buffer

log = logging.getLogger(__name__)

_DATA_FRAME = 0
_MSG_FRAME = 1
_BIG_COPY = 64 << 10  # copies at least this large go through NumPy, which releases the GIL

T = TypeVar("T")


def _bytes_of(buf: Buffer, writable: bool = False) -> memoryview:
    try:
        view = memoryview(buf).cast("B")
    except TypeError as e:
        raise TypeError(f"transport buffers must be contiguous, got {type(buf).__name__}") from e
    if writable and view.readonly:
        raise TypeError(f"cannot receive into a read-only buffer ({type(buf).__name__})")
    return view


def _copy(dst: memoryview, src: memoryview | bytes) -> None:
    if len(dst) >= _BIG_COPY:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
    else:
        dst[:] = src


class LoopbackWork:
    """Completion of one receive (or an already finished send)."""

    __slots__ = ("_event", "_error", "_view", "_kind", "_payload", "_pair")

    def __init__(self, pair: LoopbackPair | None, view: memoryview | None, kind: int) -> None:
        self._event = threading.Event()
        self._error: TransportError | None = None
        self._view = view
        self._kind = kind
        self._payload = b""
        self._pair = pair

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if timeout is not None:
            if not self._event.wait(timeout):
                raise TimeoutError(f"transport operation not done after {timeout}s")
        elif self._pair is not None and not self._event.wait(self._pair.timeout):
            self._pair._fail(f"timed out after {self._pair.timeout}s waiting for a frame")
        if self._error is not None:
            raise TransportError(str(self._error)) from self._error

    def _fill(self, kind: int, frame: memoryview | bytes) -> str | None:
        """Complete with ``frame``; returns the reason to close the connection, if any."""
        reason = None
        if kind != self._kind:
            want, got = ("data", "message") if self._kind == _DATA_FRAME else ("message", "data")
            reason = f"expected a {want} frame, got a {got} frame"
        elif self._view is None:
            self._payload = bytes(frame)
        elif len(frame) != len(self._view):
            reason = f"frame of {len(frame)} bytes does not fit a {len(self._view)}-byte buffer"
        else:
            _copy(self._view, frame)
        if reason is not None:
            self._error = TransportError(reason)
        self._event.set()
        return reason

    def _finish_error(self, error: TransportError) -> None:
        self._error = error
        self._event.set()


class _Lane:
    """Frames travelling one way on a connection (state guarded by the connection's lock)."""

    def __init__(self) -> None:
        self.frames: deque[tuple[int, bytes]] = deque()
        self.waiting: deque[LoopbackWork] = deque()
        self.closed: str | None = None
        self.notify: tuple[socket.socket, socket.socket] | None = None
        self.signalled = False

    def sync_notify(self) -> None:
        if self.notify is None:
            return
        readable = bool(self.frames) or self.closed is not None
        if readable and not self.signalled:
            self.notify[1].send(b"\0")
        elif not readable and self.signalled:
            self.notify[0].recv(1)
        self.signalled = readable

    def close_notify(self) -> None:
        if self.notify is not None:
            for s in self.notify:
                s.close()
            self.notify = None


class _Connection:
    """Both directions between ranks ``a < b`` on one channel."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lanes = {0: _Lane(), 1: _Lane()}

    def close(self, reason: str) -> None:
        with self.lock:
            for lane in self.lanes.values():
                if lane.closed is None:
                    lane.closed = reason
                waiting = list(lane.waiting)
                lane.waiting.clear()
                lane.sync_notify()
                for work in waiting:
                    work._finish_error(TransportError(reason))


class LoopbackPair:
    """This rank's end of an in-memory connection to ``peer``."""

    def __init__(self, rank: int, peer: int, conn: _Connection, timeout: float) -> None:
        self.peer = peer
        self.rank = rank
        self.timeout = timeout
        self._conn = conn
        self._out = conn.lanes[int(rank > peer)]
        self._in = conn.lanes[int(peer > rank)]
        self._closed: str | None = None

    def __repr__(self) -> str:
        return f"LoopbackPair({self.rank}->{self.peer})"

    def send(self, buf: Buffer) -> None:
        self._deliver(_DATA_FRAME, _bytes_of(buf))

    def isend(self, buf: Buffer) -> LoopbackWork:
        view = _bytes_of(buf)
        work = LoopbackWork(None, None, _DATA_FRAME)
        try:
            self._deliver(_DATA_FRAME, view)
        except TransportError as e:
            work._finish_error(e)
        else:
            work._event.set()
        return work

    def recv_into(self, buf: memoryview | bytearray) -> None:
        self.irecv(buf).wait()

    def irecv(self, buf: memoryview | bytearray) -> LoopbackWork:
        return self._post(LoopbackWork(self, _bytes_of(buf, writable=True), _DATA_FRAME))

    def send_msg(self, payload: bytes) -> None:
        view = _bytes_of(payload)
        if len(view) > MAX_MESSAGE:
            raise ValueError(f"message of {len(view)} bytes exceeds MAX_MESSAGE={MAX_MESSAGE}")
        self._deliver(_MSG_FRAME, view)

    def recv_msg(self) -> bytes:
        work = self._post(LoopbackWork(self, None, _MSG_FRAME))
        work.wait()
        return work._payload

    def fileno(self) -> int:
        with self._conn.lock:
            if self._in.notify is None:  # first use (or after the world closed: a fresh one)
                reader, writer = socket.socketpair()
                reader.setblocking(False)
                writer.setblocking(False)
                self._in.notify = (reader, writer)
                self._in.sync_notify()
            return self._in.notify[0].fileno()

    def close(self) -> None:
        self._fail(f"closed by rank {self.rank}", error=False)

    def _check_open(self) -> None:
        if self._closed is not None:
            raise TransportError(f"connection to rank {self.peer} is closed: {self._closed}")

    def _fail(self, reason: str, error: bool = True) -> None:
        if self._closed is None:
            self._closed = reason
        self._conn.close(reason)
        if error:
            raise TransportError(f"rank {self.peer}: {reason}")

    def _deliver(self, kind: int, view: memoryview) -> None:
        self._check_open()
        with self._conn.lock:
            lane = self._out
            if lane.closed is not None:
                raise TransportError(f"rank {self.peer}: connection closed ({lane.closed})")
            if not lane.waiting:
                lane.frames.append((kind, bytes(view)))
                lane.sync_notify()
                return
            work = lane.waiting.popleft()
        reason = work._fill(kind, view)
        if reason is not None:
            self._conn.close(f"rank {self.rank} sent a bad frame: {reason}")

    def _post(self, work: LoopbackWork) -> LoopbackWork:
        if self._closed is not None:
            work._finish_error(
                TransportError(f"connection to rank {self.peer} is closed: {self._closed}")
            )
            return work
        with self._conn.lock:
            lane = self._in
            if lane.waiting or not lane.frames:
                if lane.closed is not None:
                    work._finish_error(
                        TransportError(f"rank {self.peer}: connection closed ({lane.closed})")
                    )
                else:
                    lane.waiting.append(work)
                return work
            kind, frame = lane.frames.popleft()
            lane.sync_notify()
        reason = work._fill(kind, frame)
        if reason is not None:
            self._closed = reason
            self._conn.close(reason)
        return work


class LoopbackTransport:
    """All the Pairs of one rank of a :class:`LoopbackWorld`."""

    def __init__(self, world: LoopbackWorld, rank: int) -> None:
        self.rank = rank
        self.size = world.size
        self._world = world
        self._pairs: dict[tuple[int, int], LoopbackPair] = {}
        self._lock = threading.Lock()

    def pair(self, peer: int, channel: int = DATA) -> LoopbackPair:
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"rank {self.rank} has no pair to rank {peer} (size {self.size})")
        with self._lock:
            key = (peer, channel)
            if key not in self._pairs:
                conn = self._world._connection(self.rank, peer, channel)
                self._pairs[key] = LoopbackPair(self.rank, peer, conn, self._world.timeout)
            return self._pairs[key]

    def close(self) -> None:
        with self._lock:
            pairs = list(self._pairs.values())
        for p in pairs:
            p.close()


class LoopbackWorld:
    """``size`` connected LoopbackTransports; ``run(fn)`` runs ``fn(transport)`` per rank."""

    def __init__(self, size: int, timeout: float = 60.0) -> None:
        if size < 1:
            raise ValueError(f"world size must be at least 1, got {size}")
        self.size = size
        self.timeout = timeout
        self._lock = threading.Lock()
        self._closed = False
        self._conns: dict[tuple[int, int, int], _Connection] = {}
        self.transports = [LoopbackTransport(self, r) for r in range(size)]

    def _connection(self, rank: int, peer: int, channel: int) -> _Connection:
        key = (min(rank, peer), max(rank, peer), channel)
        with self._lock:
            if key not in self._conns:
                self._conns[key] = _Connection()
                if self._closed:
                    self._conns[key].close("the loopback world was closed")
            return self._conns[key]

    def close(self) -> None:
        """Close every connection, also those not made yet (they are born closed)."""
        with self._lock:
            self._closed = True
            conns = list(self._conns.values())
        for conn in conns:
            conn.close("the loopback world was closed")
        for conn in conns:
            with conn.lock:
                for lane in conn.lanes.values():
                    lane.close_notify()

    def run(self, fn: Callable[[LoopbackTransport], T], timeout: float | None = None) -> list[T]:
        """Run ``fn`` on one thread per rank; results in rank order.

        If a rank raises, the world is closed (so the others fail fast instead of waiting) and
        the first error that is not a TransportError is re-raised. TimeoutError if the ranks do
        not all finish within ``timeout`` (default: the world's timeout).
        """
        limit = self.timeout if timeout is None else timeout
        results: list[object] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def body(rank: int) -> None:
            try:
                results[rank] = fn(self.transports[rank])
            except BaseException as e:  # re-raised in the caller's thread below
                errors[rank] = e
                self.close()

        threads = [
            threading.Thread(target=body, args=(r,), name=f"loopback-rank-{r}", daemon=True)
            for r in range(self.size)
        ]
        for t in threads:
            t.start()
        _join_all(threads, limit)
        if any(t.is_alive() for t in threads):
            self.close()
            _join_all(threads, 5.0)
            stuck = [r for r, t in enumerate(threads) if t.is_alive()]
            raise TimeoutError(f"ranks {stuck} did not finish within {limit}s")
        failed = [e for e in errors if e is not None]
        if failed:
            root = [e for e in failed if not isinstance(e, TransportError)]
            raise (root or failed)[0]
        return results  # type: ignore[return-value]


def _join_all(threads: Sequence[threading.Thread], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
