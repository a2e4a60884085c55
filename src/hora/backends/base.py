"""What the engine asks of a backend: whole collectives on flat NumPy buffers.

A backend executes one collective among the members of a process set, described by a
:class:`SetComm`. Buffers are 1-D, C-contiguous, in storage dtype (see ``hora.dtypes``) and are
worked on in place; ``dtype`` is the hora dtype name and ``op`` a reduce-op int
(``collectives.reduce_ops``; Average arrives as Sum, the engine scales). Called from the engine
thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hora.transport.base import DATA, Pair, Transport


@dataclass
class SetComm:
    """A process set as the collectives see it: this rank's place in it and its Pairs."""

    ranks: list[int]  # global ranks, sorted
    rank: int  # this process's index in ``ranks``
    transport: Transport
    process_set_id: int = 0
    cache: dict[str, Any] = field(default_factory=dict)  # backend-private per-set state

    @property
    def size(self) -> int:
        return len(self.ranks)

    def pair(self, peer: int) -> Pair:
        return self.transport.pair(self.ranks[peer], DATA)


class Backend(Protocol):
    name: str  # shown in timelines and `hora check`, e.g. "TCP"

    def allreduce(self, comm: SetComm, buf: np.ndarray, dtype: str, op: int) -> None: ...

    def allgatherv(
        self, comm: SetComm, send: np.ndarray, recv: np.ndarray, counts: list[int]
    ) -> None: ...

    def broadcast(self, comm: SetComm, buf: np.ndarray, root: int) -> None: ...

    def alltoallv(
        self,
        comm: SetComm,
        send: np.ndarray,
        send_counts: list[int],
        recv: np.ndarray,
        recv_counts: list[int],
    ) -> None: ...

    def reducescatterv(
        self,
        comm: SetComm,
        send: np.ndarray,
        recv: np.ndarray,
        counts: list[int],
        dtype: str,
        op: int,
    ) -> None: ...

    def adasum(
        self, comm: SetComm, buf: np.ndarray, dtype: str, segments: list[tuple[int, int]]
    ) -> None: ...

    def barrier(self, comm: SetComm) -> None: ...

    def add_process_set(self, ps_id: int, ranks: list[int]) -> None:
        """Called on EVERY rank (members or not) when a set is registered, in the same order
        everywhere, before any collective on it; ``remove_process_set`` likewise."""

    def remove_process_set(self, ps_id: int, ranks: list[int]) -> None: ...

    def close(self) -> None: ...
