"""Ring allgather with uneven (possibly zero) per-rank counts.

``size - 1`` steps; each rank sends and receives everything but its own part once, about
``nbytes (size - 1) / size`` each way, received straight into place. Pipelined as in
``ring.py``.

Runs on the calling (engine) thread; thread-safe for distinct Comms and buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hora.collectives.base import Comm, check_buffer, offsets_of
from hora.collectives.ring import ring_pass


def allgatherv_ring(
    comm: Comm,
    send: np.ndarray,
    recv: np.ndarray,
    counts: Sequence[int],
    *,
    segment_bytes: int | None = None,
) -> None:
    """Gather every rank's ``send`` (``counts[r]`` elements) into ``recv``, in rank order.

    ``send`` may already be this rank's slice of ``recv``.
    """
    check_buffer(recv, None, "recv")
    if not isinstance(send, np.ndarray) or send.dtype != recv.dtype:
        raise TypeError(f"send must be a NumPy array of recv's dtype {recv.dtype}")
    n, rank = comm.size, comm.rank
    if len(counts) != n or any(c < 0 for c in counts):
        raise ValueError(f"counts must hold {n} non-negative element counts, got {list(counts)}")
    if sum(counts) != recv.size:
        raise ValueError(f"counts {list(counts)} add up to {sum(counts)}, not recv's {recv.size}")
    if send.size != counts[rank]:
        raise ValueError(f"send holds {send.size} elements but counts[{rank}] is {counts[rank]}")
    bounds = offsets_of(counts)
    mine = recv[bounds[rank] : bounds[rank + 1]]
    if mine.ctypes.data != send.ctypes.data:
        np.copyto(mine, send.reshape(-1))
    ring_pass(
        comm,
        recv,
        bounds,
        start=rank,
        steps=n - 1,
        reduce_steps=0,
        reduce=None,
        segment_bytes=segment_bytes,
    )
