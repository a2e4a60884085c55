"""hora's own backend: the algorithms of ``hora.collectives`` over hora's transports.

Stateless apart from the transport it was given; called from the engine thread only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hora.backends.base import SetComm
from hora.collectives import hierarchical, registry
from hora.collectives.base import check_buffer
from hora.collectives.reduce_ops import reducer

if TYPE_CHECKING:
    from hora.backends.registry import BackendContext


# A fused allreduce goes part by part (no fusion-buffer copies) when its tensors average at
# least this many bytes; smaller ones cost less copied into one buffer, as each part costs the
# transport a scatter piece and the reduction a call of its own. Measured at np=2 on one host,
# the two ways alternating: 100 tensors of 10 KB 1.26-1.29x slower as parts, 25 of 42 KB even,
# 4 to 10 tensors of 107-273 KB 8-25% faster as parts.
PARTS_MIN_BYTES = 64 << 10


class NativeBackend:
    name = "TCP"
    # hora's own data path: a two-member set in direct mode may move a small allreduce inside
    # the round's headers (hora.core.fastpath) instead of calling this backend
    native = True

    def __init__(self, ctx: BackendContext | None = None) -> None:
        # one scratch area for every reduction, instead of an allocation per call
        self._scratch = np.empty(registry.SCRATCH_BYTES, dtype=np.uint8)
        knobs = ctx.settings if ctx is not None else None
        # torus allreduce is accepted and runs as hierarchical
        self._hier_allreduce = knobs is not None and (knobs.hierarchical_allreduce
                                                      or knobs.torus_allreduce)
        self._hier_allgather = knobs is not None and knobs.hierarchical_allgather

    def allreduce(self, comm: SetComm, buf: np.ndarray, dtype: str, op: int) -> None:
        # host-aware: shared memory inside a host, hierarchical across hosts, else flat
        hierarchical.allreduce(comm, buf, dtype, op, hierarchical.layout_of(comm),
                               hierarchical=self._hier_allreduce, scratch=self._scratch)

    def reduces_parts(self, comm: SetComm, nbytes: int, count: int = 1) -> bool:
        """Whether :meth:`allreduce_parts` serves a fused allreduce of ``nbytes`` in ``count``
        tensors in this set: one host over shared memory, and tensors large enough on average
        that reducing each where it lies beats copying them through the fusion buffer (each
        part costs the transport a scatter piece and the reduction a call of its own). The
        same answer on every rank of the set."""
        layout = hierarchical.layout_of(comm)
        return (layout is not None and layout.shared and not layout.multi_host
                and nbytes > registry.SMALL_THRESHOLD and nbytes >= PARTS_MIN_BYTES * count)

    def allreduce_parts(self, comm: SetComm, parts: list[np.ndarray], dtype: str,
                        op: int) -> None:
        """Reduce ``parts`` as one buffer, each where it lies (no fusion-buffer copies)."""
        for p in parts:
            check_buffer(p, dtype)
        hierarchical.allreduce_direct(comm, parts, reducer(op, dtype), scratch=self._scratch)

    def allgatherv(self, comm: SetComm, send: np.ndarray, recv: np.ndarray,
                   counts: list[int]) -> None:
        hierarchical.allgatherv(comm, send, recv, counts, hierarchical.layout_of(comm),
                                hierarchical=self._hier_allgather)

    def broadcast(self, comm: SetComm, buf: np.ndarray, root: int) -> None:
        registry.broadcast_tree(comm, buf, root)

    def alltoallv(self, comm: SetComm, send: np.ndarray, send_counts: list[int],
                  recv: np.ndarray, recv_counts: list[int]) -> None:
        registry.alltoallv_pairwise(comm, send, send_counts, recv, recv_counts)

    def reducescatterv(self, comm: SetComm, send: np.ndarray, recv: np.ndarray,
                       counts: list[int], dtype: str, op: int) -> None:
        registry.reducescatterv_ring(comm, send, recv, counts, dtype, op, scratch=self._scratch)

    def adasum(self, comm: SetComm, buf: np.ndarray, dtype: str,
               segments: list[tuple[int, int]]) -> None:
        registry.adasum(comm, buf, dtype, segments)

    def barrier(self, comm: SetComm) -> None:
        registry.barrier(comm)

    def add_process_set(self, ps_id: int, ranks: list[int]) -> None:
        pass  # pairs connect lazily; nothing to prepare

    def remove_process_set(self, ps_id: int, ranks: list[int]) -> None:
        pass

    def close(self) -> None:
        pass
