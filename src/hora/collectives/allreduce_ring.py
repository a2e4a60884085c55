"""Ring allreduce: a pipelined reduce-scatter followed by a pipelined allgather.

Each of ``size`` ranks sends and receives ``2 (size - 1)`` blocks of ``nbytes / size``: about
``2 nbytes`` on the wire per rank whatever the world size, in ``2 (size - 1)`` latency steps,
which makes it the algorithm for large buffers. Segmenting and overlap are in ``ring.py``.

Runs on the calling (engine) thread; thread-safe for distinct Comms and buffers.
"""

from __future__ import annotations

import numpy as np

from hora.collectives.base import Comm, check_buffer, offsets_of, split_even
from hora.collectives.reduce_ops import finishing, reducer, scale
from hora.collectives.ring import ring_pass


def allreduce_ring(
    comm: Comm,
    buf: np.ndarray,
    dtype: str,
    op: int,
    *,
    scratch: np.ndarray | None = None,
    segment_bytes: int | None = None,
    post: float = 1.0,
) -> None:
    """Reduce ``buf`` with ``op`` across the group, in place (every rank gets the result),
    scaled by ``post``: each block as its last reduction step makes it, before it is passed
    on, so each rank scales ``1 / size`` of the buffer rather than all of it (the same bits)."""
    check_buffer(buf, dtype)
    reduce = reducer(op, dtype)
    n = comm.size
    if n == 1 or buf.size == 0:
        scale(buf, dtype, post)
        return
    last, post = finishing(op, dtype, post)
    bounds = offsets_of(split_even(buf.size, n))
    ring_pass(
        comm,
        buf,
        bounds,
        start=comm.rank,
        steps=2 * (n - 1),
        reduce_steps=n - 1,
        reduce=reduce,
        scratch=scratch,
        segment_bytes=segment_bytes,
        last_reduce=last,
    )
    scale(buf, dtype, post)  # what the last step could not scale (integers)
