"""Allreduce over a shared arena: every member's buffer is mapped by every member (one host).

1. Every member tells every other that its buffer holds its input (a message on each pair).
2. Member ``i`` reduces block ``i`` of all the buffers into its own buffer, piece by piece, and
   writes each reduced piece into every other member's buffer while it is still in cache.
3. Every member tells every other that it is done: every buffer now holds the whole result.

Plain loads and stores on mapped memory: no system call per piece (a single-copy read makes
one), no copy through a staging area, and each byte is read once and written once per member.
Each block is reduced by one member only, so all members end with the same bits. The two
messages also keep the buffers safe to reuse: nobody reads a buffer before its owner says it
holds the next input, and nobody's result is read before every member has written its block.

Given the arena's words (``words``), the two messages are words instead: each member counts its
signals in its word :data:`SIGNAL_WORD` and waits until every other member's count has come as
far (:func:`hora.transport.shm.waiting.wait_words`), where other cores see plain stores in the
order they were made (x86). A message to each other member and one from each costs a system
call and often a wake-up apiece, which at 16 members came to most of an allreduce of 1 MiB; a
word costs a store, and a load per member polled.

:func:`allreduce_staged` does the same for a buffer outside the arena (a single tensor), with
one copy into the arena and one copy of the other members' blocks out of it.
:func:`allreduce_posted`, for small buffers where ranks outnumber cores, posts each member's
buffer in its mailbox of the arena, and every member reduces all of them: one wait.

``views[i]`` is member ``i``'s buffer (:meth:`hora.transport.shm.arena.Arena.views`); every
member calls these with buffers of the same size, in the same order as every collective. Runs
on the calling (engine) thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np

from hora.collectives.allreduce_recursive_doubling import reduce_like_doubling
from hora.collectives.base import Comm, offsets_of, split_even
from hora.collectives.reduce_ops import Reducer
from hora.transport import tally
from hora.transport.shm.arena import STORES_IN_ORDER
from hora.transport.shm.mailbox import COUNT_WORD, Mailboxes
from hora.transport.shm.waiting import peer_closed, wait_words

PIECE_BYTES = 256 << 10  # reduced, then written to the others, while in cache
SIGNAL_WORD = 1  # the arena word a member counts its signals in (word 0: hora.core.handover)

Words = Sequence[np.ndarray] | None  # every member's arena words, or None (messages)


def allreduce_mapped(comm: Comm, views: Sequence[np.ndarray], reduce: Reducer,
                     words: Words = None) -> None:  # fmt: skip
    """Reduce the members' ``views`` into every one of them (see the module doc)."""
    n, me = comm.size, comm.rank
    if n == 1:
        return
    signal(comm, words)
    _reduce_block(comm, views[me], views, reduce)
    signal(comm, words)


def allreduce_posted(comm: Comm, buf: np.ndarray, boxes: Mailboxes, words: Sequence[np.ndarray],
                     reduce: Reducer, out: np.ndarray | None = None) -> None:  # fmt: skip
    """Reduce every member's ``buf`` (1-D; into ``out``, or in place) after one wait for the
    others: each member posts its input in its mailbox of the arena
    (:class:`~hora.transport.shm.mailbox.Mailboxes`, whose turns direct mode's headers take
    too) and reduces every member's where it lies, in the order of recursive doubling
    (:func:`reduce_like_doubling`), so with the bits of :func:`allreduce_recursive_doubling`.
    Every member reduces all of it, which pays where ranks outnumber cores
    (hora.backends.native): each wait for the others is then a turn of every rank on a core,
    and recursive doubling takes log2(n) of them, the staged path two. ``buf`` must fit a
    mailbox."""
    n, me = comm.size, comm.rank
    if buf.nbytes > boxes.capacity:
        raise ValueError(f"{buf.nbytes} bytes do not fit a mailbox of {boxes.capacity}")
    count = boxes.begin((buf.view(np.uint8),))[0]
    boxes.commit(count)
    wait_words(words, COUNT_WORD, count, [j for j in range(n) if j != me], partial(_check, comm))
    parts = [buf if j == me else np.frombuffer(boxes.take(j, count, comm.pair(j)), buf.dtype)
             for j in range(n)]  # fmt: skip
    reduce_like_doubling(parts, reduce, buf if out is None else out)
    counts = tally.counts  # copied into this member's mailbox; read from every other's
    counts[tally.MAPPED + tally.COPIED] += buf.nbytes
    counts[tally.MAPPED + tally.RECEIVED] += (n - 1) * buf.nbytes


def allreduce_staged(
    comm: Comm,
    buf: np.ndarray,
    views: Sequence[np.ndarray],
    reduce: Reducer,
    out: np.ndarray | None = None,
    words: Words = None,
) -> None:
    """Reduce every member's ``buf`` in place through the arena (``views``: every member's
    part, laid out as ``buf``): each member copies the others' blocks of its input into its
    part (its own block is read where it lies, and nobody else reads it), reduces its block
    straight into ``buf``, writes the reduced block into the others' parts, and at the end
    copies the others' blocks out of its own part. The others' blocks copied in and out,
    around :func:`allreduce_mapped`'s work. With ``out``, the result goes there and ``buf`` is
    only read. A ``buf`` longer than the ``views`` goes through in segments of their size, one
    after another."""
    if comm.size == 1:
        if out is not None:
            np.copyto(out, buf)
        return
    step = max(views[0].size, 1)
    for a in range(0, buf.size, step):
        b = min(a + step, buf.size)
        seg = [v[: b - a] for v in views]
        _staged(comm, buf[a:b], seg, reduce, None if out is None else out[a:b], words)


def _staged(comm: Comm, buf: np.ndarray, views: Sequence[np.ndarray], reduce: Reducer,
            out: np.ndarray | None, words: Words) -> None:  # fmt: skip
    """One segment of :func:`allreduce_staged` (``views`` of ``buf``'s size)."""
    stage_in(comm, buf, views)
    signal(comm, words)
    staged_rest(comm, buf, views, reduce, out, words)


def stage_in(comm: Comm, buf: np.ndarray, views: Sequence[np.ndarray]) -> None:
    """The first step of a segment of :func:`allreduce_staged`: the other members' blocks of
    ``buf`` into this member's part (``views``, of ``buf``'s size). The part is this member's
    alone until it tells the others it is done (the signal that follows; or, in direct mode,
    the round's header: hora.core.handover), since every other member is done with it once
    it has signalled the end of the last collective."""
    n, me = comm.size, comm.rank
    bounds = offsets_of(split_even(buf.size, n))
    mine = views[me]
    for j in range(n):
        if j != me:
            mine[bounds[j] : bounds[j + 1]] = buf[bounds[j] : bounds[j + 1]]


def staged_rest(comm: Comm, buf: np.ndarray, views: Sequence[np.ndarray], reduce: Reducer,
                out: np.ndarray | None, words: Words) -> None:  # fmt: skip
    """The rest of a segment of :func:`allreduce_staged` once every member has staged its
    input (:func:`stage_in`) and knows the others have: this member's block reduced and
    written into the others' parts, the signal that they are all done, and the others'
    reduced blocks copied out of this member's part."""
    n, me = comm.size, comm.rank
    res = buf if out is None else out
    bounds = _reduce_block(comm, res, views, reduce, None if out is None else buf)
    signal(comm, words)
    mine = views[me]
    for j in range(n):
        if j != me:
            res[bounds[j] : bounds[j + 1]] = mine[bounds[j] : bounds[j + 1]]
    # the others' blocks, copied in and out
    own = (bounds[me + 1] - bounds[me]) * buf.itemsize
    tally.counts[tally.MAPPED + tally.COPIED] += 2 * (buf.nbytes - own)


def _reduce_block(
    comm: Comm,
    acc: np.ndarray,
    views: Sequence[np.ndarray],
    reduce: Reducer,
    src: np.ndarray | None = None,
) -> list[int]:
    """Reduce this member's block of the others' ``views`` into ``acc`` (which holds this
    member's input, or with ``src``, gets ``src`` reduced with them), piece by piece, writing
    each reduced piece into the others' views while it is in cache. Returns the blocks'
    bounds."""
    n, me = comm.size, comm.rank
    bounds = offsets_of(split_even(acc.size, n))
    step = max(PIECE_BYTES // acc.itemsize, 1)
    others = [views[(me + k) % n] for k in range(1, n)]
    for a in range(bounds[me], bounds[me + 1], step):
        b = min(a + step, bounds[me + 1])
        piece = acc[a:b]
        first = 0
        if src is not None:
            reduce(src[a:b], others[0][a:b], out=piece)
            first = 1
        for v in others[first:]:
            reduce(piece, v[a:b])
        for v in others:
            v[a:b] = piece
    moved = (n - 1) * (bounds[me + 1] - bounds[me]) * acc.itemsize
    counts = tally.counts  # read from every other member's buffer, written into each
    counts[tally.MAPPED + tally.RECEIVED] += moved
    counts[tally.MAPPED + tally.SENT] += moved
    counts[tally.MAPPED + tally.COPIED] += moved
    return bounds


def signal(comm: Comm, words: Words = None) -> None:
    """Tell every other member this one got here, then wait until each of them has: with a
    message on each pair, or through the arena's ``words`` (see the module doc)."""
    me = comm.rank
    peers = [j for j in range(comm.size) if j != me]
    if words is not None and STORES_IN_ORDER:
        mine = words[me]
        count = int(mine[SIGNAL_WORD]) + 1
        mine[SIGNAL_WORD] = count  # after this member's stores, which others now see
        wait_words(words, SIGNAL_WORD, count, peers, partial(_check, comm))
        return
    for j in peers:
        comm.pair(j).send_msg(b"")
    for j in peers:
        comm.pair(j).recv_msg()


def _check(comm: Comm, j: int) -> None:
    """Raise if member ``j``, awaited in a signal, is gone: its pair's end is closed."""
    pair = comm.pair(j)
    if peer_closed(pair.fileno()):
        pair.recv_msg()  # reads the end: raises TransportError naming the member
        raise AssertionError("a closed connection delivered a message")
