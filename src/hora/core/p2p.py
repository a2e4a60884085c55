"""Point-to-point messages beside the engine: tagged sends and receives between two ranks.

The engine negotiates collectives that every member of a set joins; a ``send`` from one rank
and a ``recv`` on another are not that, so they travel apart from it: a :class:`Mailbox` per
``init()`` has TCP connections of its own (its own listener and address, under the store
prefix ``<job>/p2p``), made on the first message between two ranks, so the engine's control
and data connections never carry a byte of them.

Contract:

* A message is matched by (sender, process set, tag); messages that match the same receive
  are taken in the order they were sent (no overtaking), as torch's ``send``/``recv`` ask. A
  receive from any sender (``peer`` None) takes the message of the set with its tag that came
  first; a message that both it and a receive naming its sender could take goes to the one
  posted first. A receive's handle gives the sender's global rank.
* A send completes once the receiver has taken the message into a receive of the same dtype
  and element count: a message no receive asks for yet waits in the receiver's memory, and
  its send stays pending until one does (as Gloo's). A receive that differs in dtype or size
  fails on both ranks with the same :class:`~hora.errors.MismatchError`, naming both.
* A send or receive still pending after ``HOROVOD_STALL_CHECK_TIME_SECONDS`` is reported
  once, as a warning naming both ranks and the tag (nothing is failed: the message may come).
* A peer whose connection closes (killed, exited) fails every pending message with it at
  once; once the engine stops (a rank lost anywhere in the job, ``shutdown``) every pending
  message fails with the engine's shutdown error, which names the rank that left.

Per peer, two connections: DATA carries each message (a fixed header, then the payload, sent
with the pair's ``isend`` so the caller never waits) and CONTROL the receiver's answers; a
reader thread on each. Readers never wait on a send, so two ranks sending to each other
cannot deadlock. A watchdog thread notices the engine's end and reports long waits.
Thread-safe: any user thread sends and receives; completions run on the reader threads.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hora.core.handles import Handle, shut_down_error
from hora.errors import MismatchError, TransportError
from hora.transport.base import CONTROL, DATA, Pair

log = logging.getLogger(__name__)

_HEAD = struct.Struct("!QiqQ16s")  # sequence number, process set, tag, payload bytes, dtype
_ANSWER = struct.Struct("!Q")  # the message's sequence number, then the error text ("" = taken)
WATCH_S = 0.2  # how often the watchdog looks at the engine
CAUSE_WAIT_S = 2.0  # how long a broken connection waits for the engine to name the cause

Key = tuple[int, int, int]  # (peer, process set, tag)
ANY = -1  # the peer of a receive from any sender


@dataclass(slots=True)
class _Send:
    seq: int
    peer: int
    view: memoryview
    handle: Handle
    tag: int = 0
    since: float = 0.0  # when it was sent (monotonic), for the report of a long wait
    reported: bool = False


@dataclass(slots=True)
class _Recv:
    key: Key
    view: memoryview
    dtype: str
    handle: Handle
    order: int = 0  # when it was posted: between a named and an any-sender receive
    since: float = 0.0  # when it was posted (monotonic), for the report of a long wait
    reported: bool = False


@dataclass(slots=True)
class _Arrived:
    seq: int
    dtype: str
    data: bytearray
    order: int = 0  # when it arrived: a receive from any sender takes the earliest


def mismatch(me: int, peer: int, tag: int, want: tuple[str, int], got: tuple[str, int]) -> str:
    """The error text both ranks raise when a message does not fit its receive."""
    return (
        f"Mismatched point-to-point message: rank {me} receives {want[1]} bytes of {want[0]} "
        f"from rank {peer} (tag {tag}), but rank {peer} sent {got[1]} bytes of {got[0]}"
    )


class _Link:
    """The connections to one peer, their readers, and the messages waiting for them."""

    def __init__(self, box: Mailbox, peer: int, patient: bool = False) -> None:
        self.box = box
        self.peer = peer
        # made for a receive from any sender: the peer may send nothing for a long time, so
        # a connection not made in time is tried again (until the mailbox closes)
        self.patient = patient
        self.data: Pair | None = None
        self.ctrl: Pair | None = None
        self.error: BaseException | None = None
        self.queued: list[tuple[bytes, memoryview]] = []  # sent before the connection was up
        self.send_lock = threading.Lock()
        self.ctrl_lock = threading.Lock()
        threading.Thread(target=self._open, name=f"hora-p2p-open-{peer}", daemon=True).start()

    def _open(self) -> None:
        while True:
            try:
                transport = self.box.transport()
                data, ctrl = transport.pair(self.peer, DATA), transport.pair(self.peer, CONTROL)
                break
            except BaseException as e:  # noqa: BLE001 - the messages waiting get the error
                if self.patient and isinstance(e, TransportError) and not self.box.closed():
                    log.debug("point-to-point connection to rank %d: %s; trying again",
                              self.peer, e)  # fmt: skip
                    continue
                self.box.broken(self.peer, e)
                return
        with self.send_lock:
            self.data, self.ctrl = data, ctrl
            queued, self.queued = self.queued, []
            for head, view in queued:
                data.isend(head)
                data.isend(view)
        for target, what in ((self._read_data, "data"), (self._read_answers, "answers")):
            threading.Thread(target=target, args=(data, ctrl), daemon=True,
                             name=f"hora-p2p-{what}-{self.peer}").start()  # fmt: skip

    def send(self, head: bytes, view: memoryview) -> None:
        with self.send_lock:
            if self.data is None:
                self.queued.append((head, view))
                return
            self.data.isend(head)  # in order: a failure closes the pair, the reader reports it
            self.data.isend(view)

    def answer(self, seq: int, error: str) -> None:
        """Tell the sender that message ``seq`` was taken ("") or why it failed."""
        with self.ctrl_lock:
            if self.ctrl is not None and self.error is None:
                # a failure here the readers see too, and report
                with contextlib.suppress(TransportError):
                    self.ctrl.send_msg(_ANSWER.pack(seq) + error.encode())

    def _read_data(self, data: Pair, ctrl: Pair) -> None:
        head = bytearray(_HEAD.size)
        try:
            while True:
                data.recv_into(head)
                seq, ps, tag, nbytes, raw = _HEAD.unpack(head)
                self.box.arrive(self, (self.peer, ps, tag), seq, raw.rstrip(b"\0").decode(),
                                nbytes, data)  # fmt: skip
        except BaseException as e:  # noqa: BLE001
            self.box.broken(self.peer, e)

    def _read_answers(self, data: Pair, ctrl: Pair) -> None:
        try:
            while True:
                msg = ctrl.recv_msg()
                (seq,) = _ANSWER.unpack_from(msg)
                self.box.answered(seq, msg[_ANSWER.size :].decode(errors="replace"))
        except BaseException as e:  # noqa: BLE001
            self.box.broken(self.peer, e)

    def close(self) -> None:
        for pair in (self.data, self.ctrl):
            if pair is not None:
                pair.close()


class Mailbox:
    """This rank's point-to-point messages. ``connect()`` makes the transport (on first use);
    ``stopped()`` is None while the engine runs, else its cause ("" if none was given)."""

    def __init__(self, rank: int, connect: Callable[[], Any],
                 stopped: Callable[[], str | None], report_after: float = 0.0) -> None:  # fmt: skip
        self.rank = rank
        self._report_after = report_after  # seconds; 0: long waits are not reported
        self._connect = connect
        self._stopped = stopped
        self._lock = threading.Lock()
        self._transport: Any = None
        self._links: dict[int, _Link] = {}
        self._posted: dict[Key, deque[_Recv]] = {}
        self._arrived: dict[Key, deque[_Arrived]] = {}
        self._sends: dict[int, _Send] = {}
        self._seq = itertools.count()
        self._order = itertools.count()  # posted receives and kept messages, in turn
        self._closed: BaseException | None = None
        threading.Thread(target=self._watch, name="hora-p2p-watch", daemon=True).start()

    # -- user threads -----------------------------------------------------------------------
    def send(self, peer: int, ps_id: int, tag: int, view: memoryview, dtype: str) -> Handle:
        """Send ``view`` (bytes of ``dtype``) to global rank ``peer``; the handle completes
        when the peer has taken it."""
        handle = Handle()
        seq = next(self._seq)
        head = _HEAD.pack(seq, ps_id, tag, view.nbytes, dtype.encode()[:16])
        with self._lock:
            error = self._error_with(peer)
            if error is None:
                self._sends[seq] = _Send(seq, peer, view, handle, tag, time.monotonic())
                link = self._link(peer)
        if error is not None:
            handle.set_error(error)
            return handle
        link.send(head, view)
        return handle

    def recv(self, peer: int | None, ps_id: int, tag: int, view: memoryview, dtype: str,
             peers: tuple[int, ...] = ()) -> Handle:  # fmt: skip
        """Receive the next message from global rank ``peer`` with ``tag`` into ``view``; with
        ``peer`` None, from whichever of ``peers`` (the set's other ranks) sent first. The
        handle gives the sender's global rank."""
        handle = Handle()
        key = (ANY if peer is None else peer, ps_id, tag)
        recv = _Recv(key, view, dtype, handle, since=time.monotonic())
        with self._lock:
            error = self._closed if peer is None else self._error_with(peer)
            found = None
            if error is None:
                found, sender = self._kept(key, peers)
                if found is None:
                    recv.order = next(self._order)
                    self._posted.setdefault(key, deque()).append(recv)
                if peer is not None:
                    link = self._link(peer)
                else:  # every sender must be able to reach this rank
                    for p in peers:
                        if p not in self._links:
                            self._links[p] = _Link(self, p, patient=True)
                    if found is not None:
                        link = self._links[sender]
        if error is not None:
            handle.set_error(error)
        elif found is not None:
            self._deliver(link, recv, found.seq, found.dtype, found.data)
        return handle

    def _kept(self, key: Key, peers: tuple[int, ...]) -> tuple[_Arrived | None, int]:
        """The kept message a receive of ``key`` takes (and its sender), removed; the lock is
        held."""
        if key[0] != ANY:
            waiting = self._arrived.get(key)
            return (waiting.popleft(), key[0]) if waiting else (None, key[0])
        _, ps_id, tag = key
        queues = [(q[0].order, p, q) for p in peers if (q := self._arrived.get((p, ps_id, tag)))]
        if not queues:
            return None, ANY
        _, sender, queue = min(queues)
        return queue.popleft(), sender

    # -- reader threads ---------------------------------------------------------------------
    def arrive(self, link: _Link, key: Key, seq: int, dtype: str, nbytes: int,
               data: Pair) -> None:  # fmt: skip
        """A message's header came in: read its payload into the receive waiting for it, or
        keep it until one is posted."""
        with self._lock:
            recv = self._take(key)
        if recv is not None and (recv.dtype, recv.view.nbytes) == (dtype, nbytes):
            try:
                data.recv_into(recv.view)
            except BaseException:
                with self._lock:  # back in line: the reader fails it with the cause
                    self._posted.setdefault(key, deque()).appendleft(recv)
                raise
            link.answer(seq, "")
            recv.handle.set_result(link.peer)
            return
        payload = bytearray(nbytes)
        data.recv_into(payload)
        if recv is None:
            with self._lock:
                recv = self._take(key)  # posted while the payload came in
                if recv is None:
                    arrived = _Arrived(seq, dtype, payload, next(self._order))
                    self._arrived.setdefault(key, deque()).append(arrived)
                    return
        self._deliver(link, recv, seq, dtype, payload)

    def answered(self, seq: int, error: str) -> None:
        with self._lock:
            send = self._sends.pop(seq, None)
        if send is None:
            return
        if error:
            send.handle.set_error(MismatchError(error))
        else:
            send.handle.set_result(None)

    def broken(self, peer: int, error: BaseException) -> None:
        """The connections to ``peer`` failed: fail every message with it, naming the cause
        the engine gives if it stops meanwhile (a rank killed), else the transport's."""
        deadline = time.monotonic() + CAUSE_WAIT_S
        while self._stopped() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        cause = self._stopped()
        if cause is not None:
            error = shut_down_error(cause, f"a point-to-point message with rank {peer}")
        elif not isinstance(error, TransportError):
            error = TransportError(f"point-to-point connection to rank {peer} failed: {error}")
        with self._lock:
            link = self._links.get(peer)
            if link is not None and link.error is None:
                link.error = error
        self._fail(lambda p: p == peer, error)
        if link is not None:
            link.close()

    # -- internals --------------------------------------------------------------------------
    def transport(self) -> Any:
        with self._lock:
            if self._closed is not None:
                raise self._closed
            if self._transport is None:
                self._transport = self._connect()
            return self._transport

    def _link(self, peer: int) -> _Link:
        link = self._links.get(peer)
        if link is None:
            link = self._links[peer] = _Link(self, peer)
        return link

    def closed(self) -> bool:
        return self._closed is not None

    def _error_with(self, peer: int) -> BaseException | None:
        if self._closed is not None:
            return self._closed
        link = self._links.get(peer)
        return link.error if link is not None else None

    def _take(self, key: Key) -> _Recv | None:
        """The posted receive a message of ``key`` goes to (removed): one naming its sender or
        one from any sender, whichever was posted first. The lock is held."""
        queues = [q for k in (key, (ANY, key[1], key[2])) if (q := self._posted.get(k))]
        return min(queues, key=lambda q: q[0].order).popleft() if queues else None

    def _deliver(self, link: _Link, recv: _Recv, seq: int, dtype: str, data: bytearray) -> None:
        if (recv.dtype, recv.view.nbytes) == (dtype, len(data)):
            recv.view[:] = data
            link.answer(seq, "")
            recv.handle.set_result(link.peer)
            return
        peer, tag = link.peer, recv.key[2]
        text = mismatch(self.rank, peer, tag, (recv.dtype, recv.view.nbytes), (dtype, len(data)))
        link.answer(seq, text)
        recv.handle.set_error(MismatchError(text))

    def _fail(self, which: Callable[[int], bool], error: BaseException) -> None:
        with self._lock:
            sends = [s for s in self._sends.values() if which(s.peer)]
            for s in sends:
                del self._sends[s.seq]
            recvs: list[_Recv] = []
            for key in [k for k in self._posted if which(k[0])]:
                recvs += self._posted.pop(key)
        for h in [s.handle for s in sends] + [r.handle for r in recvs]:
            h.set_error(error)

    def _watch(self) -> None:
        while self._closed is None:
            cause = self._stopped()
            if cause is not None:
                self.close(cause)
                return
            if self._report_after > 0:
                self._report_long_waits()
            time.sleep(WATCH_S)

    def _report_long_waits(self) -> None:
        """Warn once about each send and receive pending for ``report_after`` seconds."""
        now = time.monotonic()
        late = now - self._report_after
        lines = []
        with self._lock:
            for queue in self._posted.values():
                for r in queue:
                    if not r.reported and r.since <= late:
                        r.reported = True
                        peer, _, tag = r.key
                        who = "any rank of its process set" if peer == ANY else f"rank {peer}"
                        lines.append(f"rank {self.rank} has waited {now - r.since:.0f} s to "
                                     f"receive a message from {who} (tag {tag}); none has "
                                     "come")  # fmt: skip
            for m in self._sends.values():
                if not m.reported and m.since <= late:
                    m.reported = True
                    lines.append(f"rank {self.rank}'s message to rank {m.peer} (tag {m.tag}) has "
                                 f"waited {now - m.since:.0f} s for rank {m.peer} to receive "
                                 "it")  # fmt: skip
        for line in lines:
            log.warning("point-to-point: %s. A send or receive that its peer never makes waits "
                        "forever: check both ranks' calls, their tags and groups", line)

    def close(self, cause: str = "") -> None:
        """Fail every pending message with the engine's shutdown error and close the
        connections. Idempotent, any thread."""
        with self._lock:
            if self._closed is not None:
                return
            self._closed = error = shut_down_error(cause, "a point-to-point message")
            links, transport = list(self._links.values()), self._transport
        self._fail(lambda p: True, error)
        for link in links:
            link.close()
        if transport is not None:
            transport.close()


def mailbox() -> Mailbox:
    """The running hora's mailbox, made on first use (its connections on the first message)."""
    from hora.core.runtime import runtime

    rt = runtime()
    with _lock:
        box = rt.p2p
        if box is None:
            s = rt.settings
            report = 0.0 if s.stall_check_disable else s.stall_check_time_seconds
            box = rt.p2p = Mailbox(rt.identity.rank, partial_transport(rt), _engine_state(rt),
                                   report)  # fmt: skip
        return box  # type: ignore[no-any-return]


_lock = threading.Lock()


def _engine_state(rt: Any) -> Callable[[], str | None]:
    engine = rt.engine

    def stopped() -> str | None:
        return None if engine.running else (engine.cause or "")

    return stopped


def partial_transport(rt: Any) -> Callable[[], Any]:
    """How the mailbox of ``rt`` makes its TCP transport: the job's store, secret and network
    settings, its own prefix; its waits for a peer end when the engine does."""

    def connect() -> Any:
        from hora.transport.tcp import TcpTransport

        ident, settings = rt.identity, rt.settings
        if rt.store is None or ident.secret is None:
            raise ValueError("point-to-point messages need a job of more than one rank")
        tcp = TcpTransport(ident.rank, ident.size, ident.secret, rt.store,
                           prefix=f"{rt.prefix}/p2p", iface=settings.gloo_iface,
                           connect_timeout=settings.gloo_timeout_seconds,
                           handshake_timeout=settings.handshake_timeout_seconds,
                           listen_any=settings.listen_any)  # fmt: skip
        stopped = _engine_state(rt)
        tcp.give_up_when(lambda: None if stopped() is None else "hora has shut down")
        return tcp

    return connect
