"""The one place that picks a collective algorithm, and the import surface for backends.

``allreduce`` uses recursive doubling at or below ``small_threshold`` bytes (latency-bound)
and the pipelined ring above it (bandwidth-bound). The other collectives have one algorithm
each, re-exported here so that a backend imports from a single module.

Thread-safe: stateless.
"""

from __future__ import annotations

import numpy as np

from hora.collectives.adasum import adasum
from hora.collectives.allgather_ring import allgatherv_ring
from hora.collectives.allreduce_recursive_doubling import allreduce_recursive_doubling
from hora.collectives.allreduce_ring import allreduce_ring
from hora.collectives.alltoall_pairwise import alltoallv_pairwise
from hora.collectives.barrier import barrier
from hora.collectives.base import Comm, GroupComm, check_buffer
from hora.collectives.broadcast_tree import broadcast_tree
from hora.collectives.reduce_ops import (
    ADASUM,
    AVERAGE,
    MAX,
    MIN,
    PRODUCT,
    SUM,
    reducer,
    scale,
)
from hora.collectives.reducescatter_ring import reducescatter_counts, reducescatterv_ring
from hora.collectives.ring import SCRATCH_BYTES

SMALL_THRESHOLD = 64 << 10


def allreduce(
    comm: Comm,
    buf: np.ndarray,
    dtype: str,
    op: int,
    *,
    small_threshold: int = SMALL_THRESHOLD,
    scratch: np.ndarray | None = None,
    post: float = 1.0,
) -> None:
    """Reduce ``buf`` (storage dtype, 1-D, contiguous) with ``op`` across the group, in place,
    and scale the result by ``post`` (the ring scales each block as it completes it).

    ``op`` is an element-wise op (AVERAGE reduces as SUM); Adasum has its own :func:`adasum`.
    ``scratch`` (optional, C-contiguous, any dtype) is reused when large enough; one of
    ``SCRATCH_BYTES`` serves every size, so a caller can keep one and never allocate.
    """
    check_buffer(buf, dtype)
    reducer(op, dtype)  # validates op and dtype on every path, also at size 1
    if comm.size > 1 and buf.size > 0:
        if buf.nbytes > small_threshold:
            allreduce_ring(comm, buf, dtype, op, scratch=scratch, post=post)
            return
        allreduce_recursive_doubling(comm, buf, dtype, op, scratch=scratch)
    scale(buf, dtype, post)


__all__ = [
    "ADASUM",
    "AVERAGE",
    "MAX",
    "MIN",
    "PRODUCT",
    "SUM",
    "SCRATCH_BYTES",
    "SMALL_THRESHOLD",
    "Comm",
    "GroupComm",
    "adasum",
    "allgatherv_ring",
    "allreduce",
    "allreduce_recursive_doubling",
    "allreduce_ring",
    "alltoallv_pairwise",
    "barrier",
    "broadcast_tree",
    "reducescatter_counts",
    "reducescatterv_ring",
    "scale",
]
