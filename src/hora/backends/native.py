"""hora's own backend: the algorithms of ``hora.collectives`` over hora's transports.

Stateless apart from the transport it was given; called from the engine thread only.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import numpy as np

from hora.backends.base import SetComm
from hora.collectives import hierarchical, registry
from hora.collectives.allreduce_mapped import (
    allreduce_mapped,
    allreduce_posted,
    allreduce_staged,
    stage_in,
    staged_rest,
)
from hora.collectives.base import check_buffer
from hora.collectives.reduce_ops import reducer_scaled, scale
from hora.dtypes import storage_dtype
from hora.transport.shm.arena import STORES_IN_ORDER, Arena, open_arena
from hora.transport.shm.mailbox import Mailboxes

if TYPE_CHECKING:
    from hora.backends.registry import BackendContext

log = logging.getLogger(__name__)


# A fused allreduce goes part by part (no fusion-buffer copies) when its tensors average at
# least this many bytes; smaller ones cost less copied into one buffer, as each part costs the
# transport a scatter piece and the reduction a call of its own. Measured at np=2 on one host,
# the two ways alternating: 100 tensors of 10 KB 1.26-1.29x slower as parts, 25 of 42 KB even,
# 4 to 10 tensors of 107-273 KB 8-25% faster as parts.
PARTS_MIN_BYTES = 64 << 10

# Each member's part of a one-host set's shared arena (hora.transport.shm.arena), which serves
# as the set's fusion buffer (fused responses up to this size are reduced in mapped memory) and
# holds direct mode's two exchange slots. Only what is written is ever allocated.
ARENA_BYTES = 128 << 20
# A single buffer above MAPPED_MIN_BYTES and up to MAPPED_MAX_BYTES is reduced through the
# arena (one copy in, the others' blocks copied out) rather than with single-copy reads:
# measured at np=2 on one host, 0.38-0.96 of the time from 80 KiB to 8 MiB; at 12-16 MiB
# single-copy reads were faster (1.12-1.53x) than the arena in one segment, the copies costing
# more than the system calls they save (in segments the arena is ahead there: see
# PAIR_MAPPED_MAX_BYTES). Up to 64 KiB the small-message path (or, in direct mode, the round's
# headers) takes one exchange. In a set of n > 2 members whose signals go through the arena's words
# (hora.collectives.allreduce_mapped) the arena takes a buffer from MANY_MAX_BYTES / (n - 1):
# the small-message path is log2(n) exchanges on the pairs there. np=4 on 2 cores, alternating
# runs: 32 KiB 0.66-0.67 ms against 0.89-0.99, 64 KiB 0.62-0.72 against 0.92-0.99. Smaller
# ones keep the small-message path's recursive doubling, whose bits direct mode's hand-over
# makes for the allreduces it carries (hora.core.handover), up to the same size.
MAPPED_MIN_BYTES = 64 << 10
MANY_MAX_BYTES = 64 << 10
# Where ranks outnumber cores (:func:`_crowded`), every wait for the others is a turn of every
# rank on a core, and a single buffer up to this size takes the small-message path (in direct
# mode the round's headers, which every member reduces where they lie in the mailboxes): one
# wait, against the arena's two, for every member reducing every input. On 2 cores, blocking
# allreduces, the two limits taking turns block by block in one job, headers / arena, us: np=3
# 48 KiB 99 / 134, 96 KiB 128 / 130, 128 KiB 137 / 136; np=4 32 KiB 98 / 132, 64 KiB
# 103-105 / 132, 96 KiB 235 / 260, 128 KiB 157 / 148; np=8 16 KiB 330 / 479, 64 KiB 409 / 515,
# 96 KiB 551 / 522.
CROWDED_HEADER_BYTES = 64 << 10
MAPPED_MAX_BYTES = 8 << 20
# In a set of two, through the arena in STAGED_SEGMENT_BYTES segments up to this size: there
# the segments beat the single-copy reads to 16 MiB and more. The two ways taking turns block by
# block in one job (2-core VM, medians in ms, single-copy reads / arena): 12 MiB 4.95 / 4.06,
# 4.72 / 3.84, 3.64 / 3.41; 16 MiB 5.54 / 4.94, 5.63 / 5.03, 5.09 / 4.52; 20 MiB 6.07 / 5.93;
# 24 MiB 7.09 / 6.49; 32 MiB 8.71 / 9.16, 9.72 / 9.34.
# Among more members where ranks outnumber cores (a shared arena's ``crowded``: any member's host
# runs more ranks than it has cores), through the arena at every size: the single-copy reads'
# exchanges are messages on every pair, each a wake-up of a rank that may wait for a core. On a
# 2-core VM, taking turns block by block in one job, single-copy reads / arena, ms: np=3 12 MiB
# 6.63 / 2.66, 16 MiB 8.56 / 3.64, 32 MiB 15.9 / 11.1, 64 MiB 31.4 / 23.0, 256 MiB 114 / 111;
# np=4 12 MiB 8.11 / 3.07, 16 MiB 11.6 / 4.35, 32 MiB 19.9 / 12.7, 64 MiB 41.2 / 24.8; np=8
# 16 MiB 28.7 / 11.9, 32 MiB 50.8 / 43.1. (An earlier machine had np=3 at 12-32 MiB 0.80-0.88x,
# before direct mode staged ahead of a round's header.) Where each rank has a core, more
# members stay at MAPPED_MAX_BYTES until measured there.
PAIR_MAPPED_MAX_BYTES = 16 << 20
# A single buffer goes through the arena in segments of this many bytes, one after another (two
# signals each); where the set's pairs cannot read single-copy (Yama's ptrace_scope=1,
# HORA_SHM_SINGLE_COPY=0), so does one above MAPPED_MAX_BYTES, rather than through the pairs'
# staging slots (docs/shm.md, "Without single-copy reads"). A segment's buffer, part and the
# others' parts then stay in the caches. Segment sizes taking turns block by block in one job
# (2-core VM, medians in ms, one segment of the whole buffer / 2 MiB segments): np=2 4 MiB
# 0.87 / 0.85 and 1.17 / 1.14, 8 MiB 2.36 / 2.05 and 2.91 / 2.31; np=4 4 MiB 5.4 / 4.8, 8 MiB
# 9.9 / 7.9; np=3 alike. Without single-copy reads, np=2 8 MiB 2.78 / 2.29 and 2.91 / 2.35;
# above 8 MiB, 4 / 2 MiB segments: np=2 16 MiB 4.58 / 4.51, 64 MiB 17.5 / 17.2 and 16.9 /
# 16.5; np=4 16 MiB 15.4 / 13.5. 1 MiB segments are slower (np=2 8 MiB 2.49 against 2.40;
# np=4 15.6 against 8.9: twice the signals among ranks that share cores). Earlier, on an idle
# machine, 4 / 8 / 16 MiB segments: np=2 16 MiB 4.0-4.1 / 4.6-4.7 / 5.9, 64 MiB 14.7-15.4 /
# 15.7-16.3 / 20.5-22.7; np=3 16 MiB 11.8 / 13.3 / 13.4, 64 MiB 47.7 / 57.2 / 59.6.
STAGED_SEGMENT_BYTES = 2 << 20
# Direct mode's two exchange slots (exchange_slot): a two-member allreduce (or a run of them)
# up to this size is handed over through them, one exchange of headers (hora.core.handover);
# a larger one runs here, fused, with single-copy reads. Back to back, np=2, the two ways
# alternating in one process: the slots took 0.58-0.76 of the time at 1-4 MiB, 0.84-1.02 at
# 8 MiB, 0.87-1.04 at 12-13 MiB, 0.96-1.33 at 16 MiB (three runs) and 1.2-1.4 from 24 MiB,
# copying the input in costing more than the one synchronisation saves. In training the one
# exchange counts for more (the engine thread shares the cores with the training threads,
# and every extra synchronisation may wait for a descheduled peer): the MLP of
# examples/pytorch_synthetic_benchmark.py, whose gradients come to 12.3 MiB, ran at
# 7,167-7,591 img/s when one hand-over took them all against 6,207-6,789 with 8 MiB slots
# (docs/benchmarks.md). So the slots take up to 14 MiB, and a 16 MiB allreduce runs here.
SLOT_BYTES = 14 << 20
# Large tensors, though, are reduced faster where they lie by the backend than copied into a
# slot: a hand-over above SLOT_ALONE_BYTES goes through a slot only when its tensors average
# under SLOT_TENSOR_BYTES. Alternating in one process, np=2, slot against the backend's
# single-copy round: 12 MiB in six tensors 0.85, in three 1.01-1.05, in two 1.14-1.16. Since a
# single buffer up to MAPPED_MAX_BYTES goes through the arena, the backend is ahead from 4 MiB
# for one tensor (the slot's copy-in and whole-buffer reduction, where each member reduces
# half in the arena): blocking allreduces, np=2, six runs of each taking turns, medians in ms,
# slot against backend: 2 MiB 0.37-0.54 / 0.46-0.54, 3 MiB 0.42-0.87 / 0.58-0.87, 4 MiB
# 0.64-1.41 / 0.86-1.25 (backend ahead in five runs of six), 6 MiB 1.54-3.06 / 1.61-1.87 (five
# of six), 8 MiB 3.02-4.35 / 2.28-2.97 (six of six), with and without single-copy reads alike.
SLOT_ALONE_BYTES = 3 << 20
SLOT_TENSOR_BYTES = 4 << 20


def _one_shared_host(comm: SetComm) -> bool:
    """Whether the set has a shared arena to open: several members, all on this host, over
    shared memory. The same answer on every member."""
    layout = hierarchical.layout_of(comm)
    return comm.size > 1 and layout is not None and layout.shared and not layout.multi_host


def _host_cores() -> int:
    """The cores of this host (not only those this process may use: the same on every rank
    of the host, however each is bound)."""
    return os.cpu_count() or 1


def _least_staged(comm: SetComm, arena: Arena | None = None) -> int:
    """The size above which a single buffer may go through the set's shared arena ``arena``
    (None: not open yet); up to it, the small-message path."""
    if comm.size > 2 and STORES_IN_ORDER:
        if _crowded(comm, arena):
            return CROWDED_HEADER_BYTES
        return MANY_MAX_BYTES // (comm.size - 1)
    return MAPPED_MIN_BYTES


def _crowded(comm: SetComm, arena: Arena | None) -> bool:
    """Whether the set keeps its large buffers in its shared arena because ranks outnumber
    cores: more than two members, and a member's host runs more ranks than it has cores
    (see PAIR_MAPPED_MAX_BYTES)."""
    return comm.size > 2 and arena is not None and arena.crowded


def _most_staged(comm: SetComm, arena: Arena) -> int | float:
    """The size up to which a single buffer goes through the set's shared arena (above
    :func:`_least_staged`): every size where the pairs do not read single-copy, or where
    :func:`_crowded`."""
    if not arena.pulls or _crowded(comm, arena):
        return float("inf")
    return PAIR_MAPPED_MAX_BYTES if comm.size == 2 else MAPPED_MAX_BYTES


def _staging(comm: SetComm, buf: np.ndarray, arena: Arena | None) -> list[np.ndarray] | None:
    """Every member's part of ``arena`` laid out as the segment ``buf`` (above
    :func:`_least_staged`) goes through it in; None where it does not go through it: no arena,
    or too large where the pairs read single-copy."""
    if arena is None or buf.nbytes > _most_staged(comm, arena):
        return None
    step = min(buf.nbytes, STAGED_SEGMENT_BYTES, arena.nbytes)
    if step < buf.nbytes:  # whole segments split evenly among members
        step -= step % (buf.itemsize * comm.size)
    return arena.region(0, step, buf.dtype)


class NativeBackend:
    name = "TCP"
    # hora's own data path: a two-member set in direct mode may move a small allreduce inside
    # the round's headers (hora.core.fastpath) instead of calling this backend
    native = True
    # allreduce takes ``out=``: the result made apart from the input in the same pass (no copy
    # of an out-of-place allreduce's input first, core.executor)
    reduces_into = True
    # allreduce and allreduce_parts take ``post=``: the result's scaling (an Average's 1/size),
    # made in the reduction's pass where they can (two members), else after it
    scales_result = True

    def __init__(self, ctx: BackendContext | None = None) -> None:
        # one scratch area for every reduction, instead of an allocation per call
        self._scratch = np.empty(registry.SCRATCH_BYTES, dtype=np.uint8)
        knobs = ctx.settings if ctx is not None else None
        # torus allreduce is accepted and runs as hierarchical
        self._hier_allreduce = knobs is not None and (knobs.hierarchical_allreduce
                                                      or knobs.torus_allreduce)
        self._hier_allgather = knobs is not None and knobs.hierarchical_allgather
        # this host runs more ranks than it has cores (its shared arenas say whether any
        # member's does: Arena.crowded)
        local = ctx.identity.local_size if ctx is not None else 1
        self._crowded = local > _host_cores()
        self._arenas: dict[int, Arena | None] = {}  # by process set, once asked for
        self._boxes: dict[int, Mailboxes] = {}  # their mailboxes, once asked for
        # allreduces run over a shared arena, and fused ones gathered where their tensors lie
        # (tests and diagnosis read them)
        self.mapped = self.gathered = 0

    def allreduce(self, comm: SetComm, buf: np.ndarray, dtype: str, op: int,
                  out: np.ndarray | None = None, post: float = 1.0) -> None:  # fmt: skip
        """Reduce ``buf`` in place, or into ``out`` (1-D, ``buf``'s size and dtype; ``buf`` is
        then only read, and may be read-only), and scale the result by ``post``."""
        arena = self._arenas.get(comm.process_set_id)
        views = arena.views(buf) if arena is not None else None  # the set's fusion buffer
        if views is None and _crowded(comm, arena) and STORES_IN_ORDER \
                and buf.nbytes <= _least_staged(comm, arena):  # one wait, in the mailboxes
            red, left = reducer_scaled(comm.size, op, dtype, post)
            check_buffer(buf if out is None else out, dtype)
            assert arena is not None
            allreduce_posted(comm, buf, self.mailboxes(comm), arena.words(),  # type: ignore[arg-type]
                             red, out)  # fmt: skip
            scale(buf if out is None else out, dtype, left)
            return
        staged = None  # else a single buffer staged through the arena
        if views is None and buf.nbytes > _least_staged(comm):
            arena = self._arena(comm)
            if buf.nbytes > _least_staged(comm, arena):
                staged = _staging(comm, buf, arena)
        if views is None and staged is None:
            # host-aware: shared memory inside a host, hierarchical across hosts, else flat
            hierarchical.allreduce(comm, buf, dtype, op, hierarchical.layout_of(comm),
                                   hierarchical=self._hier_allreduce, scratch=self._scratch,
                                   out=out, post=post)
            return
        red, left = reducer_scaled(comm.size, op, dtype, post)
        res = buf if out is None else out
        assert arena is not None
        words = arena.words()  # the two signals go through them (x86)
        if views is not None:
            check_buffer(buf, dtype)
            allreduce_mapped(comm, views, red, words)
            if out is not None:
                np.copyto(out, buf)
        elif staged is not None:
            check_buffer(res, dtype)
            allreduce_staged(comm, buf, staged, red, out=out, words=words)
        self.mapped += 1
        scale(res, dtype, left)

    def spread_takes(self, comm: SetComm, nbytes: int) -> bool:
        """Whether :meth:`allreduce` stages a single buffer of ``nbytes`` through the set's
        open shared arena (:meth:`spread_in` then may)."""
        arena = self._arenas.get(comm.process_set_id)
        if comm.size < 2 or arena is None or nbytes <= _least_staged(comm, arena):
            return False
        return nbytes <= _most_staged(comm, arena)

    def small_most(self, comm: SetComm) -> int:
        """The size up to which :meth:`allreduce` reduces a single buffer with the
        small-message path (recursive doubling, whose bits direct mode's hand-over makes for
        the allreduces it carries in a round's headers: hora.core.handover)."""
        return _least_staged(comm, self._arenas.get(comm.process_set_id))

    def spread_in(self, comm: SetComm, buf: np.ndarray) -> list[np.ndarray]:
        """Where :meth:`spread_takes` says: the first segment of ``buf`` staged into this
        member's part of the arena now, ahead of the signal that every member's is (a
        direct-mode round's header: hora.core.handover); every member's segment of the arena,
        for :meth:`spread_rest`."""
        views = _staging(comm, buf, self._arenas[comm.process_set_id])
        assert views is not None
        stage_in(comm, buf[: views[0].size], views)
        return views

    def spread_rest(self, comm: SetComm, buf: np.ndarray, views: list[np.ndarray], dtype: str,
                    op: int, out: np.ndarray | None = None, post: float = 1.0) -> None:  # fmt: skip
        """The rest of :meth:`allreduce` of ``buf`` after :meth:`spread_in` (``views``) and the
        signal that every member staged its first segment: the same steps, so the same bits."""
        red, left = reducer_scaled(comm.size, op, dtype, post)
        res = buf if out is None else out
        check_buffer(res, dtype)
        words = self._arenas[comm.process_set_id].words()  # type: ignore[union-attr]
        k = views[0].size
        staged_rest(comm, buf[:k], views, red, None if out is None else out[:k], words)
        if k < buf.size:  # the other segments as allreduce_staged takes them
            allreduce_staged(comm, buf[k:], views, red, out=None if out is None else out[k:],
                             words=words)  # fmt: skip
        self.mapped += 1
        scale(res, dtype, left)

    def fusion_buffer(self, comm: SetComm, count: int, dtype: str) -> np.ndarray | None:
        """A fusion buffer of ``count`` elements in the set's shared arena, which
        :meth:`allreduce` reduces in mapped memory; None where there is none (several hosts,
        no shared memory, an arena the members could not map, or too small). The same answer
        on every member. Collective the first time for a set: members ask at the same point."""
        arena = self._arena(comm)
        st = storage_dtype(dtype)
        if arena is None or count * st.itemsize > arena.nbytes:
            return None
        return arena.mine(count, st)

    def exchange_slot(self, comm: SetComm, slot: int, nbytes: int,
                      at: int = 0) -> list[np.ndarray] | None:  # fmt: skip
        """Bytes ``[at, at + nbytes)`` of exchange slot ``slot`` (0 or 1) of every member's part
        of the set's shared arena: where a two-member round puts allreduces' inputs for the
        other member to read (hora.core.fastpath). None if the set has no arena open, or they
        do not fit. Never opens one (that is collective). The two slots are disjoint, so a
        member may fill one while the other still reads its last inputs from the other."""
        arena = self._slots(comm)
        if arena is None or at + nbytes > SLOT_BYTES:
            return None
        return arena.region(slot * SLOT_BYTES + at, nbytes)

    def exchange_takes(self, comm: SetComm, nbytes: int, count: int) -> bool:
        """Whether a two-member hand-over of ``count`` tensors, ``nbytes`` together, goes
        through an exchange slot of the set's shared arena (else the backend runs them): the
        set has one open, they fit, and they are not large tensors (``SLOT_ALONE_BYTES``)."""
        if self._slots(comm) is None or nbytes > SLOT_BYTES:
            return False
        return nbytes <= SLOT_ALONE_BYTES or nbytes < SLOT_TENSOR_BYTES * count

    def _slots(self, comm: SetComm) -> Arena | None:
        """The set's shared arena where it is open and holds the two exchange slots."""
        arena = self._arenas.get(comm.process_set_id)
        return arena if arena is not None and arena.nbytes >= 2 * SLOT_BYTES else None

    def exchange_words(self, comm: SetComm) -> list[np.ndarray] | None:
        """Every member's int64 words in the head of the set's shared arena (each member
        writes only its own); None if the set has no arena open. Never opens one."""
        arena = self._arenas.get(comm.process_set_id)
        return None if arena is None else arena.words()

    def open_mailboxes(self, comm: SetComm) -> Mailboxes | None:
        """The mailboxes of the set's shared arena, opening the arena (collectively: members
        call this at the same point of the set's order) if it is not open yet; None where the
        set has none (several hosts, no shared memory, members that could not map it)."""
        self._arena(comm)
        return self.mailboxes(comm)

    def mailboxes(self, comm: SetComm) -> Mailboxes | None:
        """The mailboxes of the set's shared arena (what a direct-mode round's header goes
        through); None if the set has no arena open. Never opens one."""
        arena = self._arenas.get(comm.process_set_id)
        if arena is None:
            return None
        boxes = self._boxes.get(comm.process_set_id)
        if boxes is None:
            boxes = self._boxes[comm.process_set_id] = Mailboxes(arena)
        return boxes

    def _arena(self, comm: SetComm) -> Arena | None:
        """The set's shared arena, opened (collectively) the first time it is asked for."""
        ps_id = comm.process_set_id
        if ps_id not in self._arenas:
            self._arenas[ps_id] = None
            if _one_shared_host(comm):
                pairs = [None if i == comm.rank else comm.pair(i) for i in range(comm.size)]
                self._arenas[ps_id] = open_arena(pairs, comm.rank, ARENA_BYTES, self._crowded)
                log.debug("allreduce: shared arena for process set %d of %d members: %s",
                          ps_id, comm.size, "mapped" if self._arenas[ps_id] else "not used")
        return self._arenas[ps_id]

    def reduces_parts(self, comm: SetComm, nbytes: int, count: int = 1) -> bool:
        """Whether :meth:`allreduce_parts` serves a fused allreduce of ``nbytes`` in ``count``
        tensors in this set: one host over shared memory, and tensors large enough on average
        that reducing each where it lies beats copying them through the fusion buffer (each
        part costs the transport a scatter piece and the reduction a call of its own). Not
        among more than two members where ranks outnumber cores: the fusion buffer in the
        arena, or the large tensors each through it, there (np=4 on 2 cores, fused Sum, the
        two ways taking turns block by block in one job, parts / arena: 4 of 4 MiB 22.4 /
        16.0 ms, 8 of 2 MiB 33.3 / 24.2, 16 of 1 MiB 18.8 / 7.5). The same answer on every
        rank of the set."""
        if _crowded(comm, self._arenas.get(comm.process_set_id)):
            return False
        return (_one_shared_host(comm)
                and nbytes > registry.SMALL_THRESHOLD and nbytes >= PARTS_MIN_BYTES * count
                and nbytes > MAPPED_MAX_BYTES)  # below: the fusion buffer in the arena

    def allreduce_parts(self, comm: SetComm, parts: list[np.ndarray], dtype: str,
                        op: int, post: float = 1.0) -> None:  # fmt: skip
        """Reduce ``parts`` as one buffer, each where it lies (no fusion-buffer copies), and
        scale the results by ``post``."""
        for p in parts:
            check_buffer(p, dtype)
        red, left = reducer_scaled(comm.size, op, dtype, post)
        hierarchical.allreduce_direct(comm, parts, red, scratch=self._scratch)
        self.gathered += 1
        for p in parts:
            scale(p, dtype, left)

    def allgatherv(self, comm: SetComm, send: np.ndarray, recv: np.ndarray,
                   counts: list[int]) -> None:
        hierarchical.allgatherv(comm, send, recv, counts, hierarchical.layout_of(comm),
                                hierarchical=self._hier_allgather)

    def broadcast(self, comm: SetComm, buf: np.ndarray, root: int) -> None:
        registry.broadcast_tree(comm, buf, root)

    def alltoallv(self, comm: SetComm, send: np.ndarray, send_counts: list[int],
                  recv: np.ndarray, recv_counts: list[int]) -> None:
        registry.alltoallv_pairwise(comm, send, send_counts, recv, recv_counts)

    def reducescatterv(self, comm: SetComm, send: np.ndarray, recv: np.ndarray,
                       counts: list[int], dtype: str, op: int) -> None:
        registry.reducescatterv_ring(comm, send, recv, counts, dtype, op, scratch=self._scratch)

    def adasum(self, comm: SetComm, buf: np.ndarray, dtype: str,
               segments: list[tuple[int, int]]) -> None:
        registry.adasum(comm, buf, dtype, segments)

    def barrier(self, comm: SetComm) -> None:
        registry.barrier(comm)

    def add_process_set(self, ps_id: int, ranks: list[int]) -> None:
        pass  # pairs connect lazily; nothing to prepare

    def remove_process_set(self, ps_id: int, ranks: list[int]) -> None:
        self._boxes.pop(ps_id, None)
        arena = self._arenas.pop(ps_id, None)
        if arena is not None:
            arena.close()

    def close(self) -> None:
        self._boxes.clear()
        arenas, self._arenas = self._arenas, {}
        for arena in arenas.values():
            if arena is not None:
                arena.close()
