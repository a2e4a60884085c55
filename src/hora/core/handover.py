"""Two-member rounds that carry their allreduces' data (part of direct mode,
:mod:`hora.core.fastpath`).

In a set of two members on one host, a round's header may hand over the inputs of the
allreduces at the head of the member's list (:func:`exchange_run`: one dtype, within the
fusion threshold, whole groups): small, inside the header (``DATA``); larger, in one of two
*exchange slots* of the member's part of the set's shared arena (``SHARED``, ``SLOT1``),
which the other member reads in place. The tensors at the head of both lists are then done in
that one exchange of headers: each member reduces the other's inputs straight into its own
results, the same bits on both (the element-wise ops commute), with no fusion buffer and no
backend call. Inputs the other did not take (it had fewer ready) stay where they lie
(:class:`Lent`) and the next round hands them over again from there.

A slot is refilled only when the other member cannot be reading it:

* the slot of this member's last offer, once the other member's word in its arena head says
  it is done with every offer this member made (it sets the word after the reads of each
  round; :meth:`HandOver._done_reading`). That memory was just written and read, so it is
  still in the caches: a 4 MiB allreduce back to back took 0.25 ms with one slot against 0.5
  ms with the slots taking turns (np=2, the copy and the reduction alone). A caller that runs
  its own round waits briefly for the word; the engine thread does not (its time would come
  out of the training's);
* otherwise the other slot: the other member read it in an earlier round and has since sent
  this round's header, which it sends only after its reads. This is always safe, so a member
  that waits for the word waits only about as long as the other's reduction of the data
  takes before it takes the other slot instead.

The word is a plain store, which x86 keeps behind the loads before it; on other architectures
the slots just take turns. A round that runs work through the backend drops what was lent:
the backend's fusion buffer and staging share the slots' part of the arena.

A set of more members hands over small allreduces too, in the header only (``DATA``; the
exchange slots are a pair's): every member's header carries its inputs to every other member,
and each member reduces all of them in the order of the backend's recursive doubling
(``reduce_like_doubling``), so every member makes the same bits, and the backend's.
The one exchange of headers then replaces the backend's log2(n) exchanges after it, for
(n - 1) times the bytes, which pays where latency rules: up to the size the backend reduces
with those exchanges (:meth:`Executor.header_most`: in all, 64 KiB of inputs read per member
and round; where ranks outnumber cores, up to 64 KiB a tensor, since every wait for the others
is then a turn of every rank on a core, and the arena's staging takes two). With more ranks
than cores every message is a wake-up of a rank that may wait for a core (np=4 on two cores: 4
KiB in 1.1 ms before, docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import struct
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from hora.backends.base import SetComm
from hora.core.executor import EXCHANGE_MAX_BYTES, Executor, Spread, TensorEntry
from hora.core.messages import OpType, TensorSpec
from hora.core.response_cache import ResponseCache
from hora.errors import HoraInternalError
from hora.transport.shm.arena import STORES_IN_ORDER

Header = tuple[int, list[int], bytes | memoryview]  # a round's header, decoded: flags, ids, data

DATA = 2  # the header's flag: the inputs of its first tensors follow the ids
SHARED = 4  # the header's flag: the inputs of its first tensors lie in a shared exchange slot
SLOT1 = 8  # with SHARED: in slot 1 (else slot 0)
SPREAD = 64  # the header's flag: this member staged its one allreduce in the set's arena
# a round's header begins: its flags and the number of ids; the ids follow (uint32), then any
# data (hora.core.fastpath encodes and decodes it)
HEAD = struct.Struct("<BI")
# with DATA or SHARED, the header's data begins: how many tensors' inputs are handed over, and
# where they begin: in the slot (SHARED), or after this many bytes of padding (DATA), which put
# them at a multiple of 8 bytes from the header's start, so that the receiver reduces them
# where they lie in the message it received (aligned, as that begins aligned) without a copy
_OFFER = struct.Struct("<IQ")
_ALIGN = 8

# the other member's word may say "done" while its loads are still under way only where stores
# may pass earlier loads (STORES_IN_ORDER: x86 never lets them)
# offers from this size wait for the word (smaller ones stay in the caches either way), at most
# as long as the other member's reduction of them takes at this rate, and never longer than
# _WAIT_MAX seconds
_WAIT_MIN_BYTES = 256 << 10
_WAIT_BYTES_PER_S = 8e9
_WAIT_MAX = 0.002
# a pair's lane stages one allreduce from this size in the arena ahead of its header (_spread),
# rather than hand it over in an exchange slot: each member then reduces half of it, not all,
# for one signal more. Blocking allreduces, np=2, the two ways taking turns block by block in
# one job, slot / staged, ms: 96-192 KiB 0.046-0.052 / 0.048-0.053, 256 KiB 0.057 / 0.056-0.057,
# 512 KiB 0.076 / 0.071-0.072, 1 MiB 0.114-0.115 / 0.095-0.098, 2 MiB 0.189-0.192 /
# 0.146-0.149, 3 MiB 0.263-0.267 / 0.198-0.202 (above 3 MiB the slots never took one alone)
PAIR_SPREAD_MIN_BYTES = 256 << 10


class Lent:
    """Inputs this member put in an exchange slot that the other member has not reduced yet:
    the tensors' entries in order (the submissions themselves: a name submitted again is
    another entry), the bytes ``[start, end)`` of slot ``slot`` they fill. The next round
    hands them over again where they lie (and puts new ones after them), so a tensor is
    copied into a slot once however many rounds its turn takes."""

    __slots__ = ("slot", "entries", "start", "end", "dtype")

    def __init__(self, slot: int, entries: list[TensorEntry], end: int, dtype: Any) -> None:
        self.slot, self.entries, self.start, self.end = slot, entries, 0, end
        self.dtype = dtype


# an offer: table keys, specs, this member's inputs (header bytes or a slot view), whether in
# a slot, which, and from which byte
Offer = tuple[list[str], list[TensorSpec], Any, bool, int, int]


def encode_header(ids: Sequence[int], flags: int = 0, *data: Any) -> bytes:
    """A round's header: the flags, the ids, then ``data`` (byte-like parts, each copied
    once, into the header)."""
    return b"".join((HEAD.pack(flags, len(ids)), array("I", ids), *data))


def header_data(ids: int, count: int, inputs: np.ndarray) -> tuple[bytes, bytes, np.ndarray]:
    """The data of a ``DATA`` header with ``ids`` ids that hands over the inputs of ``count``
    tensors (``inputs``, one contiguous array), as parts for ``encode_header``: the offer, the
    padding that puts the inputs at a multiple of 8 bytes from the header's start, and the
    inputs as they lie (``encode_header`` copies each part once)."""
    pad = -(HEAD.size + 4 * ids + _OFFER.size) % _ALIGN
    return _OFFER.pack(count, pad), bytes(pad), inputs.reshape(-1).view(np.uint8)


def slot_offer(count: int, at: int) -> bytes:
    """The data of a ``SHARED`` header that hands over the inputs of ``count`` tensors, from
    byte ``at`` of the slot its flags name."""
    return _OFFER.pack(count, at)


def read_offer(data: Any) -> tuple[int, int]:
    """How many tensors' inputs a ``DATA`` or ``SHARED`` header's data hands over, and where
    they begin: their offset in the slot (``SHARED``), or the padding before them (``DATA``)."""
    count, at = _OFFER.unpack_from(data)
    return count, at


def handed_inputs(data: Any, pad: int) -> memoryview:
    """The inputs a ``DATA`` header's data hands over, after ``pad`` bytes of padding
    (:func:`read_offer`): a view of the header received, no copy."""
    return memoryview(data)[_OFFER.size + pad :]


@functools.lru_cache(maxsize=4096)
def lane_start(cid: int) -> bytes:
    """The start of a ``DATA`` header that hands over the inputs of one tensor, cache id
    ``cid``: its flags, id, offer and padding; the inputs follow. The same bytes on every
    member that hands over that tensor alone (:func:`handed_alike`)."""
    offer, pad, _ = header_data(1, 1, np.empty(0, np.uint8))
    return encode_header([cid], DATA, offer, pad)


def handed_alike(payloads: Sequence[Any], start: bytes, inputs: np.ndarray) -> list[Any] | None:
    """Every member's inputs of a lane's one tensor, in member order (``inputs``, this
    member's, where ``payloads`` has None), when every other member's header (``payloads``)
    is ``start`` followed by inputs of the same size (:func:`lane_start`), read where they lie;
    else None (:func:`mirrored` then looks at the decoded headers)."""
    k, size = len(start), len(start) + inputs.nbytes
    parts: list[Any] = []
    for got in payloads:
        if got is None:
            parts.append(inputs)
        elif len(got) == size and got[:k] == start:
            parts.append(np.frombuffer(got, inputs.dtype, offset=k))
        else:
            return None
    return parts


def exchange_run(specs: Sequence[TensorSpec | None], limit: int) -> int:
    """How many of a member's ready tensors, from the first, one hand-over carries:
    allreduces of one dtype, at most ``limit`` bytes together (the fusion threshold; the first
    goes in any case, so 0 carries one), cut before a group that is not all there. A group
    goes whole or not at all: a member settled on its own would leave the rest of its group
    to a round's plan, which waits for the whole group and so for ever."""
    n = total = 0
    first = ""
    for spec in specs:
        if spec is None or spec.request.op != OpType.ALLREDUCE:
            break
        req = spec.request
        if n and (req.dtype != first or total + req.nbytes > limit):
            break
        first = req.dtype
        n += 1
        total += req.nbytes
    if n:
        head = [s for s in specs[:n] if s is not None]
        whole = whole_groups(head)
        if len(whole) < n:
            n = next(i for i, s in enumerate(head) if i >= len(whole) or whole[i] is not s)
    return n


def whole_groups(specs: list[TensorSpec]) -> list[TensorSpec]:
    """``specs`` less the members of groups that are not all there (they wait)."""
    counts: dict[str, int] = {}
    for s in specs:
        if s.request.group_size > 1:
            counts[s.request.group] = counts.get(s.request.group, 0) + 1
    if not counts:
        return specs
    return [
        s for s in specs
        if s.request.group_size <= 1 or counts[s.request.group] >= s.request.group_size
    ]


def mirrored(headers: Sequence[Header], me: int, ranks: Sequence[int], ids: list[int],
             flags: int, inputs: np.ndarray,
             peer_slot: Callable[[int, int], np.ndarray]) -> list[np.ndarray] | None:  # fmt: skip
    """Every member's inputs of the lane's one tensor, in member order (``inputs``, this
    member's, at ``me``), when every other member's header hands over that tensor alone, as
    this member's does (``ids``, ``flags``); None if one does not. ``peer_slot(slot, at)``:
    the other member's inputs in its exchange slot ``slot`` from byte ``at`` (``SHARED``).
    ``ranks``: the members' ranks, for the error when one handed over a wrong size."""
    parts = []
    for member, (theirs, their_ids, data) in enumerate(headers):
        if member == me:
            parts.append(inputs)
            continue
        if their_ids != ids or theirs & ~SLOT1 != flags & ~SLOT1 or len(data) < _OFFER.size:
            return None
        count, at = read_offer(data)
        if count != 1:
            return None
        if flags & SHARED:
            got = peer_slot(1 if theirs & SLOT1 else 0, at)
        else:
            got = np.frombuffer(handed_inputs(data, at), inputs.dtype)
        if got.size != inputs.size:
            raise HoraInternalError(
                f"rank {ranks[member]} of the set handed over {got.nbytes} bytes of tensor "
                f"id {ids[0]} for {inputs.nbytes}")
        parts.append(got)
    return parts


class _Limits(Protocol):
    @property
    def fusion_threshold(self) -> int: ...


class Member(Protocol):
    """What the hand-over uses of a member's state (:class:`hora.core.fastpath.MemberState`)."""

    comm: SetComm
    cache: ResponseCache
    table: dict[str, TensorEntry]
    ready: dict[str, int]
    slot: int
    lent: Lent | None
    offered: int
    seen: int

    @property
    def direct(self) -> _Limits: ...


class HandOver:
    """The engine's side of the hand-over (a mixin of
    :class:`~hora.core.fastpath.DirectRounds`, whose state it uses as declared here)."""

    executor: Executor
    stats: dict[str, int]
    timeline: Any
    # a caller that waits for its op runs the round (DirectRounds._run_inline): its thread
    # has nothing else to do, where the engine thread's time is taken from the training's
    _caller_turn = False

    # provided by DirectRounds (its member state, hora.core.fastpath.MemberState)
    def _touch(self, ms: Member, ids: list[int]) -> None: ...
    def _exchange(self, ms: Any, mine: bytes, own: Header) -> list[Header]:
        raise NotImplementedError
    def _swap(self, ms: Any, mine: Sequence[Any]) -> list[Any]:
        raise NotImplementedError
    def _decoded(self, ms: Any, payloads: list[Any], own: Header) -> list[Header]:
        raise NotImplementedError
    def _settle(self, ms: Any, ids: list[int], offer: Offer | None,
                headers: list[Header]) -> None: ...  # fmt: skip
    def _remember(self, ms: Any, entry: TensorEntry, cid: int, spec: TensorSpec,
                  start: bytes) -> None: ...  # fmt: skip

    def _lane(self, ms: Any) -> bool:
        """A round in the steady state of one allreduce at a time (a blocking call, its
        caller's round; or one async op, the engine thread's): the one tensor this member
        holds is a cached allreduce that one hand-over carries (in the header; in a pair, or
        in an exchange slot), so the round is that header and the others'. It is
        the header :meth:`_offer_data` would make; when every other's mirrors it (the same one
        tensor, handed over), the result is reduced here and the round is done, without the
        general round's lists, plans and offers; else the round goes on as any other
        (:meth:`_settle`). False, and nothing sent, when this is not that steady state (the
        round is then a general one). In the header, the inputs follow a start that is the
        same on every member handing over the same tensor (:func:`lane_start`): the others'
        headers are compared with it and their inputs reduced where they lie (in a set's
        mailboxes, without a copy), not decoded (:func:`handed_alike`)."""
        comm = ms.comm
        n = len(comm.ranks)
        if (n < 2 or self.timeline is not None or len(ms.ready) != 1
                or len(ms.table) != 1 or ms.other or ms.barrier or ms.lent is not None):
            return False
        ((key, cid),) = ms.ready.items()
        spec, entry = ms.cache.get(cid), ms.table.get(key)
        if spec is None or entry is None or entry.array is None or entry.ready is not None:
            return False
        req, ex = spec.request, self.executor
        if req.op != OpType.ALLREDUCE or req.group_size > 1:
            return False
        # whether one hand-over carries it: in the header (or, in a pair, an exchange slot)
        if n == 2:
            carried = ex.exchange_takes(comm, req.nbytes, 1)
            staged = req.nbytes >= PAIR_SPREAD_MIN_BYTES or not carried
        else:
            carried = req.nbytes <= ex.header_most(comm)
            staged = not carried
        if staged and (n > 2 or self._offers_read(ms)):
            spread = ex.spread_in(comm, spec, entry)
            if spread is not None:
                return self._spread(ms, key, cid, spec, entry, spread)
        if not carried:
            return False
        array = entry.array.reshape(-1)
        if req.nbytes <= EXCHANGE_MAX_BYTES and req.prescale == 1.0:
            inputs, slot = array, -1  # in the header as they lie: no copy
        else:  # prescaled in a copy, or in a slot, as the general offer lays them out
            slot = self._free_slot(ms, req.nbytes) if req.nbytes > EXCHANGE_MAX_BYTES else 0
            got = ex.exchange_input(comm, [spec], [entry], slot)
            if got is None:
                return False
            inputs, slot = got[0], slot if got[1] else -1
        self.stats["direct_rounds"] += 1
        ids = [cid]
        parts = None
        if slot < 0:  # the inputs follow the header's start (the same bytes on every member)
            flags, start = DATA, lane_start(cid)
            payloads = self._swap(ms, (start, inputs.view(np.uint8)))
            parts = handed_alike(payloads, start, inputs)
            if parts is None:  # some other header: copied out of the mailboxes, decoded
                headers = self._decoded(ms, payloads, (flags, ids, b""))
        else:  # as _offer and _offer_data keep the books of a slot
            self._lend(ms, slot, [entry], inputs)
            ms.offered += 1
            flags = SHARED | (SLOT1 if slot else 0)
            headers = self._exchange(ms, encode_header(ids, flags, slot_offer(1, 0)),
                                     (flags, ids, b""))
        if parts is None:
            parts = mirrored(headers, comm.rank, comm.ranks, ids, flags, inputs,
                             lambda slot, at: ex.exchange_peer(comm, slot, at, inputs.size,
                                                               inputs.dtype))
        if parts is None:
            # what _offer would have made: the inputs in a copy (the round may not run them)
            mine = array.copy() if inputs is array else inputs
            self._settle(ms, ids, ([key], [spec], mine, slot >= 0, max(slot, 0), 0), headers)
            return True
        del ms.ready[key]
        self._touch(ms, ids)
        self.stats["responses"] += 1
        self.stats["exchanged" if slot < 0 else "exchanged_shared"] += 1
        self.stats["lane"] += 1
        if inputs is array and self._caller_turn:  # as they lie: the caller's next call of it
            self._remember(ms, entry, cid, spec, lane_start(cid))  # may take the express lane
        # never made over inputs that lie in the caller's array or in the slot
        result = ex.handed(spec, entry.output, entry.output is entry.array, parts, comm.rank,
                           inputs is array or slot >= 0)
        if slot >= 0:
            ms.lent = None
            self._done_reading(ms)
        del ms.table[key]
        entry.complete(result)
        return True

    def _spread(self, ms: Any, key: str, cid: int, spec: TensorSpec, entry: TensorEntry,
                spread: Spread) -> bool:  # fmt: skip
        """The lane for an allreduce that the backend stages through the set's shared arena
        (in a pair, one the exchange slots do not take, once the other member is done with
        this one's slots: :meth:`_offers_read`): this member staged its input's first segment
        before its header (:meth:`Executor.spread_in`), so when every other header says the
        same (the same one tensor, ``SPREAD``), every member's is staged, and the backend's
        steps go on from there (:meth:`Executor.spread_finish`): the header stands for the
        signal those steps begin with, one wait for the others fewer. Any other header: the
        round goes on as any other (the backend stages the tensor again)."""
        comm = ms.comm
        self.stats["direct_rounds"] += 1
        ids = [cid]
        mine = encode_header(ids, SPREAD)
        payloads = self._swap(ms, (mine,))
        if any(got is not None and got != mine for got in payloads):  # not all the same
            self._settle(ms, ids, None, self._decoded(ms, payloads, (SPREAD, ids, b"")))
            return True
        del ms.ready[key]
        self._touch(ms, ids)
        self.stats["responses"] += 1
        self.stats["lane"] += 1
        self.stats["spread"] += 1
        result = self.executor.spread_finish(comm, spec, spread)
        del ms.table[key]
        entry.complete(result)
        return True

    def _offer_data(self, ms: Member, ids: list[int]) -> tuple[Offer | None, int, tuple[Any, ...]]:
        """What this member's header hands over in a round: the offer (None: nothing), the
        header's flags for it and the data that follows the ids (byte-like parts)."""
        offer = self._offer(ms, ids) if ms.comm.size == 2 else self._offer_many(ms, ids)
        if offer is None:
            return None, 0, ()
        if offer[3]:  # in the shared arena
            ms.offered += 1
            return offer, SHARED | (SLOT1 if offer[4] else 0), (slot_offer(len(offer[1]),
                                                                           offer[5]),)
        return offer, DATA, header_data(len(ids), len(offer[1]), offer[2])

    def _handed_over(self, ms: Member, ids: list[int], offer: Offer | None,
                     headers: list[Header]) -> bool:  # fmt: skip
        """Every member's header is in: finish what all handed over (True: the round then
        runs nothing else), and tell the other member of a pair this one is done with its
        slot."""
        taken = offer is not None and self._take_offers(ms, ids, offer, headers)
        if ms.comm.size == 2 and headers[1 - ms.comm.rank][0] & SHARED:
            self._done_reading(ms)
        return taken

    def _done_reading(self, ms: Member) -> None:
        """Every offer the other member made so far is read (or not taken, and so not read
        this round): its word says so, and the last slot it filled may be refilled."""
        ms.seen += 1
        words = self.executor.exchange_words(ms.comm)
        if words is not None:
            words[ms.comm.rank][0] = ms.seen

    def _offers_read(self, ms: Member) -> bool:
        """Whether the other member of a pair is done with every offer this member made in an
        exchange slot (its word says so), so that this member's part of the arena is its own
        until its next header (:meth:`_spread` stages there before it). A caller that waits
        for its op anyway waits for the word up to :data:`_WAIT_MAX` seconds."""
        return not ms.offered or bool(self._read_by_other(ms, _WAIT_MAX))

    def _free_slot(self, ms: Member, nbytes: int) -> int:
        """The slot a fresh offer of ``nbytes`` fills: the last one's, if the other member is
        done with it (a caller that waits for its op anyway waits briefly for that, from
        :data:`_WAIT_MIN_BYTES`), else the other."""
        if not ms.offered:
            return ms.slot
        wait = min(nbytes / _WAIT_BYTES_PER_S, _WAIT_MAX) if nbytes >= _WAIT_MIN_BYTES else 0.0
        return ms.slot ^ 1 if self._read_by_other(ms, wait) else ms.slot

    def _read_by_other(self, ms: Member, wait: float) -> bool | None:
        """Whether the other member of a pair has read every offer this member made in an
        exchange slot (its word in its arena head says so), waiting for the word up to
        ``wait`` seconds where the caller waits for its op anyway; None where no word can say
        (no arena open, or stores that other cores may see out of order)."""
        words = self.executor.exchange_words(ms.comm) if STORES_IN_ORDER else None
        if words is None:
            return None
        theirs = words[1 - ms.comm.rank]
        if theirs[0] < ms.offered and wait > 0 and self._caller_turn:
            deadline = time.perf_counter() + wait
            while theirs[0] < ms.offered and time.perf_counter() < deadline:
                pass
        return bool(theirs[0] >= ms.offered)

    def _offer(self, ms: Member, ids: list[int]) -> Offer | None:
        """The inputs this member hands over with its header in a two-member round: those of
        the first ready tensors that one hand-over carries (:func:`exchange_run`), where the
        last round left them in a slot if it did not take them all, else in a free slot
        (:meth:`_free_slot`) or, small, in the header."""
        keys = list(ms.ready)
        specs = [ms.cache.get(cid) for cid in ids]
        n = exchange_run(specs, ms.direct.fusion_threshold)
        lent, ms.lent = ms.lent, None
        ex, comm = self.executor, ms.comm
        run = [s for s in specs[:n] if s is not None]
        nbytes = sum(s.request.nbytes for s in run)
        # a run the slots do not serve goes to the backend whole (cut at the slot, ResNet-50's
        # grouped gradients took a round per tensor): known before anything is laid out
        if n == 0 or not ex.exchange_takes(comm, nbytes, n):
            return None
        keys = keys[:n]
        entries = [ms.table[k] for k in keys]
        k = 0 if lent is None else len(lent.entries)
        if lent is not None and k <= n and all(a is b for a, b in zip(entries, lent.entries)):
            # the same entries lead, so the run's one dtype is the lent inputs' own
            more = None if k == n else ex.exchange_input(comm, run[k:], entries[k:], lent.slot,
                                                         lent.end)
            if k == n or (more is not None and more[1]):
                if more is not None:
                    lent.end += more[0].nbytes
                lent.entries = entries
                mine = ex.exchange_view(comm, lent.slot, lent.start,
                                        (lent.end - lent.start) // lent.dtype.itemsize,
                                        lent.dtype, comm.rank)
                ms.lent = lent
                return keys, run, mine, True, lent.slot, lent.start
        slot = self._free_slot(ms, nbytes)
        got = ex.exchange_input(comm, run, entries, slot)
        if got is None:
            return None
        if got[1]:
            self._lend(ms, slot, entries, got[0])
        return keys, run, got[0], got[1], slot, 0

    def _lend(self, ms: Member, slot: int, entries: list[TensorEntry],
              inputs: np.ndarray) -> None:  # fmt: skip
        """``entries``' inputs now fill slot ``slot`` from its start (``inputs``), lent to the
        other member until it takes them; the next fresh offer goes in the other slot unless
        the other member is done with this one (:meth:`_free_slot`)."""
        ms.lent = Lent(slot, entries, inputs.nbytes, inputs.dtype)
        if slot != ms.slot:
            self.stats["slot_reused"] += 1
        ms.slot = slot ^ 1

    def _offer_many(self, ms: Member, ids: list[int]) -> Offer | None:
        """The inputs this member's header carries in a round of more than two members: those
        of the first ready tensors (:func:`exchange_run`) up to the size the backend reduces
        with its small-message path (:meth:`Executor.header_most`), in the header only."""
        limit = self.executor.header_most(ms.comm)
        specs = [ms.cache.get(cid) for cid in ids]
        n = exchange_run(specs, min(limit, ms.direct.fusion_threshold))
        run = [s for s in specs[:n] if s is not None]
        if n == 0 or sum(s.request.nbytes for s in run) > limit:
            return None
        keys = list(ms.ready)[:n]
        got = self.executor.exchange_input(ms.comm, run, [ms.table[k] for k in keys], 0)
        if got is None or got[1]:
            return None
        return keys, run, got[0], False, 0, 0

    def _take_offers(self, ms: Member, ids: list[int], offer: Offer,
                     headers: list[Header]) -> bool:  # fmt: skip
        """Finish the tensors at the head of every member's list whose inputs all handed over
        (the round then runs nothing else); False if there are none. Every member finds the
        same ones, from the same headers."""
        keys, specs, mine, shared, _, _ = offer
        me, n = ms.comm.rank, len(specs)
        offers = []
        for member, (flags, their_ids, data) in enumerate(headers):
            if member == me:
                continue
            if not flags & (DATA | SHARED) or len(data) < _OFFER.size:
                return False
            count, at = read_offer(data)
            most, n = min(n, count), 0
            while n < most and their_ids[n] == ids[n]:
                n += 1
            if n == 0:
                return False
            offers.append((flags, at, data))
        keys, specs = keys[:n], specs[:n]
        nbytes = sum(s.request.nbytes for s in specs)
        inputs: list[Any] = []  # every member's, in member order
        for flags, at, data in offers:
            if flags & SHARED:
                inputs.append(self.executor.exchange_peer(
                    ms.comm, 1 if flags & SLOT1 else 0, at, nbytes // mine.itemsize, mine.dtype))
            else:
                inputs.append(handed_inputs(data, at))
        entries = [ms.table[k] for k in keys]
        for k in keys:
            del ms.ready[k]
        self._touch(ms, ids[:n])
        self.stats["responses"] += 1
        self.stats["exchanged_shared" if shared else "exchanged"] += 1
        if n > 1:
            self.stats["fused"] += n
            self.stats["exchanged_many"] += 1
        tl = self.timeline
        if tl is not None:
            for s in specs:
                tl.negotiate_end(s.request.name)
                tl.start(s.request.name, "ALLREDUCE")
        inputs.insert(me, mine)
        results = self.executor.finish_exchange(specs, entries, inputs, me, shared)
        lent = ms.lent
        if lent is not None:  # what the other took from the slot is done with
            lent.entries = lent.entries[n:]
            lent.start += nbytes
            if not lent.entries:
                ms.lent = None
        for k, e, r in zip(keys, entries, results):
            del ms.table[k]
            e.complete(r)
        if tl is not None:
            fused = nbytes if n > 1 else 0
            for s in specs:
                tl.end(s.request.name, s.request.dtype, s.request.shape, fused)
        return True
