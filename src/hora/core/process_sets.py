"""Process sets: subsets of ranks that run collectives among themselves.

``ProcessSet`` is the user-facing object (Horovod's name and methods). Ranks are global and
kept sorted. A set gets its ``process_set_id`` when it is registered with the running engine,
which happens the same way on every rank (at ``init`` for static sets, through a collective
negotiation for ``add_process_set``), so ids agree everywhere. ``global_process_set`` (id 0)
always exists. No two registered sets have the same ranks: ``init(process_sets=...)`` and
``add_process_set`` raise ValueError for a duplicate, as Horovod does. Thread-safe for reading;
registration happens under the runtime's lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hora.errors import NOT_INITIALIZED_MESSAGE


class ProcessSet:
    """A set of global ranks. ``ProcessSet([0, 2])``, or from an mpi4py communicator."""

    def __init__(self, ranks_or_comm: Iterable[int] | Any) -> None:
        self.mpi_comm: Any = None
        if hasattr(ranks_or_comm, "Get_group") and hasattr(ranks_or_comm, "Get_size"):
            self.mpi_comm = ranks_or_comm
            ranks: list[int] = _ranks_of_comm(ranks_or_comm)
        else:
            ranks = [int(r) for r in ranks_or_comm]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be distinct, got {ranks}")
        if any(r < 0 for r in ranks):
            raise ValueError(f"ProcessSet ranks must be non-negative, got {ranks}")
        self.ranks: list[int] = sorted(ranks)
        self.process_set_id: int | None = None
        self._my_rank: int | None = None  # global rank of this process, set on registration

    def _bind(self, process_set_id: int, my_rank: int) -> None:
        self.process_set_id = process_set_id
        self._my_rank = my_rank

    def _unbind(self) -> None:
        self.process_set_id = None

    def _require(self) -> int:
        if self._my_rank is None or self.process_set_id is None:
            raise ValueError(
                f"{self!r} has not been registered: pass it to hvd.init(process_sets=[...]) "
                "or hvd.add_process_set(...) first"
                if self._my_rank is not None
                else NOT_INITIALIZED_MESSAGE
            )
        return self._my_rank

    def size(self) -> int:
        self._require()
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set; ValueError if it is not a member."""
        me = self._require()
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not a member of {self!r}")
        return self.ranks.index(me)

    def included(self) -> bool:
        return self._require() in self.ranks

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and other.ranks == self.ranks

    def __hash__(self) -> int:
        return hash(tuple(self.ranks))

    def __repr__(self) -> str:
        if self is global_process_set:
            return "ProcessSet(process_set_id=0, global)"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


def _ranks_of_comm(comm: Any) -> list[int]:
    """Global (COMM_WORLD) ranks of an mpi4py communicator's members."""
    from mpi4py import MPI  # only reached when the user passed a communicator

    world = MPI.COMM_WORLD.Get_group()
    group = comm.Get_group()
    ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
    return [int(r) for r in ranks]


global_process_set = ProcessSet([])


def registered_with(ranks: list[int], registered: Mapping[int, ProcessSet]) -> int | None:
    """The id of the set in ``registered`` (id -> set, the global set included) that has
    exactly ``ranks``, or None."""
    for ps_id, ps in registered.items():
        if ps.ranks == ranks:
            return ps_id
    return None


# The coordinator's answer to a set whose ranks are registered already (every rank gets it).
DUPLICATE_SET = "Attempted to add a duplicate process set"


def duplicate_error(ps: ProcessSet, registered: ProcessSet) -> ValueError:
    """The ValueError ``hvd.add_process_set`` raises for a set whose ranks are registered."""
    return ValueError(
        f"Attempted to add a duplicate process set: ranks {ps.ranks} are those of the "
        f"registered {registered!r}; use that one, or remove it first"
    )


def resolve(process_set: ProcessSet | None) -> ProcessSet:
    return global_process_set if process_set is None else process_set
