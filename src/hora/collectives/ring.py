"""The pipelined ring pass shared by ring allreduce, reduce-scatter and allgather.

The buffer is cut into ``size`` blocks. At step ``t`` every rank sends block ``start - t`` to its
right neighbour and receives block ``start - t - 1`` from its left neighbour; during the first
``reduce_steps`` steps the incoming block is reduced into place, afterwards it is received
straight into place. Because the block a rank sends at step ``t + 1`` is the one it received at
step ``t``, the pass is one stream of segments: each block is cut into segments (a quarter
of a block, 256 KiB to 4 MiB), and a segment is forwarded as soon as it has been reduced, while
the receives of the next ``DEPTH - 1`` segments are already posted and earlier sends still drain.
Sending, receiving and reducing therefore overlap, with ``DEPTH`` segments of scratch.
When every block fits in ``EAGER_BYTES`` (and no segment size is forced), each step is a
blocking send then receive on the calling thread instead: at that size a thread hand-off costs
more than it overlaps.

Receiving straight into a region that an earlier ``isend`` of this rank reads from is safe:
the incoming bytes of a block are causally after the right neighbour received this rank's
earlier send of the same segment (the reduced block has to travel around the ring first).

Runs on the calling (engine) thread; thread-safe for distinct Comms and buffers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from hora.collectives.base import EAGER_BYTES, Comm, as_bytes, split_even
from hora.collectives.reduce_ops import Reducer
from hora.transport.base import Work

MIN_SEGMENT_BYTES = 256 << 10
MAX_SEGMENT_BYTES = 4 << 20
DEPTH = 3
SCRATCH_BYTES = DEPTH * MAX_SEGMENT_BYTES  # scratch this large serves every automatic pass


def segment_size(stream_bytes: int) -> int:
    """Automatic segment size: a quarter of ``stream_bytes``, kept within the bounds above.

    Four segments per block are enough to overlap; larger segments cost less per byte.
    """
    return min(MAX_SEGMENT_BYTES, max(MIN_SEGMENT_BYTES, stream_bytes // 4))


def segments(bounds: Sequence[int], block: int, seg_elems: int) -> list[tuple[int, int]]:
    """Block ``block`` of ``bounds`` cut into nearly equal segments of at most ``seg_elems``."""
    lo, hi = bounds[block], bounds[block + 1]
    count = hi - lo
    if count == 0:
        return []
    out = []
    for part in split_even(count, -(-count // seg_elems)):
        out.append((lo, lo + part))
        lo += part
    return out


def ring_pass(
    comm: Comm,
    buf: np.ndarray,
    bounds: Sequence[int],
    start: int,
    steps: int,
    reduce_steps: int,
    reduce: Reducer | None,
    scratch: np.ndarray | None = None,
    segment_bytes: int | None = None,
    last_reduce: Reducer | None = None,
) -> None:
    """Run ``steps`` ring steps over ``buf`` cut at ``bounds`` (``size + 1`` offsets).

    ``last_reduce``, if given, reduces instead of ``reduce`` in the last reducing step, which
    makes each element of a block its final value (an allreduce's result scaled there).

    ``segment_bytes`` defaults to :func:`segment_size` of the largest block (the same on every
    rank). ``scratch`` (optional, C-contiguous, any dtype) holds incoming segments when it has
    ``DEPTH`` segments' worth of bytes (``SCRATCH_BYTES`` always does); else scratch is
    allocated.
    """
    n, rank = comm.size, comm.rank
    if reduce_steps > 0 and reduce is None:
        raise ValueError("a reducing ring pass needs a reducer")
    if n == 1 or steps == 0:
        return
    last = reduce if last_reduce is None else last_reduce
    # each step's reducer: ``reduce``, ``last`` for the last reducing step, then None (received)
    by_step = [reduce if t + 1 < reduce_steps else last if t < reduce_steps else None
               for t in range(steps)]  # fmt: skip
    itemsize = buf.itemsize
    largest = max(bounds[b + 1] - bounds[b] for b in range(n))
    if segment_bytes is None:
        if largest * itemsize <= EAGER_BYTES:
            _eager_pass(comm, buf, bounds, start, by_step, scratch, largest)
            return
        segment_bytes = segment_size(largest * itemsize)
    seg_elems = max(1, segment_bytes // itemsize)
    blocks = [segments(bounds, b, seg_elems) for b in range(n)]
    units = [
        (by_step[t], lo, hi, t + 1 < steps)
        for t in range(steps)
        for lo, hi in blocks[(start - t - 1) % n]
    ]
    raw = as_bytes(buf)
    right = comm.pair((rank + 1) % n)
    left = comm.pair((rank - 1) % n)

    slots: list[np.ndarray] = []
    if reduce_steps > 0:
        need = DEPTH * seg_elems * itemsize
        if scratch is None or scratch.nbytes < need:
            scratch = np.empty(need, np.uint8)
        flat = scratch.reshape(-1).view(np.uint8)[:need].view(buf.dtype)
        slots = [flat[i * seg_elems : (i + 1) * seg_elems] for i in range(DEPTH)]

    def region(lo: int, hi: int) -> memoryview:
        return raw[lo * itemsize : hi * itemsize]

    sends: list[Work] = [right.isend(region(lo, hi)) for lo, hi in blocks[start % n]]
    posted: deque[Work] = deque()

    def post(i: int) -> None:
        reducing, lo, hi, _ = units[i]
        if reducing is not None:
            posted.append(left.irecv(as_bytes(slots[i % DEPTH][: hi - lo])))
        else:
            posted.append(left.irecv(region(lo, hi)))

    for i in range(min(DEPTH, len(units))):
        post(i)
    for i, (reducing, lo, hi, forward) in enumerate(units):
        posted.popleft().wait()
        if reducing is not None:
            reducing(buf[lo:hi], slots[i % DEPTH][: hi - lo])
        if forward:
            sends.append(right.isend(region(lo, hi)))
        if i + DEPTH < len(units):
            post(i + DEPTH)
    for work in sends:
        work.wait()


def _eager_pass(
    comm: Comm,
    buf: np.ndarray,
    bounds: Sequence[int],
    start: int,
    by_step: list[Reducer | None],
    scratch: np.ndarray | None,
    largest: int,
) -> None:
    """The same ring with small blocks: blocking send then receive, no background threads.
    ``by_step``: each step's reducer (None: received into place)."""
    n, rank = comm.size, comm.rank
    itemsize = buf.itemsize
    raw = as_bytes(buf)
    right = comm.pair((rank + 1) % n)
    left = comm.pair((rank - 1) % n)
    if scratch is not None and scratch.nbytes >= largest * itemsize:
        tmp = scratch.reshape(-1).view(np.uint8)[: largest * itemsize].view(buf.dtype)
    else:
        tmp = np.empty(largest, buf.dtype)
    for t, reduce in enumerate(by_step):
        block = (start - t) % n
        lo, hi = bounds[block], bounds[block + 1]
        if hi > lo:
            right.send(raw[lo * itemsize : hi * itemsize])
        block = (block - 1) % n
        lo, hi = bounds[block], bounds[block + 1]
        if hi == lo:
            continue
        if reduce is not None:
            incoming = tmp[: hi - lo]
            left.recv_into(as_bytes(incoming))
            reduce(buf[lo:hi], incoming)
        else:
            left.recv_into(raw[lo * itemsize : hi * itemsize])
