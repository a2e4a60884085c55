"""The engine: one background thread per process that does all of hora's communication.

User threads hand it :class:`~hora.core.executor.TensorEntry` lists through :meth:`Engine.enqueue`
(thread-safe). The engine thread loops: it wakes at once when work is enqueued or a control
message arrives (an idle engine never makes a new op wait for a cycle), sends this rank's
requests to the coordinator (global rank 0; cache hits go as a bit vector), lets the coordinator
decide what is ready (on rank 0), and executes the response lists it receives, in order.

Failure contract: any error in the loop (a peer that died, a malformed message, a stall past the
shutdown time) ends the engine. Every pending and later operation then fails with
:class:`~hora.errors.HoraInternalError` carrying the first cause, and rank 0 tells the others
before it closes, so no rank waits forever. Shutdown of any rank shuts down every rank, as in
Horovod; operations still pending fail with the shutdown message.
"""

from __future__ import annotations

import contextlib
import logging
import select
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

from hora.backends.base import Backend, SetComm
from hora.core.autotune import Autotuner
from hora.core.controller import Coordinator, decode_responses
from hora.core.executor import Executor, TensorEntry
from hora.core.fastpath import DirectRounds, MemberState
from hora.core.handles import shut_down_error
from hora.core.hang_report import HangReport, stacks_message
from hora.core.messages import (
    OpType,
    Response,
    bits_encode,
    decode,
    encode,
)
from hora.core.stall import StallInspector
from hora.errors import HoraInternalError, MismatchError, TransportError
from hora.settings import Settings
from hora.transport.base import CONTROL, Pair, Transport

log = logging.getLogger("hora.engine")


class _Stop(Exception):
    """The loop ends normally (shutdown) or with a cause another rank reported."""


class _PeerGone(TransportError):
    """The control connection of rank ``peer`` closed without a goodbye."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


DEPARTURE_WAIT_S = 3.0  # how long a failing rank waits to learn how a peer left


def _describe(entry: TensorEntry) -> str:
    """The op a caller was in, for its error message."""
    req = entry.spec_request
    return f"{req.op.name.lower()} of tensor {req.match!r}"


class Engine(DirectRounds):
    def __init__(
        self,
        rank: int,
        size: int,
        settings: Settings,
        transport: Transport | None,
        backend: Backend,
        timeline: Any = None,
    ) -> None:
        self.rank, self.size, self.settings = rank, size, settings
        self.transport = transport
        self.timeline = timeline
        self.executor = Executor(backend, timeline)
        self.coordinator = (
            Coordinator(settings.fusion_threshold, settings.cache_capacity) if rank == 0 else None
        )
        if self.coordinator is not None:
            self.coordinator.on_ready = self._mark_ready
            self.coordinator.direct = settings.fast_path and not settings.autotune
        self._cycle_s = settings.cycle_time_ms / 1000.0
        # rank 0 tunes the fusion threshold and cycle time when asked (HOROVOD_AUTOTUNE)
        self._tuner: Autotuner | None = None
        if self.coordinator is not None and settings.autotune:
            self._tuner = Autotuner(settings)
        self.members: dict[int, MemberState] = {}
        self._lock = threading.Lock()
        self._queue: list[tuple[int, list[TensorEntry]]] = []
        self._inbox: deque[tuple[int, list[Any]]] = deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._wake_pending = False  # a wake-up byte was sent and the queue not drained since
        # the loop is in (or about to enter) its idle poll: only then does an enqueue wake it
        # (busy, it takes the queue before it sleeps; a wake-up would cost the caller a system
        # call, then a wait for the interpreter lock the busy engine thread holds)
        self._idle = False
        self._ctrl: dict[int, Pair] = {}
        self._stop_requested = False
        self._closing = False  # rank 0: shutdown broadcast sent; others: shutdown received
        self._bye_sent = False
        self._gone: set[int] = set()
        self.cause: str | None = None  # why the engine stopped, once it has
        # the rank whose shutdown or exit stopped the job, and how it left when it said so
        self._left: tuple[int, str | None] | None = None
        self._how: str | None = None  # how this rank leaves (sent with its goodbye)
        # how a rank left, as its launcher saw it ("exited with code 0"): set by the runtime
        self.departure: Callable[[int, float], str | None] | None = None
        self._stopped = threading.Event()
        # counters for tests and debugging: requests sent in full or as cache bits, responses
        # executed, tensors that travelled inside a fused response
        self.stats = dict.fromkeys(
            ("requests_full", "requests_cached", "responses", "fused", "direct_rounds",
             "direct_exits", "exchanged", "exchanged_shared", "exchanged_many", "slot_reused",
             "lane", "spread", "express", "express_left"), 0)
        # The turn: held by whichever thread does the engine's work, the engine thread or a
        # caller running its own op in direct mode (enqueue(inline=True)); never both.
        self._turn = threading.Lock()
        self._inline_runs = 0  # ops callers ran themselves (the loop then polls afresh)
        self.spin_s, self.spin_yield = 0.0, False  # hora.core.runtime sets them (fastpath)
        self._inline_error: BaseException | None = None  # a caller's failure, for the loop
        self._forgotten: list[int] = []  # connections a caller stopped watching
        self._deadline = 0.0  # rank 0: when it stops waiting for the others' goodbyes
        self._thread = threading.Thread(target=self._main, name="hora-engine", daemon=True)
        self._hang = HangReport(self._thread, self._send_ctrl) if rank == 0 else None
        self._stall = (
            None if self.coordinator is None
            else StallInspector(settings, self.coordinator, self._hang)
        )

    # -- user-thread API --------------------------------------------------------------------
    def start(self) -> None:
        if self.transport is not None:
            peers = range(1, self.size) if self.rank == 0 else [0]
            for p in peers:
                self._ctrl[p] = self.transport.pair(p, CONTROL)
        self._thread.start()

    def register_global_set(self) -> None:
        """Set 0, every rank; called once before :meth:`start`."""
        ranks = list(range(self.size))
        if self.coordinator is not None:
            self.coordinator.add_set(0, ranks)
        self.executor.backend.add_process_set(0, ranks)
        self._register_member(0, ranks)

    @property
    def thread_id(self) -> int:
        """The engine thread's operating-system id (for pinning it to a core)."""
        return self._thread.native_id or 0

    @property
    def running(self) -> bool:
        return not self._stopped.is_set()

    def enqueue(self, ps_id: int, entries: list[TensorEntry], inline: bool = False) -> None:
        """Hand entries to the engine; fails them at once if it has stopped.

        ``inline``: the caller will wait for them anyway. If the set is in direct mode and
        the engine is idle, the calling thread runs them itself (no hand-off to the engine
        thread and back); anything left goes to the engine thread as usual."""
        if inline and self._run_inline(ps_id, entries):
            return
        with self._lock:
            accepted = not self._stopped.is_set() and not self._stop_requested
            if accepted:
                self._queue.append((ps_id, entries))
                wake = self._idle and not self._wake_pending
                self._wake_pending = self._wake_pending or wake
        if accepted:
            if wake:  # outside the lock: the woken engine thread takes it at once
                self._wake()
            return
        cause = self.cause or self._departure_cause()
        for e in entries:
            e.fail(shut_down_error(cause or "", _describe(e)))

    def shutdown(self, timeout: float = 30.0, how: str | None = None) -> None:
        """Stop the engine (any thread but its own waits for it); ``how`` says to the other
        ranks why this one leaves ("called hvd.shutdown()", "raised ValueError: ...")."""
        with self._lock:
            if self._how is None:
                self._how = how
            self._stop_requested = True
            self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._wake_r.close()
        self._wake_w.close()

    def _woken(self) -> None:
        """Take the wake-up bytes (one per enqueue at most while the queue waits; any left
        over only wake the loop once more). Called outside the loop's own poll (in a round),
        the queue is drained later: the next enqueue must wake the loop again."""
        with contextlib.suppress(BlockingIOError):
            self._wake_r.recv(4096)
        with self._lock:
            self._wake_pending = False

    def _wake(self) -> None:
        # BlockingIOError: a wake-up is already pending; OSError: the engine is gone
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"x")

    # -- the loop ---------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._loop()
        except _Stop as stop:
            self._finish(str(stop) or None)
        except BaseException as e:  # the failure contract: report, then fail everything
            cause = f"{type(e).__name__}: {e}" if not isinstance(e, TransportError) else str(e)
            if isinstance(e, TransportError):
                # A closed connection may only echo another rank's failure: if that rank
                # already reported its cause, pass on the root, not the echo.
                reported = self._reported_cause()
                if reported:
                    cause = reported
                elif isinstance(e, _PeerGone):
                    how = self._explain(e.peer)
                    if how:
                        cause = f"rank {e.peer} {how} (its connection to rank {self.rank} closed)"
            log.error("hora background loop uncaught exception on rank %d: %s", self.rank, cause)
            self._abort_peers(cause)
            self._finish(cause)

    def _reported_cause(self, wait: float = 0.3) -> str | None:
        """An ``abort`` report already sent to this rank on a control connection, if any."""
        sel = selectors.DefaultSelector()
        for peer, pair in self._ctrl.items():
            with contextlib.suppress(ValueError, OSError):  # a closed pair has no descriptor
                sel.register(pair.fileno(), selectors.EVENT_READ, peer)
        deadline = time.monotonic() + wait
        while sel.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                try:
                    msg = decode(self._ctrl[key.data].recv_msg())
                except (TransportError, ValueError):
                    sel.unregister(key.fd)
                    continue
                if msg.get("t") == "abort":
                    return str(msg.get("why", ""))
        return None

    def _explain(self, peer: int) -> str | None:
        """How ``peer`` left, from its launcher, waiting a little for it; None if unknown."""
        if self.departure is None:
            return None
        try:
            return self.departure(peer, DEPARTURE_WAIT_S)
        except Exception:  # the store may be gone too: the generic message stays
            return None

    def _departure_cause(self) -> str | None:
        """"rank N <how it left>" when a peer's shutdown or exit stopped the job, else None."""
        if self._left is None or self._left[0] == self.rank:
            return None
        peer, how = self._left
        how = how or self._explain(peer) or "shut down (hvd.shutdown() or the end of its script)"
        with self._lock:
            if self.cause is None:
                self.cause = f"rank {peer} {how}"
            return self.cause

    def _finish(self, cause: str | None) -> None:
        with self._lock:
            self.cause = cause
            self._stopped.set()
            queued, self._queue = self._queue, []
        self._expresses = None  # the express lane's findings hold views of the arenas
        pending = [e for _, entries in queued for e in entries]
        for ms in self.members.values():
            table, ms.table = ms.table, {}
            pending += table.values()
        if pending and cause is None:
            cause = self._departure_cause()
        for e in pending:
            e.fail(shut_down_error(cause or "", _describe(e)))
        if self.timeline is not None:
            self.timeline.close()
        self.executor.backend.close()
        if self.transport is not None:
            self.transport.close()

    def _loop(self) -> None:
        # a bare poll (no selectors layer): the loop runs once or twice per op
        poller = select.poll()
        wake = self._wake_r.fileno()
        poller.register(wake, select.POLLIN)
        peers = {}
        for peer, pair in self._ctrl.items():
            peers[pair.fileno()] = peer
            poller.register(pair.fileno(), select.POLLIN)
        while True:
            busy = self._closing or any(ms.table for ms in self.members.values())
            rounds = busy and any(ms.table and ms.direct.active for ms in self.members.values())
            with self._lock:  # an enqueue after this sees _idle and wakes the poll below
                if self._queue or rounds:
                    # work queued while a round ran, or a member in direct mode with work left
                    timeout = 0.0
                else:
                    timeout = max(self._cycle_s * 1e3, 0.0) if busy else 250.0
                    self._idle = True
            runs = self._inline_runs
            events = poller.poll(timeout)
            self._idle = False
            with self._turn:
                self._cycle(poller, peers, wake, events, runs)

    def _cycle(self, poller: Any, peers: dict[int, int], wake: int, events: list[Any],
               runs: int) -> None:
        """One turn of the loop (the engine thread, holding the turn)."""
        if self._inline_error is not None:
            err, self._inline_error = self._inline_error, None
            raise err
        while self._forgotten:
            with contextlib.suppress(KeyError):
                poller.unregister(self._forgotten.pop())
        if runs != self._inline_runs:  # a caller took a turn: what was readable may be read
            events = poller.poll(0)
        for fd, ev in events:
            if ev & select.POLLNVAL:  # closed under the loop (a shutdown that timed out)
                poller.unregister(fd)
            elif fd == wake:
                self._woken()
            elif fd in peers:
                self._read_control(peers[fd], partial(poller.unregister, fd))
        if self.timeline is not None and self.settings.timeline_mark_cycles:
            self.timeline.mark_cycle()
        self._drain_queue()
        for ms in list(self.members.values()):
            if ms.direct.active and ms.table and not (self._closing or self._stop_requested):
                self._round(ms)
        if self.coordinator is not None and not self._closing:  # nothing new after shutdown
            self._coordinate()
        self._execute_inbox()
        if self._stop_requested and not self._closing:
            self._begin_shutdown()
        if self._closing:
            for ms in self.members.values():
                if ms.direct.active:  # the members that wait in a round give up
                    self._withdraw(ms)
            if self.rank != 0 or len(self._gone) >= self.size - 1 or (
                time.monotonic() > self._deadline
            ):
                raise _Stop()
        if self._stall is not None:
            self._stall.check()

    def _read_control(self, peer: int, forget: Callable[[], None]) -> None:
        """Handle one message from ``peer``; ``forget`` stops watching its connection."""
        pair = self._ctrl[peer]
        try:
            msg = decode(pair.recv_msg())
        except TransportError:
            if self._closing or (self._bye_sent and peer == 0):
                forget()
                self._gone.add(peer)
                if peer == 0:
                    self._closing = True
                return
            raise self._peer_gone(peer) from None
        kind = msg["t"]
        if kind == "req" and self.coordinator is not None:
            self._on_requests(peer, msg)
        elif kind == "resp":
            self._inbox.append((int(msg["ps"]), msg["l"]))
        elif kind == "bye" and self.rank == 0:
            if self._left is None:
                self._left = (peer, msg.get("how"))
            self._stop_requested = True
        elif kind == "shutdown":
            if self._left is None and "left" in msg:
                self._left = (int(msg["left"]), msg.get("how"))
            self._closing = True
        elif kind == "abort":
            raise _Stop(str(msg.get("why", "another rank failed")))
        elif kind == "stack":  # rank 0's hang report asks where this rank's threads are
            pair.send_msg(encode(stacks_message(self.rank, self._thread)))
        elif kind == "stacks" and self._hang is not None:
            self._hang.add(int(msg["rank"]), str(msg.get("text", "")))
        else:
            raise ValueError(f"unexpected control message {kind!r} from rank {peer}")

    def _mark_ready(self, name: str, rank: int) -> None:
        if self.timeline is not None:
            self.timeline.negotiate_rank_ready(name, rank)

    def _on_requests(self, peer: int, msg: dict[str, Any]) -> None:
        assert self.coordinator is not None
        self.coordinator.on_message(peer, msg)

    # -- member side ------------------------------------------------------------------------
    def _drain_queue(self) -> None:
        with self._lock:
            self._wake_pending = False
            if not self._queue:
                return
            batch, self._queue = self._queue, []
        by_set: dict[int, tuple[list[Any], list[int]]] = {}
        tl = self.timeline
        for ps_id, entries in batch:
            ms = self.members[ps_id]
            if ms.direct.active:
                self._hold(ms, entries)
                continue
            full, hits = by_set.setdefault(ps_id, ([], []))
            for e in entries:
                cid = ms.take(e)
                req = e.spec_request
                if tl is not None:
                    tl.negotiate_start(req.name, req.op.name)
                if cid is None:
                    full.append(req.to_wire())
                else:
                    hits.append(cid)
        for ps_id, (full, hits) in by_set.items():
            self._send_requests(ps_id, full, hits)

    def _send_requests(self, ps_id: int, full: list[Any], hits: list[int]) -> None:
        self.stats["requests_full"] += len(full)
        self.stats["requests_cached"] += len(hits)
        epoch = self.members[ps_id].epoch
        if self.coordinator is not None:  # rank 0: no message to itself
            self.coordinator.on_requests(0, ps_id, epoch, sorted(hits), full)
        else:
            msg = {"t": "req", "ps": ps_id, "ep": epoch, "r": full, "h": bits_encode(hits)}
            self._ctrl[0].send_msg(encode(msg))

    def _execute_inbox(self) -> None:
        while self._inbox:
            ps_id, wire = self._inbox.popleft()
            ms = self.members.get(ps_id)
            if ms is None:
                continue  # a set this rank is not in (cannot happen: sent to members only)
            responses = decode_responses(wire, ms.cache)
            ms.epoch += 1
            self._run(ms, responses)

    def _run(self, ms: MemberState, responses: list[Response]) -> None:
        tl = self.timeline
        if tl is not None:  # negotiation is over; each tensor now waits its turn
            for resp in responses:
                for s in resp.specs:
                    tl.negotiate_end(s.request.name)
                    tl.start(s.request.name, resp.op.name)
                    tl.activity_start(s.request.name, "QUEUE")
        for resp in responses:
            self._perform(ms, resp)

    def _perform(self, ms: MemberState, resp: Response) -> None:
        op = resp.op
        tl = self.timeline
        self.stats["responses"] += 1
        if len(resp.specs) > 1:
            self.stats["fused"] += len(resp.specs)
        names = resp.names
        keys = [s.request.match for s in resp.specs]
        if tl is not None:
            for n in names:
                tl.activity_end(n)  # QUEUE
        if op == OpType.ERROR:
            for k in keys:
                entry = ms.table.pop(k, None)
                if entry is not None:
                    entry.fail(MismatchError(resp.error))
        elif op in (OpType.ALLREDUCE, OpType.ADASUM):
            # Entries stay in the table until done: if the backend raises, the failure path
            # fails them with everything else instead of leaving their handles waiting.
            entries = [ms.table.get(k) for k in keys]
            if not ms.joined and any(e is None for e in entries):
                missing = [n for n, e in zip(names, entries) if e is None]
                raise HoraInternalError(
                    f"rank {self.rank} was told to reduce {missing}, which it never submitted"
                )
            results = self.executor.allreduce(ms.comm, resp, entries)
            for k, e, r in zip(keys, entries, results):
                if e is not None:
                    del ms.table[k]
                    e.complete(r)
        elif op == OpType.DIRECT:
            self._enter_direct(ms, resp.threshold)
        elif op == OpType.BARRIER:
            ms.table.pop("barrier").complete(None)
        elif op == OpType.JOIN:
            ms.joined = False
            ms.table.pop("join").complete(resp.last_joined)
        elif op in (OpType.ADD_PROCESS_SET, OpType.REMOVE_PROCESS_SET):
            spec = resp.specs[0]
            ranks = list(spec.request.ranks or ())
            backend = self.executor.backend
            if op == OpType.ADD_PROCESS_SET:  # the coordinator registered it when deciding
                backend.add_process_set(resp.process_set_id, ranks)
                self._register_member(resp.process_set_id, ranks)
            else:
                self.members.pop(resp.process_set_id, None)
                backend.remove_process_set(resp.process_set_id, ranks)
            ms.table.pop(spec.request.match).complete(resp.process_set_id)
        else:
            spec = resp.specs[0]
            entry = ms.table[spec.request.match]
            ex = self.executor
            fn = {
                OpType.ALLGATHER: ex.allgather,
                OpType.BROADCAST: ex.broadcast,
                OpType.ALLTOALL: ex.alltoall,
                OpType.REDUCESCATTER: ex.reducescatter,
            }[op]
            result = fn(ms.comm, spec, entry)
            del ms.table[spec.request.match]
            entry.complete(result)
        if tl is not None:
            fused = sum(s.request.nbytes for s in resp.specs) if len(resp.specs) > 1 else 0
            for s in resp.specs:
                tl.end(s.request.name, s.request.dtype, s.request.shape, fused)

    def _peer_gone(self, peer: int) -> _PeerGone:
        return _PeerGone(
            f"rank {peer} exited or was killed (its connection to rank {self.rank} closed)", peer
        )

    def _register_member(self, ps_id: int, ranks: list[int]) -> None:
        if self.rank in ranks:
            comm = SetComm(
                ranks,
                ranks.index(self.rank),
                self.transport,  # type: ignore[arg-type]
                ps_id,
            )
            self.members[ps_id] = MemberState(comm, self.settings.cache_capacity)

    # -- coordinator side (rank 0) ----------------------------------------------------------
    def _coordinate(self) -> None:
        assert self.coordinator is not None
        hold = self._cycle_s if self.coordinator.fusion_threshold > 0 else 0.0
        ready = self.coordinator.take_responses(time.monotonic(), hold)
        if self._tuner is not None and ready:
            self._autotune(ready)
        for st, responses in ready:
            wire = self.coordinator.encode(st, responses)
            data = None
            for r in st.ranks:
                if r == 0:
                    self._inbox.append((st.ps_id, wire))
                else:
                    data = data or encode({"t": "resp", "ps": st.ps_id, "l": wire})
                    self._ctrl[r].send_msg(data)

    def _autotune(self, ready: list[tuple[Any, list[Response]]]) -> None:
        """Count a cycle's bytes; apply the tuner's next point when it has one."""
        assert self._tuner is not None and self.coordinator is not None
        nbytes = sum(s.request.nbytes for _, rs in ready for r in rs for s in r.specs)
        point = self._tuner.cycle(nbytes)
        if point is not None:
            self.coordinator.fusion_threshold, cycle_ms = point
            self._cycle_s = cycle_ms / 1000.0
            if self.timeline is not None and self._tuner.trials:
                self.timeline.mark("AUTOTUNE", self._tuner.trials[-1])

    def _begin_shutdown(self) -> None:
        """Rank 0: tell every rank the job ends (once); any other rank: say goodbye to rank 0
        (once), which then does so. Responses sent before stay in order before it."""
        if self.rank == 0:
            if self._closing:
                return
            self._closing = True
            self._deadline = time.monotonic() + 10.0  # for the others' goodbyes
            if self._left is None:
                self._left = (0, self._how)
            msg: dict[str, Any] = {"t": "shutdown", "left": self._left[0]}
            if self._left[1]:
                msg["how"] = self._left[1]
            for peer, pair in self._ctrl.items():
                try:
                    pair.send_msg(encode(msg))
                except TransportError:
                    self._gone.add(peer)
        elif not self._bye_sent:
            self._bye_sent = True
            self._ctrl[0].send_msg(encode({"t": "bye", "how": self._how} if self._how else
                                          {"t": "bye"}))

    def _abort_peers(self, cause: str) -> None:
        data = encode({"t": "abort", "why": f"rank {self.rank} failed: {cause}"})
        for pair in self._ctrl.values():
            with contextlib.suppress(Exception):  # the peer may be the one that died
                pair.send_msg(data)

    def _send_ctrl(self, rank: int, msg: dict[str, Any]) -> None:
        self._ctrl[rank].send_msg(encode(msg))
