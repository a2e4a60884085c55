"""Hierarchical allreduce over torch.distributed groups: inside each host, then across hosts.

``HOROVOD_HIERARCHICAL_ALLREDUCE=1`` with the NCCL backend: a tensor of ``n`` elements is
reduce-scattered among the ranks of each host (each gets one ``ceil(n / local_size)`` piece,
summed over its host), each piece is allreduced across hosts among the ranks of the same local
rank, and the pieces are allgathered inside each host again. Only ``1 / local_size`` of the
tensor crosses the network from each rank, and the traffic inside a host stays on its fast
links (NVLink/PCIe for NCCL), as in Horovod's NCCL hierarchical allreduce.

It needs the same number of ranks on every host (Horovod's "homogeneous" condition); whether
that holds is decided once per process set from the hosts hora's transport published for its
members (the same table on every rank), so every rank takes the same path. Otherwise, on one
host, or with one rank per host, the flat allreduce runs (logged once).

The groups come from the backend's own factory (``make_group(store, rank, size)``), under
store prefixes of their own: NCCL groups in a job, Gloo groups in the tests on CPU.
Threads: the engine thread only (as the backends). Not thread-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

MakeGroup = Callable[[Any, int, int], Any]  # (store, rank in group, group size) -> group


@dataclass
class TwoLevel:
    """One process set's groups: ``local`` (this rank's host), ``cross`` (this local rank on
    every host), and the number of ranks per host."""

    local: Any
    cross: Any
    local_size: int

    def allreduce(self, t: torch.Tensor, op: Any) -> None:
        """Reduce the 1-D tensor ``t`` in place (``op``: a ``dist.ReduceOp``), on the current
        stream's device; the padding of the last piece is scratch and never read back."""
        n, size = t.numel(), self.local_size
        piece = -(-n // size)
        padded = t
        if piece * size != n:
            padded = torch.zeros(piece * size, dtype=t.dtype, device=t.device)
            padded[:n] = t
        mine = torch.empty(piece, dtype=t.dtype, device=t.device)
        rs = dist.ReduceScatterOptions()
        rs.reduceOp = op
        self.local.reduce_scatter([mine], [list(padded.split(piece))], rs).wait()
        ar = dist.AllreduceOptions()
        ar.reduceOp = op
        self.cross.allreduce([mine], ar).wait()
        self.local._allgather_base(padded, mine).wait()
        if padded is not t:
            t.copy_(padded[:n])


def plan(hosts: list[int] | tuple[int, ...], me: int) -> tuple[list[int], list[int]] | None:
    """From the host of every member (``hosts[i]``: member ``i``'s host number), this member's
    host group and cross group (set ranks, in order), or None when the set is not on several
    hosts with the same number of ranks (more than one) on each."""
    by_host: dict[int, list[int]] = {}
    for i, host in enumerate(hosts):
        by_host.setdefault(host, []).append(i)
    sizes = {len(v) for v in by_host.values()}
    if len(by_host) < 2 or len(sizes) != 1 or sizes == {1}:
        return None
    mine = by_host[hosts[me]]
    index = mine.index(me)
    return mine, [members[index] for members in by_host.values()]


def build(
    hosts: list[int] | tuple[int, ...],
    me: int,
    make_group: MakeGroup,
    store_for: Callable[[str], Any],
) -> TwoLevel | None:
    """The two groups of a process set whose member ``i`` lives on host ``hosts[i]`` (``me``:
    this rank's index), or None if the flat allreduce must serve it (see :func:`plan`).

    Every member calls this at the same point: the first hierarchical allreduce of the set.
    ``store_for(key)`` gives a store under a prefix of its own for a new group."""
    found = plan(hosts, me)
    if found is None:
        log.info("hierarchical allreduce: the hosts of this set's ranks %s are not several "
                 "with the same number of ranks on each; the flat allreduce serves it",
                 list(hosts))
        return None
    local, cross = found
    local_group = make_group(store_for(f"host{local[0]}/"), local.index(me), len(local))
    cross_group = make_group(store_for(f"cross{cross[0]}/"), cross.index(me), len(cross))
    log.debug("hierarchical allreduce: host group %s, cross group %s", local, cross)
    return TwoLevel(local_group, cross_group, len(local))
