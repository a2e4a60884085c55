"""A direct-mode round's headers: this member's to every other, and theirs.

Every member of a set sends every other its header for a round and waits for theirs
(:mod:`hora.core.fastpath`). In a set with a shared arena (a pair's too) the
headers go through its mailboxes (:mod:`hora.transport.shm.mailbox`): each written once and
polled for; otherwise, and for a header too large for a mailbox, on every pair. The wait
serves what comes meanwhile: control messages, the engine's wake-ups, a peer gone, a stall
warned about.

:class:`HeaderSwap` is a mixin of :class:`~hora.core.fastpath.DirectRounds`, whose state
(its member states, :class:`~hora.core.fastpath.MemberState`) it uses as declared here.
"""

from __future__ import annotations

import os
import select
import time
from array import array
from collections.abc import Callable, Sequence
from functools import partial
from itertools import chain
from typing import Any

from hora.backends.base import SetComm
from hora.core.executor import Executor
from hora.core.handover import DATA, HEAD, SHARED, Header
from hora.core.stall import round_stall
from hora.errors import TransportError
from hora.settings import Settings
from hora.transport.base import Pair
from hora.transport.shm.arena import STORES_IN_ORDER
from hora.transport.shm.mailbox import Mailboxes
from hora.transport.shm.waiting import peer_closed, sleep_nap

# a set of at least this many members with a shared arena posts its rounds' headers in the
# arena's mailboxes (one write each, polled for) rather than on every pair (a system call per
# member on each side, and a wake-up); the member polling naps up to _NAP_MAX seconds between
# polls (hora.transport.shm.waiting.sleep_nap)
MAILBOX_MIN_MEMBERS = 2
MAILBOX_LOOKS = 16  # a caller's looks at the mailboxes before its round's poller (_mailbox_wait)
_NAP_MAX = 500e-6


def decode_header(payload: bytes, peer: int) -> Header:
    """(flags, ids, data) of a peer's header; ValueError naming ``peer`` if malformed."""
    if len(payload) < HEAD.size:
        raise ValueError(f"malformed direct-mode header from rank {peer}: {len(payload)} bytes")
    flags, count = HEAD.unpack_from(payload)
    end = HEAD.size + 4 * count
    if len(payload) < end or (len(payload) > end and not flags & (DATA | SHARED)):
        raise ValueError(
            f"malformed direct-mode header from rank {peer}: {count} ids in "
            f"{len(payload) - HEAD.size} bytes"
        )
    ids = array("I")
    view = memoryview(payload)
    ids.frombytes(view[HEAD.size : end])
    return flags, ids.tolist(), view[end:]  # the data, not copied


class HeaderSwap:
    """The engine's side of a round's headers (see the module)."""

    settings: Settings
    executor: Executor
    _wake_r: Any
    _ctrl: dict[int, Pair]
    _gone: set[int]
    _forgotten: list[int]
    _stop_requested: bool
    _caller_turn: bool
    spin_s: float  # how long a caller running its own round polls before it sleeps (0: never)
    spin_yield: bool  # whether it gives its core away between polls (ranks outnumber cores)

    # provided by the engine
    def _woken(self) -> None: ...
    def _begin_shutdown(self) -> None: ...
    def _read_control(self, peer: int, forget: Callable[[], None]) -> None: ...
    def _peer_gone(self, peer: int) -> TransportError:
        raise NotImplementedError

    def _exchange(self, ms: Any, mine: bytes, own: Header) -> list[Header]:
        """Send this member's header (``mine``; ``own``, decoded) to the others and wait for
        theirs (:meth:`_swap`): every member's, decoded, in member order."""
        return self._decoded(ms, self._swap(ms, (mine,)), own)

    def _decoded(self, ms: Any, payloads: list[Any], own: Header) -> list[Header]:
        """The headers of a round (:meth:`_swap`'s ``payloads``; ``own``, this member's),
        decoded from copies."""
        ranks = ms.comm.ranks
        return [own if got is None else decode_header(bytes(got), ranks[p])
                for p, got in enumerate(payloads)]

    def _swap(self, ms: Any, mine: Sequence[Any]) -> list[Any]:
        """Send this member's header (the byte-like parts ``mine``, written one after the
        other) to the others and wait for theirs, serving control messages and wake-ups
        meanwhile: every other member's header as it came, in member order (None at this
        member's place). A shutdown does not end the wait: every other member sends its
        header for this round, or ``STOP`` once it shuts down. In a set with a shared arena
        the headers go through its mailboxes
        (:mod:`hora.transport.shm.mailbox`): each written once, and polled for, and given here
        as a view of the mailbox, which holds it until this member posts its next header
        (:meth:`Mailboxes.take`)."""
        comm = ms.comm
        peers = self._peers(ms)
        boxes = self._mailboxes(ms)
        count, fits = boxes.begin(mine) if boxes is not None else (0, False)
        if not fits:
            whole = mine[0] if len(mine) == 1 else b"".join(mine)
            for p, pair in peers.values():
                try:
                    pair.send_msg(whole)
                except TransportError as e:
                    raise self._peer_gone(comm.ranks[p]) from e
        if boxes is not None:
            boxes.commit(count)
        return self._gather(ms, boxes, count)

    def _peers(self, ms: Any) -> dict[int, tuple[int, Pair]]:
        """The other members' data connections, by file descriptor: (member, pair)."""
        peers = ms.peers
        if peers is None:
            comm = ms.comm
            peers = ms.peers = {}
            for p in range(comm.size):
                if p != comm.rank:
                    pair = comm.pair(p)
                    peers[pair.fileno()] = (p, pair)
        return peers

    def _gather(self, ms: Any, boxes: Mailboxes | None, count: int,
                looked: bool = False) -> list[Any]:  # fmt: skip
        """The rest of :meth:`_swap` once this member's header is out (as post ``count`` of
        ``boxes``, where the set has them): every other member's header, as :meth:`_swap`
        gives them. ``looked``: the caller has looked at the mailboxes as long as
        :meth:`_mailbox_wait` would."""
        comm = ms.comm
        payloads: list[Any] = [None] * comm.size
        peers = self._peers(ms)
        if not peers:
            return payloads
        waiting = dict(peers)
        if boxes is not None:  # the headers posted already, or soon, are taken without the poller
            self._mailbox_wait(boxes, count, waiting, payloads, comm, looked)
            if not waiting:
                return payloads
        poller = self._round_poller(ms)
        for fd in peers:
            if fd not in waiting:
                poller.unregister(fd)  # registered again once the round is in
        since = time.monotonic()
        warned: float | None = None
        wake, ctrl = self._wake_r.fileno(), ms.ctrl
        # a caller that runs its own round polls without sleeping at first (yielding its core
        # between polls where ranks outnumber cores): a header that comes soon is then read at
        # once, without a wake-up's latency. Polling mailboxes, a member then naps between
        # polls (nothing wakes it when a header is posted).
        spin = time.perf_counter() + self.spin_s if self._caller_turn and self.spin_s else 0.0
        nap = 0.0
        try:
            while waiting:
                if boxes is not None:
                    for fd, (p, pair) in list(waiting.items()):
                        if boxes.posted(p, count):
                            del waiting[fd]
                            poller.unregister(fd)
                            payloads[p] = self._posted(boxes, count, p, pair, comm)
                    if not waiting:
                        break
                events = poller.poll(0 if spin or boxes is not None else 500.0)
                if not events and spin:
                    if time.perf_counter() > spin:
                        spin = 0.0
                    elif self.spin_yield:
                        os.sched_yield()
                    continue
                if not events and boxes is not None:
                    nap = sleep_nap(nap, _NAP_MAX)
                for fd, _ in events:
                    if fd in waiting:
                        p, pair = waiting[fd]
                        if boxes is not None and not peer_closed(fd):
                            continue  # a header too large for the mailbox, posted soon
                        del waiting[fd]
                        poller.unregister(fd)  # its next round's header may come first
                        try:
                            payloads[p] = pair.recv_msg()
                        except TransportError as e:
                            raise self._peer_gone(comm.ranks[p]) from e
                    elif fd == wake:  # new work or a shutdown: the loop takes the queue after
                        self._woken()
                    elif fd in ctrl:
                        self._read_control(ctrl[fd], partial(self._forget, ms, fd))
                if waiting and self._stop_requested:
                    self._begin_shutdown()  # rank 0 tells the others; the others, rank 0
                if waiting:
                    missing = [comm.ranks[p] for p, _ in waiting.values()]
                    held = chain((e.spec_request.name for e in ms.table.values()),
                                 ms.expressing)
                    warned = round_stall(self.settings, held, missing, since, warned)
        finally:
            for fd in peers:
                if fd not in waiting:
                    poller.register(fd, select.POLLIN)
        return payloads

    def _mailbox_wait(self, boxes: Mailboxes, count: int, waiting: dict[int, tuple[int, Pair]],
                      payloads: list[Any], comm: SetComm, looked: bool = False) -> None:
        """Take the headers posted for round ``count`` into ``payloads``, and those members out
        of ``waiting``. A caller running its own round looks :data:`MAILBOX_LOOKS` times before
        it goes on to the poller (yielding its core between looks where ranks outnumber cores):
        the poller's set-up and system calls cost about as much as the header a rank waits for,
        and where two ranks share a core each look after the first comes once the other rank
        yields its core. What the poller serves meanwhile (control messages, wake-ups, a peer
        gone) waits that long. ``looked``: the caller has looked so already (one look more)."""
        looks = MAILBOX_LOOKS if self._caller_turn and self.spin_s and not looked else 1
        while True:
            for fd, (p, pair) in list(waiting.items()):
                if boxes.posted(p, count):
                    del waiting[fd]
                    payloads[p] = self._posted(boxes, count, p, pair, comm)
            looks -= 1
            if not waiting or not looks:
                return
            if self.spin_yield:
                os.sched_yield()

    def _mailboxes(self, ms: Any) -> Mailboxes | None:
        """The mailboxes a round's headers go through in this set; None: on the pairs. The
        same answer on every member at every round: the set's arena opens inside a
        collective, or as the set enters direct mode (:meth:`_enter_direct`), between two
        rounds."""
        if ms.comm.size < MAILBOX_MIN_MEMBERS or not STORES_IN_ORDER:
            return None
        return self.executor.mailboxes(ms.comm)

    def _posted(self, boxes: Mailboxes, count: int, p: int, pair: Pair, comm: SetComm) -> Any:
        """Member ``p``'s header, posted in its mailbox (or, too large, on ``pair``)."""
        try:
            return boxes.take(p, count, pair)
        except TransportError as e:
            raise self._peer_gone(comm.ranks[p]) from e

    def _round_poller(self, ms: Any) -> Any:
        """The poll object a round waits on (made once per member): the other members' data
        connections, this rank's control connections and the engine's wake-up socket."""
        if ms.poller is None:
            poller = select.poll()
            for fd in ms.peers or ():
                poller.register(fd, select.POLLIN)
            poller.register(self._wake_r.fileno(), select.POLLIN)
            ms.ctrl = {}
            for peer, pair in self._ctrl.items():
                if peer not in self._gone:
                    ms.ctrl[pair.fileno()] = peer
                    poller.register(pair.fileno(), select.POLLIN)
            ms.poller = poller
        return ms.poller

    def _forget(self, ms: Any, fd: int) -> None:
        """A control connection closed during a round: no poll object watches it again."""
        ms.poller = None
        self._forgotten.append(fd)  # the loop's poll object: the engine thread's to change
