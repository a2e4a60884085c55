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
    """Start writing a chrome://tracing timeline on rank 0 (any rank may call it); with
    ``{rank}`` in ``file_path`` every rank writes its own file."""
    rt = _rt.runtime()
    path = _rt.timeline_path(file_path, rt.identity.rank)
    if not path:
        return
    stop_timeline()
    rt.engine.settings = rt.engine.settings.replace(timeline_mark_cycles=mark_cycles)
    rt.timeline = _rt.make_timeline(path, rt.engine.settings, rt.identity.rank, rt.identity.size)
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


def _backend() -> str | None:
    """The running job's backend (``native``, ``mpi``, ``gloo``, ``nccl``), None before init."""
    return _rt.runtime().backend_name if _rt.is_initialized() else None


def mpi_built() -> bool:
    return _importable("mpi4py")


def mpi_enabled() -> bool:
    """True while this job runs its collectives through MPI (``hora run --mpi``, ...)."""
    return _backend() == "mpi"


def mpi_threads_supported() -> bool:
    """Whether MPI runs in ``MPI_THREAD_MULTIPLE``, so that other threads may call MPI too."""
    if not mpi_enabled():
        raise ValueError(
            "MPI is not enabled in this hora job: start it with `hora run --mpi` (or "
            "HOROVOD_CPU_OPERATIONS=mpi under mpirun) and call hvd.init() first"
        )
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def gloo_built() -> bool:
    """Whether PyTorch with torch.distributed's Gloo is installed (the Gloo backend needs it)."""
    if not _importable("torch"):
        return False
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_gloo_available())


def gloo_enabled() -> bool:
    """True while this job runs its collectives through Gloo (``hora run --gloo``, ...)."""
    return _backend() == "gloo"


def nccl_built() -> int:
    """NCCL's version code (``2.18.5`` -> 21805) when PyTorch has CUDA and NCCL, else 0."""
    if not cuda_built():
        return 0
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return 0
    major, minor, patch = torch.cuda.nccl.version()[:3]
    return int(major) * 10000 + int(minor) * 100 + int(patch)


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """Whether the installed PyTorch is a CUDA build (hora stages CUDA tensors through host)."""
    if not _importable("torch"):
        return False
    import torch

    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Whether the installed PyTorch is a ROCm build."""
    if not _importable("torch"):
        return False
    import torch

    return getattr(torch.version, "hip", None) is not None


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    """``hora.run`` is :func:`hora.runner.run` itself (so ``help(hora.run)`` and
    ``inspect.signature`` show horovod.run's parameters), imported on first use: the launcher
    is not loaded by ``import hora``."""
    if name == "run":
        from hora.runner import run

        globals()["run"] = run
        return run
    raise AttributeError(f"module 'hora' has no attribute {name!r}")


__all__ = [
    "Adasum",
    "Average",
    "Handle",
    "HoraError",
    "HoraInternalError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "run",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
