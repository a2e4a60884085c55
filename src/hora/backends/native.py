"""hora's own backend: the algorithms of ``hora.collectives`` over hora's transports.

Stateless apart from the transport it was given; called from the engine thread only.
"""

from __future__ import annotations

import numpy as np

from hora.backends.base import SetComm
from hora.collectives import registry


class NativeBackend:
    name = "TCP"

    def __init__(self) -> None:
        # one scratch area for every reduction, instead of an allocation per call
        self._scratch = np.empty(registry.SCRATCH_BYTES, dtype=np.uint8)

    def allreduce(self, comm: SetComm, buf: np.ndarray, dtype: str, op: int) -> None:
        registry.allreduce(comm, buf, dtype, op, scratch=self._scratch)

    def allgatherv(self, comm: SetComm, send: np.ndarray, recv: np.ndarray,
                   counts: list[int]) -> None:
        registry.allgatherv_ring(comm, send, recv, counts)

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
