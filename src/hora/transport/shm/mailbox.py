"""Mailboxes: a message for every other member of a one-host set, written once.

Where a member sends the same message to each of the others (a direct-mode round's header,
:mod:`hora.core.fastpath`), a message on every pair costs a system call per member on each side,
and often a wake-up. Through the set's shared arena (:mod:`hora.transport.shm.arena`) the member
writes it once into a mailbox of its own part and then counts it in its word
:data:`COUNT_WORD`; the others see the count, and copy the message out. Other cores see plain
stores in the order they were made only on x86 (:data:`~hora.transport.shm.arena.STORES_IN_ORDER`),
so only there.

The members post in lockstep: every member posts one message per turn, and reads every other
member's before it posts its next. So a member is at most one message ahead of any other, and
two mailboxes, taking turns, are enough: message ``k`` goes in mailbox ``k % 2``, which the
member writes again only at ``k + 2``, after every other member has posted ``k + 1``, which
each does only once it has read ``k``. A message larger than a mailbox goes on every pair
instead, before its count (the mailbox then says so), so that it is on the pair before any
later message from the same member.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hora.errors import TransportError
from hora.transport.base import Pair
from hora.transport.shm.arena import Arena

COUNT_WORD = 2  # the arena word a member counts its posts in (0, 1: hora.core.handover,
# hora.collectives.allreduce_mapped)
# the post's count, then its bytes (ON_PAIRS: sent on the pairs), padded to 40 bytes: what is
# posted begins at a multiple of 8 bytes, where an array of any dtype lies aligned (misaligned
# float64 sums take twice as long), and the inputs a round's header hands over, 24 bytes into it
# (hora.core.handover.lane_start), at the start of a cache line
_ENTRY = struct.Struct("<qI28x")
ON_PAIRS = 0xFFFFFFFF
_COUNT = struct.Struct("<q")


@dataclass(frozen=True)
class Lane:
    """Posts of ``start`` followed by ``nbytes`` of inputs, the same on every member (a lane's
    one tensor, :func:`hora.core.handover.lane_start`), laid out in the mailboxes once: by the
    post's parity (``count & 1``), this member's mailbox, every other member's head (its
    count, size and ``start``), and every member's inputs where they lie, as ``dtype`` (None
    at this member's place)."""

    at: int  # where the inputs begin in a mailbox
    end: int
    tail: bytes  # a post's head after its count
    mine: tuple[memoryview, memoryview]
    heads: tuple[list[memoryview], list[memoryview]]
    inputs: tuple[list[np.ndarray | None], list[np.ndarray | None]]


class Mailboxes:
    """A member's posts to, and reads from, every other member of a set's shared arena."""

    def __init__(self, arena: Arena) -> None:
        self.rank = arena.rank
        # the members' words as memoryviews: an item read or written costs a third of a NumPy
        # array's (a round reads and writes the counts a few times)
        self._words = [w.data for w in arena.words()]
        self._theirs = [w for m, w in enumerate(self._words) if m != self.rank]
        # as memoryviews: a slice of one, or a copy into one, costs less than of an array
        self._boxes = tuple([b.data for b in arena.mailboxes(k)] for k in (0, 1))
        self.capacity = len(self._boxes[0][self.rank]) - _ENTRY.size

    def begin(self, parts: Sequence[Any]) -> tuple[int, bool]:
        """Write this member's next post, the byte-like ``parts`` one after the other: its
        count, and whether they fit the mailbox (if not, the caller sends them on every
        pair). :meth:`commit` then makes it seen."""
        me = self.rank
        count = self._words[me][COUNT_WORD] + 1
        box = self._boxes[count & 1][me]
        at, end = _ENTRY.size, len(box)
        for part in parts:
            view = memoryview(part).cast("B")
            to = at + len(view)
            if to > end:  # on the pairs (what is written of it here is never read)
                _ENTRY.pack_into(box, 0, count, ON_PAIRS)
                return count, False
            box[at:to] = view
            at = to
        _ENTRY.pack_into(box, 0, count, at - _ENTRY.size)
        return count, True

    def lane(self, start: bytes, nbytes: int, dtype: np.dtype) -> Lane | None:
        """The :class:`Lane` of posts of ``start`` then ``nbytes`` of ``dtype``; None where
        they do not fit a mailbox."""
        if len(start) + nbytes > self.capacity:
            return None
        at = _ENTRY.size + len(start)
        end = at + nbytes
        tail = _ENTRY.pack(0, end - _ENTRY.size)[_COUNT.size :] + start
        count = nbytes // dtype.itemsize
        others = [m for m in range(len(self._words)) if m != self.rank]
        return Lane(
            at, end, tail,
            (self._boxes[0][self.rank], self._boxes[1][self.rank]),
            ([self._boxes[0][m][:at] for m in others], [self._boxes[1][m][:at] for m in others]),
            tuple([None if m == self.rank else np.frombuffer(box, dtype, count, at)
                   for m, box in enumerate(self._boxes[k])] for k in (0, 1)),  # type: ignore[arg-type]
        )  # fmt: skip

    def lane_round(self, lane: Lane, inputs: Any, look_s: float,
                   yielding: bool) -> tuple[int, list[np.ndarray | None] | None]:  # fmt: skip
        """Post ``lane``'s header with ``inputs`` (bytes, as many as it says), as :meth:`begin`
        and :meth:`commit` would, then look for every other member's post for up to
        ``look_s`` seconds (giving the core to any other runnable thread between looks where
        ``yielding``): its count, and every member's inputs where they lie, as
        :meth:`lane_inputs` gives them, where every other member posted ``lane``'s header
        meanwhile; else None (the caller waits for the posts as for any, and reads what they
        say: :meth:`lane_inputs`, :meth:`take`). A round's steps in one call: a blocking loop
        of one allreduce makes it every call."""
        word = self._words[self.rank]
        count = word[COUNT_WORD] + 1
        k = count & 1
        head = _COUNT.pack(count) + lane.tail
        box = lane.mine[k]
        box[: lane.at] = head
        box[lane.at : lane.end] = inputs
        word[COUNT_WORD] = count
        for other in self._theirs:
            if other[COUNT_WORD] < count and not self._looked(count, look_s, yielding):
                return count, None
        return count, self.lane_inputs(lane, count, head)

    def _looked(self, count: int, look_s: float, yielding: bool) -> bool:
        """Whether every other member posts its post ``count`` within ``look_s`` seconds,
        looking again and again (yielding the core between looks where ``yielding``)."""
        until = time.perf_counter() + look_s
        while True:
            if yielding:
                os.sched_yield()
            if self.all_posted(count):
                return True
            if time.perf_counter() >= until:
                return False

    def lane_inputs(self, lane: Lane, count: int,
                    head: bytes | None = None) -> list[np.ndarray | None] | None:  # fmt: skip
        """Every member's inputs where they lie (None at this member's place) when every
        other member's post ``count``, posted (:meth:`posted`), is ``lane``'s (its head the
        same bytes as ``head``, the post's head where the caller made it already); else None
        (:meth:`take` then says what they posted)."""
        k = count & 1
        want = _COUNT.pack(count) + lane.tail if head is None else head
        for theirs in lane.heads[k]:
            if theirs != want:
                return None
        return lane.inputs[k]

    def all_posted(self, count: int) -> bool:
        """Whether every other member has posted its post ``count``."""
        for word in self._theirs:  # noqa: SIM110 (a loop costs less than all() of a generator)
            if word[COUNT_WORD] < count:
                return False
        return True

    def commit(self, count: int) -> None:
        """The others may read post ``count`` (its message is written, or sent on the pairs)."""
        self._words[self.rank][COUNT_WORD] = count

    def posted(self, member: int, count: int) -> bool:
        """Whether ``member`` has posted its post ``count``."""
        return self._words[member][COUNT_WORD] >= count

    def take(self, member: int, count: int, pair: Pair) -> Any:
        """``member``'s post ``count`` (:meth:`posted`): a view of its mailbox, which holds the
        post until this member posts its next one (the member writes this mailbox again only
        once every other member has posted after this one, which this member does next), or
        the bytes from ``pair``. A caller that keeps it longer copies it."""
        box = self._boxes[count & 1][member]
        got, nbytes = _ENTRY.unpack_from(box, 0)
        if got != count:
            raise TransportError(f"mailbox of set member {member} holds post {got}, not {count}: "
                                 "the members' posts are out of step")
        if nbytes == ON_PAIRS:
            return pair.recv_msg()
        if nbytes > self.capacity:
            raise TransportError(f"mailbox of set member {member} says {nbytes} bytes")
        return box[_ENTRY.size : _ENTRY.size + nbytes]
