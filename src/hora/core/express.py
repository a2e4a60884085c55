"""The express lane: a blocking allreduce called again as before, run again at once.

A loop that calls one blocking allreduce over and over (a benchmark, a training step that
reduces one buffer) takes, in direct mode's steady state, the lane's round every time
(:meth:`hora.core.handover.HandOver._lane`): its caller builds an entry and a handle, the
engine holds the entry in its table, looks the request up in the response cache, and the lane
checks again that the one tensor held is a cached allreduce whose inputs the round's header
hands over as they lie (in the set's mailboxes, or on the pairs). Where ranks outnumber cores
every microsecond of that is paid twice, as the other rank on the core waits for it.

What the lane found holds again while nothing it rests on has changed: the same request
(the op surface submits one request object for a named array submitted as before), the same
cache entry, the same mailboxes (the same arena, or still none), and the member holding
nothing else, its engine idle. Then the call posts its header and reduces the others' inputs
where they lie, as the lane does, with the same bits, and nothing between:
:meth:`ExpressLane.express`.

Whatever the others' headers say besides the same tensor, the call becomes the entry it
would have been (the op surface makes it then), held as :meth:`_hold` holds it, and the round
goes on as the lane's would (:meth:`_settle`), then the caller's rounds as any caller's. An
error in the round is the caller's as in :meth:`_run_inline`: the entry fails with the
engine's shutdown error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hora.core.executor import Executor, InOrder, TensorEntry, in_order
from hora.core.handles import Handle
from hora.core.handover import DATA, Header, Offer, handed_alike
from hora.core.messages import Request, TensorSpec
from hora.dtypes import storage_dtype
from hora.transport.shm.mailbox import Lane, Mailboxes

# the entry and handle a call becomes when it leaves the express lane (made by the op surface)
Held = Callable[[], tuple[Handle, TensorEntry]]
EXPRESS_KEPT = 256  # the requests an engine remembers the lane's findings for (then anew)


@dataclass(frozen=True)
class Express:
    """What the lane took for one blocking allreduce the last time: ``req``, the request its
    caller submitted, is cache entry ``cid`` (``spec``) of member state ``ms``, handed over in
    headers beginning ``start`` through the mailboxes ``boxes`` (None: on the pairs)."""

    req: Request
    ps_id: int
    ms: Any  # hora.core.fastpath.MemberState
    cid: int
    spec: TensorSpec
    start: bytes
    boxes: Mailboxes | None
    laid: tuple[Lane, InOrder] | None = None  # its posts and reduction, made once (mailboxes)
    names: tuple[str, ...] = ()  # what the stall inspector names while it runs (MemberState)


class ExpressLane:
    """The engine's side of the express lane (a mixin of
    :class:`~hora.core.fastpath.DirectRounds`, whose state it uses as declared here)."""

    executor: Executor
    coordinator: Any  # hora.core.controller.Coordinator on rank 0, else None
    stats: dict[str, int]
    timeline: Any
    members: dict[int, Any]
    _queue: list[Any]
    _stopped: threading.Event
    _stop_requested: bool
    _closing: bool
    _turn: threading.Lock
    _inline_runs: int
    _inline_error: BaseException | None
    _caller_turn: bool
    spin_s: float
    spin_yield: bool
    _expresses: dict[int, Express] | None = None  # by id(req), at most EXPRESS_KEPT

    # provided by DirectRounds and the engine
    def _wake(self) -> None: ...
    def _mailboxes(self, ms: Any) -> Mailboxes | None: ...
    def _swap(self, ms: Any, mine: Any) -> list[Any]:
        raise NotImplementedError
    def _gather(self, ms: Any, boxes: Mailboxes | None, count: int,
                looked: bool = False) -> list[Any]:  # fmt: skip
        raise NotImplementedError
    def _decoded(self, ms: Any, payloads: list[Any], own: Header) -> list[Header]:
        raise NotImplementedError
    def _settle(self, ms: Any, ids: list[int], offer: Offer | None,
                headers: list[Header]) -> None: ...  # fmt: skip
    def _touch(self, ms: Any, ids: list[int]) -> None: ...
    def _caller_rounds(self, ms: Any, keys: list[str],
                       first: Callable[[], None] | None = None) -> None: ...  # fmt: skip

    def _remember(self, ms: Any, entry: TensorEntry, cid: int, spec: TensorSpec,
                  start: bytes) -> None:  # fmt: skip
        """The lane handed ``entry``'s inputs over in the headers that begin ``start``, as
        they lie: its caller's next call of it may take the express lane."""
        memos = self._expresses
        if memos is None or len(memos) >= EXPRESS_KEPT:
            memos = self._expresses = {}
        req = entry.spec_request
        boxes, laid = self._mailboxes(ms), None
        if boxes is not None and req.nbytes:  # a set on one host with its arena open
            lane = boxes.lane(start, req.nbytes, storage_dtype(req.dtype))
            laid = None if lane is None else (lane, in_order(req, ms.comm.size))
        memos[id(req)] = Express(req, ms.comm.process_set_id, ms, cid, spec, start, boxes, laid,
                                 (req.name,))  # fmt: skip

    def _memo(self, req: Request) -> Express | None:
        memos = self._expresses
        memo = memos.get(id(req)) if memos else None
        return memo if memo is not None and memo.req is req else None

    def expresses(self, req: Request) -> bool:
        """Whether the lane took ``req`` the express lane's way last (a call of it may then
        try :meth:`express`)."""
        return self._memo(req) is not None

    def express(self, ps_id: int, req: Request, array: np.ndarray, output: np.ndarray | None,
                held: Held) -> Any:  # fmt: skip
        """Run blocking allreduce ``req`` of set ``ps_id`` over ``array`` (the storage view,
        into ``output``, or a new array) in this thread, as the lane did last: its result;
        or the handle to wait on where the call left the express lane after its header was
        posted (``held`` makes it); or None, with nothing done, where the lane's findings may
        no longer hold (the caller then submits it as usual)."""
        memos = self._expresses  # self._memo(req), without a call: every call of the lane asks
        memo = memos.get(id(req)) if memos else None
        if memo is None or memo.req is not req or memo.ps_id != ps_id or self._queue:
            return None
        ms = memo.ms
        if not self._turn.acquire(False):  # the engine thread, or another caller, is in a round
            return None
        try:
            if not self._holds(memo):
                return None
            self._inline_runs += 1
            return self._express_round(memo, array, output, held)
        finally:
            self._turn.release()
            if ms.table or self._inline_error is not None or self._stop_requested or self._closing:
                self._wake()  # the engine thread goes on with what is left

    def _holds(self, memo: Express) -> bool:
        """Whether the lane's findings for ``memo`` hold now (holding the engine's turn): the
        lane's own conditions, for a member that holds nothing else."""
        if self.members.get(memo.ps_id) != memo.ms:  # the set was removed (made again)
            return False
        ms = memo.ms
        return (ms.direct.active and not ms.table
                and not ms.ready and not ms.other and not ms.barrier and ms.lent is None
                and self.timeline is None and not self._queue and not self._stopped.is_set()
                and not self._stop_requested and not self._closing
                and self._inline_error is None
                and ms.cache.get(memo.cid) is memo.spec
                # a set's mailboxes, once open, last as long as the set (its member state)
                and (memo.boxes is not None or self._mailboxes(ms) is None))  # fmt: skip

    def _express_round(self, memo: Express, array: np.ndarray, output: np.ndarray | None,
                       held: Held) -> Any:  # fmt: skip
        """The lane's round for ``memo`` (see :meth:`express`)."""
        ms, cid, start, laid = memo.ms, memo.cid, memo.start, memo.laid
        inputs = array.reshape(-1)
        self.stats["direct_rounds"] += 1
        self._caller_turn = True
        ms.expressing = memo.names  # for the stall inspector's message
        try:
            if laid is None:
                payloads = self._swap(ms, (start, inputs.view(np.uint8)))
                parts = handed_alike(payloads, start, inputs)
            else:  # the header posted, and the others' read, where the lane laid them out
                payloads, parts = self._laid_round(memo, laid[0], inputs)
        except BaseException as e:  # the engine thread fails the entry, as its own
            handle, entry = held()
            ms.table[memo.req.match] = entry
            self._inline_error = e
            return handle
        finally:
            self._caller_turn = False
            ms.expressing = ()
        if parts is None:  # some other header: the lane's round goes on as any other
            return self._leave(memo, inputs, payloads, held)
        if self.coordinator is None:
            ms.cache.touch(cid)  # what _touch does, but for the coordinator's mirror
        else:
            self._touch(ms, [cid])
        stats = self.stats
        stats["responses"] += 1
        stats["exchanged"] += 1
        stats["lane"] += 1
        stats["express"] += 1
        if laid is not None:
            return Executor.reduced_in_order(memo.spec, output, parts, laid[1])
        # never made over the inputs, which lie in the caller's array
        return self.executor.handed(memo.spec, output, output is array, parts, ms.comm.rank,
                                    True)

    def _laid_round(self, memo: Express, lane: Lane, inputs: np.ndarray) -> tuple[Any, Any]:
        """The round's headers through ``lane`` (:meth:`_swap`'s, in fewer steps): the others'
        headers (:meth:`_swap`'s payloads, None where not read as such) and every member's
        inputs where every other member's header is the lane's (else None)."""
        boxes, ms = memo.boxes, memo.ms
        assert boxes is not None
        # only the counts are looked at for as long as the round's poller would poll (control
        # messages and wake-ups wait as long): its set-up and system calls cost about as much
        # as the header a rank waits for, and where ranks outnumber cores the headers missing
        # come once the ranks that post them have a core, which yielding this one gives them
        count, theirs = boxes.lane_round(lane, inputs.view(np.uint8), self.spin_s,
                                         self.spin_yield)  # fmt: skip
        payloads = None
        if theirs is None:  # late, or some other header
            payloads = self._gather(ms, boxes, count, looked=True)
            theirs = boxes.lane_inputs(lane, count)
            if theirs is None:
                return payloads, None  # as they say
        parts = list(theirs)
        parts[ms.comm.rank] = inputs
        return payloads, parts

    def _leave(self, memo: Express, inputs: np.ndarray, payloads: list[Any],
               held: Held) -> Handle:  # fmt: skip
        """The call leaves the express lane with its header posted and the others' in
        (``payloads``): held as :meth:`_hold` holds an entry, its round settled as the lane
        settles one it does not finish, then the caller's rounds as any caller's."""
        ms, cid, key = memo.ms, memo.cid, memo.req.match
        self.stats["express_left"] += 1
        handle, entry = held()
        ms.table[key], ms.ready[key] = entry, cid
        ids = [cid]

        def settle() -> None:
            headers = self._decoded(ms, payloads, (DATA, ids, b""))
            self._settle(ms, ids, ([key], [memo.spec], inputs.copy(), False, 0, 0), headers)

        self._caller_rounds(ms, [key], settle)
        return handle
