"""Ring reduce-scatter with uneven blocks, and Horovod's split of dimension 0.

Rank ``r`` ends with the reduction of block ``r`` (``counts[r]`` elements). The ring starts
one block early so that the block a rank finishes last is its own: ``size - 1`` steps, each
rank sending and receiving about ``nbytes (size - 1) / size``. Pipelined as in ``ring.py``.

Runs on the calling (engine) thread; thread-safe for distinct Comms and buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hora.collectives.base import Comm, check_buffer, offsets_of, split_even
from hora.collectives.reduce_ops import reducer
from hora.collectives.ring import ring_pass


def reducescatter_counts(first_dim: int, size: int) -> list[int]:
    """Rows of dimension 0 per rank: ``first_dim // size``, one more for ranks below the rest."""
    if size < 1 or first_dim < 0:
        raise ValueError(f"cannot split {first_dim} rows over {size} ranks")
    return split_even(first_dim, size)


def reducescatterv_ring(
    comm: Comm,
    send: np.ndarray,
    recv: np.ndarray,
    counts: Sequence[int],
    dtype: str,
    op: int,
    *,
    scratch: np.ndarray | None = None,
    segment_bytes: int | None = None,
) -> None:
    """Reduce ``send`` across the group; ``recv`` gets this rank's block (``counts`` elements).

    ``send`` holds the whole input and is used as scratch (its contents are undefined after).
    """
    check_buffer(send, dtype, "send")
    check_buffer(recv, dtype, "recv")
    reduce = reducer(op, dtype)
    n, rank = comm.size, comm.rank
    if len(counts) != n or any(c < 0 for c in counts):
        raise ValueError(f"counts must hold {n} non-negative element counts, got {list(counts)}")
    if sum(counts) != send.size:
        raise ValueError(f"counts {list(counts)} add up to {sum(counts)}, not send's {send.size}")
    if recv.size != counts[rank]:
        raise ValueError(f"recv holds {recv.size} elements but counts[{rank}] is {counts[rank]}")
    bounds = offsets_of(counts)
    ring_pass(
        comm,
        send,
        bounds,
        start=rank - 1,
        steps=n - 1,
        reduce_steps=n - 1,
        reduce=reduce,
        scratch=scratch,
        segment_bytes=segment_bytes,
    )
    mine = send[bounds[rank] : bounds[rank + 1]]
    if mine.ctypes.data != recv.ctypes.data:
        np.copyto(recv, mine)
