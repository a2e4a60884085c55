"""hora: Horovod's distributed training, rebuilt in Python. This module is the NumPy API.

``import hora as hvd`` gives Horovod's framework-agnostic surface on NumPy arrays:
``hvd.init()``, ``hvd.rank()``, ``hvd.allreduce(x)``, ... ``hora.torch`` offers the same on
torch tensors. Everything here is safe to call from any user thread.
"""

from __future__ import annotations

from hora.core import runtime as _rt
from hora.core.handles import Handle
from hora.core.process_sets import ProcessSet, global_process_set
from hora.core.runtime import init, is_initialized, shutdown
from hora.errors import (
    HoraError,
    HoraInternalError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
)
from hora.frameworks.ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    add_process_set,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_async,
    broadcast_object,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    synchronize,
)

__version__ = "0.1.0"


# -- topology -------------------------------------------------------------------------------
def rank() -> int:
    return _rt.runtime().identity.rank


def size() -> int:
    return _rt.runtime().identity.size


def local_rank() -> int:
    return _rt.runtime().identity.local_rank


def local_size() -> int:
    return _rt.runtime().identity.local_size


def cross_rank() -> int:
    return _rt.runtime().identity.cross_rank


def cross_size() -> int:
    return _rt.runtime().identity.cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    ident = _rt.runtime().identity
    return ident.size == ident.local_size * ident.cross_size


# -- in-place forms (NumPy arrays are updated in place) -------------------------------------
def allreduce_(array, **kw):  # type: ignore[no-untyped-def]
    return allreduce(array, output=array, **kw)


def allreduce_async_(array, **kw):  # type: ignore[no-untyped-def]
    return allreduce_async(array, output=array, **kw)


def grouped_allreduce_(arrays, **kw):  # type: ignore[no-untyped-def]
    return grouped_allreduce(arrays, outputs=arrays, **kw)


def grouped_allreduce_async_(arrays, **kw):  # type: ignore[no-untyped-def]
    return grouped_allreduce_async(arrays, outputs=arrays, **kw)


def broadcast_(array, root_rank, **kw):  # type: ignore[no-untyped-def]
    return broadcast(array, root_rank, output=array, **kw)


def broadcast_async_(array, root_rank, **kw):  # type: ignore[no-untyped-def]
    return broadcast_async(array, root_rank, output=array, **kw)


# -- timeline -------------------------------------------------------------------------------
def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a chrome://tracing timeline on rank 0 (any rank may call it)."""
    rt = _rt.runtime()
    if rt.identity.rank != 0:
        return
    stop_timeline()
    from hora.core.timeline import Timeline

    rt.timeline = Timeline(file_path, mark_cycles=mark_cycles)
    rt.engine.settings = rt.engine.settings.replace(timeline_mark_cycles=mark_cycles)
    rt.engine.timeline = rt.engine.executor.timeline = rt.timeline


def stop_timeline() -> None:
    rt = _rt.runtime()
    tl, rt.timeline = rt.timeline, None
    rt.engine.timeline = rt.engine.executor.timeline = None
    if tl is not None:
        tl.close()


# -- what this build has --------------------------------------------------------------------
def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def mpi_built() -> bool:
    return _importable("mpi4py")


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    raise ValueError("MPI is not enabled in this hora job (the native backend is in use)")


def gloo_built() -> bool:
    return _importable("torch")


def gloo_enabled() -> bool:
    return False


def nccl_built() -> int:
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def run(*args, **kwargs):  # type: ignore[no-untyped-def]
    """Run a function on every rank: see :func:`hora.launch.api.run`."""
    from hora.launch.api import run as _run

    return _run(*args, **kwargs)


__all__ = [
    "Adasum", "Average", "Handle", "HoraError", "HoraInternalError", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Max", "Min", "ProcessSet", "Product", "Sum", "add_process_set",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set",
    "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async", "init",
    "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter",
    "reducescatter_async", "remove_process_set", "rocm_built", "run", "shutdown", "size",
    "start_timeline", "stop_timeline", "synchronize",
]
