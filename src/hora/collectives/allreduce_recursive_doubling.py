"""Recursive-doubling allreduce: the latency-optimal algorithm for small buffers.

With ``p`` the largest power of two not above ``size`` and ``extra = size - p``: the first
``2 extra`` ranks pair up and each even one hands its buffer to its odd neighbour (and later
gets the result back), leaving ``p`` ranks. Those exchange their whole buffer with the rank
``2^k`` away and reduce, for ``k = 0 .. log2(p) - 1``. Cost: ``log2(p)`` exchanges of the
whole buffer (plus two one-way transfers on the folded ranks), i.e. ``nbytes log2(p)`` per
rank: best at or below a few tens of KiB, where latency dominates.

Small exchanges use blocking ``send`` then ``recv_into`` on the calling thread (no thread
hand-off); both peers send first, which is safe while the whole buffer fits in the kernel's
socket buffers (``EAGER_BYTES``); larger ones send in the background. Both peers reduce the
same two operands (in opposite order; the ops are commutative), so every rank gets the same
bits.

Runs on the calling (engine) thread; thread-safe for distinct Comms and buffers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hora.collectives.base import EAGER_BYTES, Comm, as_bytes, check_buffer
from hora.collectives.reduce_ops import Reducer, plain_ufunc, reducer
from hora.dtypes import storage_dtype
from hora.transport import tally
from hora.transport.base import Pair


def exchange(pair: Pair, send: np.ndarray, recv: np.ndarray) -> None:
    """Send ``send`` to ``pair``'s peer while receiving the same number of bytes into ``recv``."""
    out, into = as_bytes(send), as_bytes(recv)
    if send.nbytes <= EAGER_BYTES:
        pair.send(out)
        pair.recv_into(into)
    else:
        work = pair.isend(out)
        pair.recv_into(into)
        work.wait()


def allreduce_recursive_doubling(
    comm: Comm,
    buf: np.ndarray,
    dtype: str,
    op: int,
    *,
    scratch: np.ndarray | None = None,
) -> None:
    """Reduce ``buf`` with ``op`` across the group, in place.

    ``scratch`` (optional, at least ``buf.nbytes`` bytes, C-contiguous) avoids an allocation.
    """
    check_buffer(buf, dtype)
    reduce = reducer(op, dtype)
    n, rank = comm.size, comm.rank
    if n == 1 or buf.size == 0:
        return
    if scratch is not None and scratch.nbytes >= buf.nbytes:
        tmp = scratch.reshape(-1).view(np.uint8)[: buf.nbytes].view(buf.dtype)
    else:
        tmp = np.empty_like(buf)
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    raw = as_bytes(buf)
    if rank < 2 * extra:
        if rank % 2 == 0:
            pair = comm.pair(rank + 1)
            pair.send(raw)
            pair.recv_into(raw)
            return
        comm.pair(rank - 1).recv_into(as_bytes(tmp))
        reduce(buf, tmp)
        vrank = rank // 2
    else:
        vrank = rank - extra
    mask = 1
    while mask < p:
        vpeer = vrank ^ mask
        peer = 2 * vpeer + 1 if vpeer < extra else vpeer + extra
        exchange(comm.pair(peer), buf, tmp)
        reduce(buf, tmp)
        mask <<= 1
    if rank < 2 * extra:
        comm.pair(rank - 1).send(raw)


def reduce_like_doubling(parts: list[np.ndarray], reduce: Reducer, out: np.ndarray,
                         scratch: Sequence[np.ndarray] = ()) -> None:  # fmt: skip
    """Reduce every member's input (``parts``, in member order, left as they are) into ``out``
    as :func:`allreduce_recursive_doubling` combines them: the folded pairs first, then a
    balanced tree over the rest (:func:`doubling_steps`). The elementwise ops commute bit for
    bit, so this gives the bits every member gets from the exchanges (what a round that hands
    every member's inputs to every other computes, hora.core.handover). ``out`` may be one of
    ``parts`` (in place), but no part of another. ``scratch``: arrays laid out as ``out``, at
    least the steps' count of them, that spare allocating them."""
    n = len(parts)
    if n == 1:
        np.copyto(out, parts[0])
        return
    steps, needed = doubling_steps(n)
    if len(scratch) < needed:
        scratch = [np.empty_like(out) for _ in range(needed)]
    arrays = [*parts, out, *scratch]
    for a, b, into in steps:
        reduce(arrays[a], arrays[b], out=arrays[into])


Steps = tuple[tuple[int, int, int], ...]


def fold_steps(steps: Steps, ufunc: np.ufunc, parts: list[np.ndarray], out: np.ndarray,
               scratch: Sequence[np.ndarray]) -> None:  # fmt: skip
    """:func:`reduce_like_doubling` with ``steps`` (:func:`doubling_steps`) worked out before
    and enough ``scratch``, folding with ``ufunc`` as is (a reducer that is one call of it,
    :func:`~hora.collectives.reduce_ops.plain_ufunc`), its bytes counted as a reducer counts
    them."""
    arrays = [*parts, out, *scratch]
    for a, b, into in steps:
        ufunc(arrays[a], arrays[b], arrays[into])  # out positionally: a keyword costs more
    tally.counts[tally.REDUCED] += len(steps) * out.nbytes


@dataclass(frozen=True)
class Doubling:
    """:func:`reduce_like_doubling` of one op over ``n`` members' inputs of one dtype and
    size, worked out once (:func:`doubling`): called with the inputs and ``out``."""

    reduce: Reducer
    ufunc: np.ufunc | None  # the reducer's one call, where it is one (then folded with it)
    steps: Steps
    scratch: list[np.ndarray]

    def __call__(self, parts: list[np.ndarray], out: np.ndarray) -> None:
        if self.ufunc is not None:
            fold_steps(self.steps, self.ufunc, parts, out, self.scratch)
        else:
            reduce_like_doubling(parts, self.reduce, out, self.scratch)


def doubling(n: int, op: int, dtype: str, count: int) -> Doubling:
    """:class:`Doubling` for ``n`` (at least two) members' ``count`` elements of ``dtype``."""
    steps, needed = doubling_steps(n)
    scratch = [np.empty(count, storage_dtype(dtype)) for _ in range(needed)]
    return Doubling(reducer(op, dtype), plain_ufunc(op, dtype), steps, scratch)


@functools.cache
def doubling_steps(n: int) -> tuple[Steps, int]:
    """How :func:`reduce_like_doubling` reduces ``n`` (at least two) members' inputs: its
    calls in order, each ``(a, b, into)``: ``reduce(a, b, out=into)`` over the arrays
    ``parts + [out] + scratch``; and how many scratch arrays they use. The folded pairs
    first (the odd member's input, then the even one's), then a balanced tree over the rest:
    its left half into a scratch array, its right half into the destination, then the two.
    So ``out`` is written only once every input but the last two is read (it may be one of
    them), and a tree of 2^k takes k - 1 scratch arrays rather than 2^k - 2."""
    steps: list[tuple[int, int, int]] = []
    used = 0
    free: list[int] = []  # scratch arrays read for the last time (a tree's left half)

    def fresh() -> int:
        nonlocal used
        if free:
            return free.pop()
        used += 1
        return n + used

    def tree(level: list[int], dst: int) -> None:
        if len(level) == 2:
            steps.append((level[0], level[1], dst))
            return
        half = len(level) // 2
        left = fresh()  # written whole by its subtree's first step before it is read
        tree(level[:half], left)
        tree(level[half:], dst)
        steps.append((left, dst, dst))
        free.append(left)

    extra = n - (1 << (n.bit_length() - 1))
    level = []
    for i in range(extra):
        acc = fresh()
        steps.append((2 * i + 1, 2 * i, acc))
        level.append(acc)
    tree(level + list(range(2 * extra, n)), n)
    return tuple(steps), used
