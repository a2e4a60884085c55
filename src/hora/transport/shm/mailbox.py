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

import struct

import numpy as np

from hora.errors import TransportError
from hora.transport.base import Pair
from hora.transport.shm.arena import Arena

COUNT_WORD = 2  # the arena word a member counts its posts in (0, 1: hora.core.handover,
# hora.collectives.allreduce_mapped)
_ENTRY = struct.Struct("<qI")  # the post's count, then its bytes (ON_PAIRS: sent on the pairs)
ON_PAIRS = 0xFFFFFFFF


class Mailboxes:
    """A member's posts to, and reads from, every other member of a set's shared arena."""

    def __init__(self, arena: Arena) -> None:
        self.rank = arena.rank
        self._words = arena.words()
        self._boxes = (arena.mailboxes(0), arena.mailboxes(1))
        self.capacity = len(self._boxes[0][self.rank]) - _ENTRY.size

    def begin(self, payload: bytes) -> tuple[int, bool]:
        """Write this member's next post: its count, and whether ``payload`` fits the mailbox
        (if not, the caller sends it on every pair). :meth:`commit` then makes it seen."""
        me = self.rank
        count = int(self._words[me][COUNT_WORD]) + 1
        box = self._boxes[count & 1][me]
        fits = len(payload) <= self.capacity
        if fits:
            box[_ENTRY.size : _ENTRY.size + len(payload)] = np.frombuffer(payload, np.uint8)
        _ENTRY.pack_into(box, 0, count, len(payload) if fits else ON_PAIRS)  # type: ignore[arg-type]
        return count, fits

    def commit(self, count: int) -> None:
        """The others may read post ``count`` (its message is written, or sent on the pairs)."""
        self._words[self.rank][COUNT_WORD] = count

    def posted(self, member: int, count: int) -> bool:
        """Whether ``member`` has posted its post ``count``."""
        return bool(self._words[member][COUNT_WORD] >= count)

    def take(self, member: int, count: int, pair: Pair) -> bytes:
        """``member``'s post ``count`` (:meth:`posted`), from its mailbox or from ``pair``."""
        box = self._boxes[count & 1][member]
        got, nbytes = _ENTRY.unpack_from(box, 0)  # type: ignore[arg-type]
        if got != count:
            raise TransportError(f"mailbox of set member {member} holds post {got}, not {count}: "
                                 "the members' posts are out of step")
        if nbytes == ON_PAIRS:
            return pair.recv_msg()
        if nbytes > self.capacity:
            raise TransportError(f"mailbox of set member {member} says {nbytes} bytes")
        return box[_ENTRY.size : _ENTRY.size + nbytes].tobytes()
