"""The MPI backend: the engine's collectives through mpi4py on the job's MPI library.

hora still negotiates over its own control plane; only the data of each negotiated collective
moves through MPI, on a duplicate of hora's world communicator (``MPI.COMM_WORLD`` or the one
given to ``init(comm=...)``) and one communicator per process set, made with
``Comm.Create_group`` by the set's members.

Reductions run inside MPI for the types it knows (integers, float32/64, bool through ``LOR`` and
``LAND``). MPI has no float16 or bfloat16: those reduce inside MPI's own algorithm with a user
op over 16-bit elements whose kernel is hora's reducer (``collectives.reduce_ops``). Adasum
runs hora's own algorithm over hora's transport. Element counts are limited to MPI's
``2**31 - 1``.

:func:`bootstrap` makes hora's world out of a communicator when there is no ``hora run`` store
(plain ``mpirun``, or ``init(comm=...)``): its rank 0 starts a rendezvous store and broadcasts
the address and a fresh secret with ``bcast``.

Threads: ``bootstrap`` and the constructor run in the user thread during ``init``; every other
method runs on the engine thread only. Needs MPI initialised with at least
``MPI_THREAD_SERIALIZED``: mpi4py asks for ``MPI_THREAD_MULTIPLE``, or for ``SERIALIZED`` under
``HOROVOD_MPI_THREADS_DISABLE`` when this module starts MPI. Not thread-safe.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mpi4py
import numpy as np

from hora.settings import load

if load().mpi_threads_disable:  # before MPI starts: the engine thread still needs SERIALIZED
    mpi4py.rc.thread_level = "serialized"
from mpi4py import MPI  # noqa: E402 - after the thread level is chosen

from hora.backends.base import SetComm
from hora.backends.registry import BackendContext
from hora.collectives import registry
from hora.collectives.reduce_ops import MAX, MIN, PRODUCT, SUM, reducer
from hora.dtypes import storage_dtype
from hora.identity import Identity

log = logging.getLogger("hora.backends.mpi")

_REDUCE_TYPES = {
    "uint8": MPI.UINT8_T, "int8": MPI.INT8_T, "uint16": MPI.UINT16_T, "int16": MPI.INT16_T,
    "int32": MPI.INT32_T, "int64": MPI.INT64_T, "float32": MPI.FLOAT, "float64": MPI.DOUBLE,
    "bool": MPI.C_BOOL,
}  # fmt: skip
_OPS = {SUM: MPI.SUM, MIN: MPI.MIN, MAX: MPI.MAX, PRODUCT: MPI.PROD}
_BOOL_OPS = {SUM: MPI.LOR, MAX: MPI.LOR, MIN: MPI.LAND, PRODUCT: MPI.LAND}
# data that is only moved travels as unsigned words of its item size
_MOVE_TYPES = {1: MPI.UINT8_T, 2: MPI.UINT16_T, 4: MPI.UINT32_T, 8: MPI.UINT64_T}
_MAX_COUNT = 2**31 - 1


@dataclass
class MpiJob:
    """hora's world as :func:`bootstrap` found it."""

    comm: Any  # MPI.Intracomm: a duplicate of the communicator hora runs on
    identity: Identity  # this process in it, with the store's address and secret
    server: Any  # the RendezvousServer rank 0 started; None elsewhere


def bootstrap(
    comm: Any, iface: str = "", hostname: str = "", listen_any: bool = False
) -> MpiJob:
    """hora's world on ``comm`` (an mpi4py communicator, a list of ``COMM_WORLD`` ranks, or
    None for ``COMM_WORLD``), with a rendezvous store started by its rank 0. ``hostname``
    names this host in the identity (default: MPI's processor name); the store listens on every
    interface only with ``listen_any``."""
    from hora.rendezvous.server import RendezvousServer
    from hora.transport.tcp.transport import advertise_address

    world = _as_comm(comm).Dup()
    rank, size = world.Get_rank(), world.Get_size()
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    cross = world.Split(local_rank, rank)
    cross_rank, cross_size = cross.Get_rank(), cross.Get_size()
    cross.Free()
    hosts = world.gather(MPI.Get_processor_name(), root=0)
    server = None
    info: tuple[str, int, bytes] | str = ""
    if rank == 0:
        try:
            others = [h for h in hosts if h != hosts[0]]
            addr = advertise_address(iface, others[0]) if others or iface else "127.0.0.1"
            secret = secrets.token_bytes(32)
            bind = "0.0.0.0" if listen_any else addr  # the wildcard only when asked for
            server = RendezvousServer(secret, host=bind)
            info = (addr, server.start(), secret)
        except Exception as e:  # tell the others instead of leaving them in bcast
            info = f"{type(e).__name__}: {e}"
    info = world.bcast(info, root=0)
    if isinstance(info, str):
        world.Free()
        raise RuntimeError(f"rank 0 could not start hora's rendezvous store: {info}")
    addr, port, secret = info
    log.debug("MPI bootstrap: rank %d of %d, store at %s:%d", rank, size, addr, port)
    identity = Identity(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=cross_rank,
        cross_size=cross_size,
        hostname=hostname or MPI.Get_processor_name(),
        rendezvous_addr=addr,
        rendezvous_port=port,
        secret=secret,
        source="mpi",
    )
    return MpiJob(world, identity, server)


def _as_comm(comm: Any) -> Any:
    if comm is None:
        return MPI.COMM_WORLD
    if isinstance(comm, MPI.Comm):
        if comm == MPI.COMM_NULL:
            raise ValueError(
                "init(comm=...): this process is not a member of the communicator "
                "(it is MPI.COMM_NULL here); call init only on its members"
            )
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError("init(comm=...) needs an intracommunicator, got an intercommunicator")
        return comm
    if isinstance(comm, (list, tuple, range)):
        world = MPI.COMM_WORLD
        ranks = [int(r) for r in comm]
        if (
            not ranks
            or len(set(ranks)) != len(ranks)
            or not all(0 <= r < world.Get_size() for r in ranks)
        ):
            raise ValueError(
                f"init(comm={list(comm)}): expected distinct ranks of "
                f"MPI.COMM_WORLD in [0, {world.Get_size()})"
            )
        if world.Get_rank() not in ranks:
            raise ValueError(
                f"init(comm={ranks}): rank {world.Get_rank()} of MPI.COMM_WORLD is "
                "not in the list; call init only on the listed ranks"
            )
        group = world.Get_group().Incl(ranks)
        try:
            return world.Create_group(group)
        finally:
            group.Free()
    raise TypeError(
        f"init(comm=...) takes an mpi4py communicator or a list of ranks, got {type(comm).__name__}"
    )


class MpiBackend:
    name = "MPI"

    def __init__(self, ctx: BackendContext) -> None:
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise ValueError(
                "the MPI backend calls MPI from hora's engine thread, which needs "
                "MPI_THREAD_SERIALIZED or better; MPI was initialised with less. "
                "Let mpi4py initialise MPI (mpi4py.rc.thread_level = 'multiple')"
            )
        self._world = ctx.comm if ctx.comm is not None else MPI.COMM_WORLD.Dup()
        me = ctx.identity
        if (self._world.Get_size(), self._world.Get_rank()) != (me.size, me.rank):
            size = self._world.Get_size()
            self._world.Free()
            raise ValueError(
                f"the MPI backend needs the job started by MPI: hora has {me.size} ranks but "
                f"MPI's world has {size}. Start it with `hora run --mpi` or `mpirun`"
            )
        self._rank = me.rank
        self._comms: dict[int, Any] = {}
        self._user_ops: dict[tuple[int, str], Any] = {}

    # -- process sets -----------------------------------------------------------------------
    def add_process_set(self, ps_id: int, ranks: list[int]) -> None:
        if ps_id == 0:
            self._comms[0] = self._world
        elif self._rank in ranks:  # Create_group is collective over the members only
            group = self._world.Get_group().Incl(ranks)
            try:
                self._comms[ps_id] = self._world.Create_group(group, tag=ps_id)
            finally:
                group.Free()

    def remove_process_set(self, ps_id: int, ranks: list[int]) -> None:
        comm = self._comms.pop(ps_id, None)
        if comm is not None and comm != self._world:
            comm.Free()

    def close(self) -> None:
        for comm in self._comms.values():
            if comm != self._world:
                comm.Free()
        self._comms.clear()
        for op in self._user_ops.values():
            op.Free()
        self._user_ops.clear()
        if self._world != MPI.COMM_NULL:
            self._world.Free()

    # -- collectives ------------------------------------------------------------------------
    def allreduce(self, comm: SetComm, buf: np.ndarray, dtype: str, op: int) -> None:
        if buf.size == 0:
            return
        _check_count(buf.size)
        mpi_type, mpi_op = self._reduction(dtype, op)
        self._comm(comm).Allreduce(MPI.IN_PLACE, [buf, mpi_type], op=mpi_op)

    def reducescatterv(self, comm: SetComm, send: np.ndarray, recv: np.ndarray,
                       counts: list[int], dtype: str, op: int) -> None:  # fmt: skip
        _check_count(send.size)
        mpi_type, mpi_op = self._reduction(dtype, op)
        self._comm(comm).Reduce_scatter([send, mpi_type], [recv, mpi_type], counts, op=mpi_op)

    def allgatherv(self, comm: SetComm, send: np.ndarray, recv: np.ndarray,
                   counts: list[int]) -> None:  # fmt: skip
        _check_count(recv.size)
        t = _MOVE_TYPES[send.itemsize]
        self._comm(comm).Allgatherv([_words(send), t], [_words(recv), (counts, _displs(counts)), t])

    def broadcast(self, comm: SetComm, buf: np.ndarray, root: int) -> None:
        _check_count(buf.size)
        self._comm(comm).Bcast([_words(buf), _MOVE_TYPES[buf.itemsize]], root=root)

    def alltoallv(self, comm: SetComm, send: np.ndarray, send_counts: list[int],
                  recv: np.ndarray, recv_counts: list[int]) -> None:  # fmt: skip
        _check_count(max(send.size, recv.size))
        t = _MOVE_TYPES[send.itemsize]
        self._comm(comm).Alltoallv(
            [_words(send), (send_counts, _displs(send_counts)), t],
            [_words(recv), (recv_counts, _displs(recv_counts)), t],
        )

    def adasum(self, comm: SetComm, buf: np.ndarray, dtype: str,
               segments: list[tuple[int, int]]) -> None:  # fmt: skip
        registry.adasum(comm, buf, dtype, segments)  # hora's algorithm over hora's transport

    def barrier(self, comm: SetComm) -> None:
        self._comm(comm).Barrier()

    # -- helpers ----------------------------------------------------------------------------
    def _comm(self, comm: SetComm) -> Any:
        return self._comms[comm.process_set_id]

    def _reduction(self, dtype: str, op: int) -> tuple[Any, Any]:
        if dtype == "bool":
            return MPI.C_BOOL, _BOOL_OPS[op]
        if dtype in _REDUCE_TYPES:
            return _REDUCE_TYPES[dtype], _OPS[op]
        user_op = self._user_ops.get((op, dtype))
        if user_op is None:  # float16, bfloat16: MPI's algorithm, hora's kernel
            user_op = MPI.Op.Create(_kernel(op, dtype), commute=True)
            self._user_ops[(op, dtype)] = user_op
        return MPI.UINT16_T, user_op


def _kernel(op: int, dtype: str) -> Any:
    reduce = reducer(op, dtype)
    st = storage_dtype(dtype)

    def kernel(incoming: Any, acc: Any, _datatype: Any) -> None:
        reduce(np.frombuffer(acc, dtype=st), np.frombuffer(incoming, dtype=st))

    return kernel


def _words(arr: np.ndarray) -> np.ndarray:
    """``arr``'s memory as unsigned words of the same size (bool, float16, ... as raw bits)."""
    return arr.view(f"u{arr.itemsize}")


def _displs(counts: Sequence[int]) -> list[int]:
    out, off = [], 0
    for c in counts:
        out.append(off)
        off += c
    _check_count(off)
    return out


def _check_count(n: int) -> None:
    if n > _MAX_COUNT:
        raise ValueError(
            f"the MPI backend moves at most {_MAX_COUNT} elements per call, got "
            f"{n}; split the tensor or use the native backend"
        )
