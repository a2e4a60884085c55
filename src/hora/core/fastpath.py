"""The direct steady state: members agree on cached work among themselves, without rank 0.

In steady training every step repeats tensors the response cache already knows, and every
member holds the same cache. Once the coordinator has answered a response list made only of
cached tensors with nothing else outstanding, it appends a ``DIRECT`` response (carrying its
fusion threshold) and every member, at that same point of the set's order, enters *direct
mode*. From then on a member with work does *rounds* instead of sending requests:

1. it sends every other member a header: the cache ids it has ready, in submission order,
   the flag ``BARRIER`` when it waits in a barrier, or the flag ``OTHER`` when it holds
   anything a round cannot settle (a cache miss, a join, a request already sent to the
   coordinator);
2. it receives every other member's header (the same headers reach every member);
3. every member decides alike: ``OTHER`` anywhere, or nothing that every member has ready,
   ends direct mode (each member then sends what it holds to the coordinator, which orders,
   validates and reports stalls as usual); otherwise the ids every member has ready run, in
   the lowest member's order, fused as the coordinator fuses, and the rest wait for the next
   round. When every header carries ``BARRIER``, the barrier completes after them: each
   member has heard from every other one since all of them entered it, which is all a
   barrier asks, so it costs no message of its own and direct mode goes on (training loops
   that time their steps between barriers stay off rank 0).

A member with work left is always in a round, and a member that has none takes part in the
next one as soon as it has some, so every member takes part in every round, in order, and the
headers travel on the set's data connections between two collectives, never inside one. In a
set of two members the headers may carry the allreduces' data too (:mod:`hora.core.handover`).

Shutdown: a round whose headers were all sent is agreed, and runs on every member, even when
rank 0 shut down meanwhile (its shutdown message may reach a member before a peer's header
does). So a member in a round waits for every header, shutdown or not, and a member that
shuts down outside a round answers the next round with a ``STOP`` header (:meth:`_withdraw`):
a round with a ``STOP`` header runs nowhere, and its ops fail with the shutdown error. Every
member shuts down soon after rank 0 does, so no round waits for long.
Mismatches cannot slip through: a request that differs from its cached spec is a cache miss,
which ends direct mode, and the coordinator reports it naming both sides.

A caller that waits for its op anyway (a blocking form) may run its round itself when the
engine is idle (:meth:`DirectRounds._run_inline`): no hand-off to the engine thread and back.

:class:`DirectMode` is the pure part (the decision, plans); :class:`DirectRounds` is the
engine's side of it (holding work, rounds, the wait for the others' headers), mixed into
:class:`~hora.core.engine.Engine`. Run by whichever thread holds the engine's turn (the engine
thread, or such a caller); not thread-safe otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from hora.backends.base import SetComm
from hora.core.controller import Coordinator, fuse
from hora.core.executor import Executor, TensorEntry
from hora.core.express import ExpressLane
from hora.core.handover import (
    HandOver,
    Header,
    Lent,
    Member,
    encode_header,
    whole_groups,
)
from hora.core.messages import CACHEABLE, OpType, Response, TensorSpec, table_key
from hora.core.response_cache import ResponseCache
from hora.core.swap import MAILBOX_MIN_MEMBERS, HeaderSwap
from hora.errors import TransportError
from hora.settings import Settings
from hora.transport.base import Pair
from hora.transport.shm.arena import STORES_IN_ORDER
from hora.transport.shm.waiting import yield_while_waiting

OTHER = 1  # the header's flag: this member holds work a round cannot settle
STOP = 16  # the header's flag: this member shuts down; the round it answers does not run
BARRIER = 32  # the header's flag: this member waits in a barrier
# (DATA, SHARED and SLOT1, the flags of a two-member round that hands over its data, are
# hora.core.handover's)


class DirectMode:
    """One member's direct-mode state for its process set."""

    def __init__(self) -> None:
        self.active = False
        self.fusion_threshold = 0
        self._plans: dict[tuple[int, ...], list[Response]] = {}

    def enter(self, fusion_threshold: int) -> None:
        self.active = True
        self.fusion_threshold = fusion_threshold
        self._plans.clear()

    def leave(self) -> None:
        self.active = False
        self._plans.clear()

    def decide(self, headers: Sequence[Header]) -> list[int] | None:
        """The ids to run this round, in order, from every member's header (by set rank);
        None when direct mode ends. When every member waits in a barrier (which the round
        then completes), the list may be empty."""
        if any(h[0] & OTHER for h in headers):
            return None
        first = headers[0][1]
        if len(headers) == 2 and headers[1][1] == first:
            chosen = first  # the steady state: both members hold the same work
        else:
            common = set(first)
            for h in headers[1:]:
                common.intersection_update(h[1])
            chosen = [i for i in first if i in common]
        if chosen or all(h[0] & BARRIER for h in headers):
            return chosen
        return None

    def plan(self, ids: list[int], cache: ResponseCache) -> list[Response] | None:
        """The responses that run ``ids`` (fused, whole groups only), kept per id list; None
        if an id is not cached (cannot happen while members agree) or nothing is complete."""
        key = tuple(ids)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        specs: list[TensorSpec] = []
        for cid in ids:
            spec = cache.get(cid)
            if spec is None:
                return None
            specs.append(spec)
        specs = whole_groups(specs)
        if not specs:
            return None
        specs.sort(key=_by_priority)
        plan = fuse(specs, self.fusion_threshold)
        self._plans[key] = plan
        return plan


def _by_priority(spec: TensorSpec) -> int:
    return -spec.request.priority


class MemberState:
    """This rank's view of one process set it belongs to."""

    def __init__(self, comm: SetComm, cache_capacity: int) -> None:
        self.comm = comm
        self.cache = ResponseCache(cache_capacity)
        self.epoch = 0
        self.table: dict[str, TensorEntry] = {}
        self.joined = False
        # direct mode: the cache ids of the tensors waiting for a round,
        # by table key in submission order; ``other``: something waits that a round cannot
        # settle; ``barrier``: a barrier waits; ``sent``: table keys already asked of the
        # coordinator
        self.direct = DirectMode()
        self.ready: dict[str, int] = {}
        self.other = False
        self.barrier = False
        # the names of the tensor an express round (hora.core.express) holds outside the table
        self.expressing: tuple[str, ...] = ()
        # the hand-over (hora.core.handover): the exchange slot a fresh offer fills unless the
        # other member is done with the last one; inputs in a slot the other has not taken
        # yet; how many offers in a slot this member made, and how many it received
        self.slot = 0
        self.lent: Lent | None = None
        self.offered = self.seen = 0
        self.sent: set[str] = set()
        # what a round waits on, made at the first round: the other members' data connections
        # by descriptor, and a poll object over them, the control connections and the wake-up
        self.peers: dict[int, tuple[int, Pair]] | None = None
        self.poller: Any = None
        self.ctrl: dict[int, int] = {}

    def leave_direct(self) -> None:
        """Direct mode ends for this member: nothing is held for a round any more."""
        self.direct.leave()
        self.sent, self.ready, self.other, self.barrier = set(), {}, False, False
        self.lent = None

    def take(self, entry: TensorEntry) -> int | None:
        """Put a submitted entry in the table; its cache id, or None (a miss, or an op that is
        never cached: barrier, join, process-set changes)."""
        req = entry.spec_request
        if req.op in CACHEABLE:  # the steady state: one table entry, one cache lookup
            self.table[req.match] = entry
            return self.cache.hit(req, self.comm.rank)
        if req.op == OpType.JOIN:
            self.joined = True
        self.table[table_key(req)] = entry
        return None


class DirectRounds(HeaderSwap, ExpressLane, HandOver):
    """The engine's side of direct mode (a mixin of :class:`~hora.core.engine.Engine`, whose
    state it uses as declared here)."""

    rank: int
    settings: Settings
    timeline: Any
    coordinator: Coordinator | None
    members: dict[int, MemberState]
    stats: dict[str, int]
    _ctrl: dict[int, Pair]
    _gone: set[int]
    _queue: list[tuple[int, list[TensorEntry]]]
    _stopped: threading.Event
    _stop_requested: bool
    _closing: bool
    _wake_r: Any
    _turn: threading.Lock
    _inline_runs: int
    spin_s: float  # how long a caller running its own round polls before it sleeps (0: never)
    spin_yield: bool  # whether it gives its core away between polls (ranks outnumber cores)
    _inline_error: BaseException | None
    _forgotten: list[int]
    executor: Executor

    # provided by the engine
    def _wake(self) -> None: ...
    def _woken(self) -> None: ...
    def _run(self, ms: MemberState, responses: list[Response]) -> None: ...
    def _begin_shutdown(self) -> None: ...
    def _send_requests(self, ps_id: int, full: list[Any], hits: list[int]) -> None: ...
    def _read_control(self, peer: int, forget: Callable[[], None]) -> None: ...
    def _peer_gone(self, peer: int) -> TransportError:
        raise NotImplementedError

    def _run_inline(self, ps_id: int, entries: list[TensorEntry]) -> bool:
        """Run ``entries`` in this (the caller's) thread; False if the engine must (the set
        is not in direct mode, or the engine is busy or stopping)."""
        ms = self.members.get(ps_id)
        if ms is None or not ms.direct.active or self._queue or not self._turn.acquire(False):
            return False
        try:
            if (not ms.direct.active or self._queue or self._stopped.is_set()
                    or self._stop_requested or self._closing or self._inline_error):
                return False
            self._inline_runs += 1
            self._hold(ms, entries)
            self._caller_rounds(ms, [e.spec_request.match for e in entries])
        finally:
            self._turn.release()
        if ms.table or self._inline_error is not None or self._stop_requested or self._closing:
            self._wake()  # the engine thread goes on with what is left
        return True

    def _caller_rounds(self, ms: MemberState, keys: list[str],
                       first: Callable[[], None] | None = None) -> None:  # fmt: skip
        """A caller's rounds (holding the engine's turn) until the entries of ``keys`` are
        done, direct mode ends or the engine stops; ``first``: a round already under way, to
        finish first (the express lane's, hora.core.express). An error is the engine thread's
        to raise: it fails everything, as its own."""
        table = ms.table
        self._caller_turn = True
        if self.spin_yield:  # the backend's receives in this thread poll, yielding
            yield_while_waiting(self.spin_s)
        try:
            if first is not None:
                first()
            one = keys[0] if len(keys) == 1 else None  # the blocking call's one tensor
            while ms.direct.active and (one in table if one is not None
                                        else any(k in table for k in keys)):
                if self._closing or self._stop_requested:
                    break
                self._round(ms)
        except BaseException as e:
            self._inline_error = e
        finally:
            self._caller_turn = False
            if self.spin_yield:
                yield_while_waiting(0.0)

    def _hold(self, ms: MemberState, entries: list[TensorEntry]) -> None:
        """Direct mode's drain: entries wait in the table for the next round."""
        tl = self.timeline
        for e in entries:
            cid = ms.take(e)
            req = e.spec_request
            if req.op == OpType.BARRIER:
                ms.barrier = True
            elif cid is None:
                ms.other = True
            else:
                ms.ready[req.match] = cid
            if tl is not None:
                tl.negotiate_start(req.name, req.op.name)

    def _enter_direct(self, ms: MemberState, threshold: int) -> None:
        ms.direct.enter(threshold)
        if ms.comm.size >= MAILBOX_MIN_MEMBERS and STORES_IN_ORDER:
            # the rounds' headers go through the set's mailboxes: its arena opens now if no
            # allreduce large enough for it opened it before (every member enters direct mode
            # at the same point of the set's order, as a collective runs)
            self.executor.open_mailboxes(ms.comm)
        ms.sent = set(ms.table)  # asked of the coordinator before: a round cannot settle them
        ms.other = bool(ms.sent)
        ms.ready = {}
        ms.barrier = False
        ms.lent = None

    def _leave_direct(self, ms: MemberState) -> None:
        """Every member ends direct mode at the same round: what waits goes to the
        coordinator, which orders it, validates it and reports stalls."""
        self.stats["direct_exits"] += 1
        full: list[Any] = []
        hits: list[int] = []
        for key, e in ms.table.items():
            if key in ms.sent:
                continue
            cid = ms.ready.get(key)  # the cache is as it was when the entry was held
            if cid is None:
                full.append(e.spec_request.to_wire())
            else:
                hits.append(cid)
        ms.leave_direct()
        if full or hits:
            self._send_requests(ms.comm.process_set_id, full, hits)

    def _round(self, ms: MemberState) -> None:
        """One round: headers to and from every other member, then what all have ready."""
        if self._lane(ms):  # the steady state of one allreduce
            return
        self.stats["direct_rounds"] += 1
        ids = list(ms.ready.values())
        flags = OTHER if ms.other else (BARRIER if ms.barrier else 0)
        offer, data = None, ()
        if not flags and ids and ms.comm.size > 1:  # the data may come along
            offer, more, data = self._offer_data(ms, ids)
            flags |= more
        headers = self._exchange(ms, encode_header(ids, flags, *data), (flags, ids, b""))
        self._settle(ms, ids, offer, headers)

    def _settle(self, ms: MemberState, ids: list[int], offer: Any, headers: list[Header]) -> None:
        """Every member's header of a round is in (this member's held ``ids`` and ``offer``):
        run what they agree on, or end direct mode."""
        if any(h[0] & STOP for h in headers):  # a member shut down first: nothing runs
            ms.leave_direct()
            return
        if (offer is not None or ms.comm.size == 2) and self._handed_over(ms, ids, offer,
                                                                          headers):
            return
        chosen = ms.direct.decide(headers)
        plan = ms.direct.plan(chosen, ms.cache) if chosen else None
        barrier = chosen is not None and all(h[0] & BARRIER for h in headers)
        if plan is None and not barrier:
            self._leave_direct(ms)
            return
        if plan is not None:
            ms.lent = None  # the backend's fusion buffer and staging share the slots' arena
            ready = ms.ready
            self._touch(ms, [ready.pop(s.request.match) for r in plan for s in r.specs])
            self._run(ms, plan)
        if barrier:
            ms.barrier = False
            self._run(ms, [Response(OpType.BARRIER)])

    def _touch(self, ms: Member, ids: list[int]) -> None:
        """What decoding these ids in a response list does to the caches (LRU order)."""
        mirror = None
        if self.coordinator is not None:
            mirror = self.coordinator.sets[ms.comm.process_set_id].mirror
        for cid in ids:
            ms.cache.touch(cid)
            if mirror is not None:
                mirror.touch(cid)

    def _withdraw(self, ms: MemberState) -> None:
        """This rank shuts down outside a round: it answers the next round with ``STOP``
        (members that wait in it give up) and leaves direct mode; its held work fails."""
        comm = ms.comm
        pairs = [p for _, p in ms.peers.values()] if ms.peers is not None else None
        if pairs is None:  # no round yet: a peer waiting in one needs this end of its pair
            pairs = []
            for p in range(comm.size):
                if p != comm.rank:
                    try:
                        pairs.append(comm.pair(p))
                    except TransportError:
                        continue  # a peer that is gone waits for nothing
        stop = encode_header([], STOP)
        boxes = self._mailboxes(ms)
        if boxes is not None:  # the others read the next round's headers there
            boxes.commit(boxes.begin((stop,))[0])
            pairs = []
        for pair in pairs:
            try:
                pair.send_msg(stop)
            except TransportError:
                continue  # a peer that is gone waits for nothing
        ms.leave_direct()
