"""Pairwise-exchange alltoall with per-destination counts.

Step ``k = 1 .. size - 1``: send the block for ``rank + k`` and receive the block from
``rank - k``; the own block is copied locally. ``size - 1`` latency steps; every byte not
addressed to oneself crosses the wire once, and each step has exactly one partner each way,
so no rank is flooded. Sends go in the background (``isend``) while the receive runs on the
calling thread, which rules out deadlock whatever the sizes; zero-count blocks send nothing.

Runs on the calling (engine) thread; thread-safe for distinct Comms and buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hora.collectives.base import EAGER_BYTES, Comm, as_bytes, check_buffer, offsets_of


def _check_counts(name: str, counts: Sequence[int], n: int, arr: np.ndarray) -> list[int]:
    if len(counts) != n or any(c < 0 for c in counts):
        raise ValueError(f"{name} must hold {n} non-negative element counts, got {list(counts)}")
    if sum(counts) != arr.size:
        raise ValueError(f"{name} {list(counts)} add up to {sum(counts)}, not {arr.size}")
    return offsets_of(counts)


def alltoallv_pairwise(
    comm: Comm,
    send: np.ndarray,
    send_counts: Sequence[int],
    recv: np.ndarray,
    recv_counts: Sequence[int],
) -> None:
    """Block ``i`` of ``send`` goes to rank ``i``; block ``i`` of ``recv`` comes from rank ``i``.

    Counts are in elements; blocks are laid out back to back in rank order.
    """
    check_buffer(recv, None, "recv")
    if not isinstance(send, np.ndarray) or send.dtype != recv.dtype or send.ndim != 1:
        raise TypeError(f"send must be a 1-D NumPy array of recv's dtype {recv.dtype}")
    n, rank = comm.size, comm.rank
    sdispl = _check_counts("send_counts", send_counts, n, send)
    rdispl = _check_counts("recv_counts", recv_counts, n, recv)
    if send_counts[rank] != recv_counts[rank]:
        raise ValueError(
            f"rank {rank} sends itself {send_counts[rank]} elements but expects {recv_counts[rank]}"
        )
    np.copyto(recv[rdispl[rank] : rdispl[rank + 1]], send[sdispl[rank] : sdispl[rank + 1]])
    sraw, rraw = as_bytes(send), as_bytes(recv)
    size = send.itemsize
    for k in range(1, n):
        dst, src = (rank + k) % n, (rank - k) % n
        out = sraw[sdispl[dst] * size : sdispl[dst + 1] * size]
        into = rraw[rdispl[src] * size : rdispl[src + 1] * size]
        work = None
        if out.nbytes > EAGER_BYTES:
            work = comm.pair(dst).isend(out)
        elif out.nbytes:
            comm.pair(dst).send(out)
        if into.nbytes:
            comm.pair(src).recv_into(into)
        if work is not None:
            work.wait()
