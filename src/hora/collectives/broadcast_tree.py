"""Binomial-tree broadcast, segmented and pipelined for large buffers.

Ranks are renumbered so that the root is virtual rank 0; virtual rank ``v`` receives from
``v`` minus its lowest set bit and forwards to ``v + 2^k`` for every ``2^k`` below that bit.
``ceil(log2 size)`` latency steps; every non-root rank receives ``nbytes`` once, and a rank
with ``c`` children sends ``c nbytes``. Buffers above one segment (``ring.segment_size``)
travel in segments, each forwarded as soon as it arrives, so the tree depth adds segment
latencies, not buffer ones.

Runs on the calling (engine) thread; thread-safe for distinct Comms and buffers.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from hora.collectives.base import Comm, as_bytes, check_buffer, offsets_of, split_even
from hora.collectives.ring import DEPTH, segment_size
from hora.transport.base import Pair, Work


def tree_links(vrank: int, size: int) -> tuple[int | None, list[int]]:
    """Parent (None for the root) and children, in sending order, of ``vrank`` (virtual)."""
    parent = None
    mask = 1
    while mask < size:
        if vrank & mask:
            parent = vrank - mask
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if vrank + mask < size:
            children.append(vrank + mask)
        mask >>= 1
    return parent, children


def broadcast_tree(
    comm: Comm, buf: np.ndarray, root: int, *, segment_bytes: int | None = None
) -> None:
    """Copy root's ``buf`` into every rank's ``buf`` (``root`` is a group rank)."""
    check_buffer(buf)
    n, rank = comm.size, comm.rank
    if not 0 <= root < n:
        raise ValueError(f"broadcast root {root} is not a rank of a group of {n}")
    if n == 1 or buf.nbytes == 0:
        return
    vrank = (rank - root) % n
    vparent, vchildren = tree_links(vrank, n)
    parent = comm.pair((vparent + root) % n) if vparent is not None else None
    children = [comm.pair((c + root) % n) for c in vchildren]
    raw = as_bytes(buf)
    if segment_bytes is None:
        segment_bytes = segment_size(raw.nbytes)
    parts = split_even(raw.nbytes, -(-raw.nbytes // max(1, segment_bytes)))
    bounds = offsets_of(parts)
    views = [raw[bounds[i] : bounds[i + 1]] for i in range(len(parts))]
    if len(views) == 1:
        if parent is not None:
            parent.recv_into(views[0])
        for child in children:
            child.send(views[0])
        return
    _pipelined(parent, children, views)


def _pipelined(parent: Pair | None, children: list[Pair], views: list[memoryview]) -> None:
    posted: deque[Work] = deque()
    if parent is not None:
        posted.extend(parent.irecv(v) for v in views[:DEPTH])
    sends: list[Work] = []
    for i, view in enumerate(views):
        if parent is not None:
            posted.popleft().wait()
            if i + DEPTH < len(views):
                posted.append(parent.irecv(views[i + DEPTH]))
        sends.extend(child.isend(view) for child in children)
    for work in sends:
        work.wait()
