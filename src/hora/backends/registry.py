"""Which backend executes the collectives, chosen the way Horovod chooses.

``HOROVOD_CPU_OPERATIONS`` (or ``HORA_CPU_OPERATIONS``; ``hora run --gloo`` / ``--mpi`` set it)
names the backend for CPU data: ``native`` (hora's own algorithms over its transports, the
default), ``gloo`` (torch.distributed's Gloo) or ``mpi`` (mpi4py). ``HOROVOD_CONTROLLER`` is
accepted as a fallback for the same choice. When neither names one and PyTorch sees a GPU, the
GPU backend does: ``HOROVOD_GPU_OPERATIONS``, or Horovod's per-op ``HOROVOD_GPU_ALLREDUCE``,
``_ALLGATHER``, ``_BROADCAST``, ``_ALLTOALL``, ``_REDUCESCATTER`` (NCCL or MPI, any case). In
Horovod each per-op variable overrides ``HOROVOD_GPU_OPERATIONS`` for its op; hora runs every
collective of a job through one backend, so ``hora.settings`` refuses GPU backends that differ
and ``Settings.gpu_operations`` holds the one named. With NCCL the engine carries CUDA tensors
as they are (``device_buffers``, ``core.executor``); a CPU backend gets host
buffers, CUDA tensors staged through pinned host memory (``hora.torch.adapter``). With
``HOROVOD_HIERARCHICAL_ALLREDUCE`` NCCL reduces inside each host, then across hosts
(``backends.two_level``). Without a GPU the
GPU variables are ignored (Horovod build environments often carry them). Optional dependencies
are imported only when their backend is chosen, so the core never needs them.
Runs in the user thread during ``init``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

from hora.backends.base import Backend
from hora.identity import Identity
from hora.settings import NOT_BUILT, Settings

log = logging.getLogger("hora.backends")

# name -> "module:Class"; a backend registers here and loads lazily
BACKENDS: dict[str, str] = {
    "native": "hora.backends.native:NativeBackend",
    "mpi": "hora.backends.mpi:MpiBackend",
    "gloo": "hora.backends.gloo:GlooBackend",
    "nccl": "hora.backends.nccl:NcclBackend",
}
ALIASES = {"": "native", "tcp": "native", "hora": "native"}


@dataclass
class BackendContext:
    """What a backend may need to set itself up (engine thread and init only)."""

    identity: Identity  # this process's rank, size, local and cross ranks
    settings: Settings
    store: Any = None  # hora.rendezvous.client.StoreClient, None in a world of one
    transport: Any = None  # hora's own transport, None in a world of one
    prefix: str = "hora/0"  # store key prefix of this init generation
    comm: Any = None  # the mpi4py communicator hora runs on, from init(comm=...) or mpirun


def select(settings: Settings) -> str:
    chosen = settings.cpu_operations or settings.controller
    if not chosen and settings.gpu_operations and _gpu_present():
        chosen = settings.gpu_operations
    elif not chosen and settings.gpu_operations:
        # Horovod build environments often carry HOROVOD_GPU_OPERATIONS=NCCL; on a machine
        # without a GPU it says nothing about CPU data, so it must not stop the job.
        log.info("HOROVOD_GPU_OPERATIONS=%s ignored: no GPU here", settings.gpu_operations)
    raw = (chosen or "").strip().lower()
    name = ALIASES.get(raw, raw)
    if name in NOT_BUILT:  # as Horovod answers when it was built without the library
        raise ValueError(
            f"HOROVOD_CPU_OPERATIONS/HOROVOD_GPU_OPERATIONS={raw!r}: {name.upper()} "
            f"({NOT_BUILT[name]}) support is not built into hora; use one of "
            f"{', '.join(sorted(BACKENDS))}"
        )
    if name not in BACKENDS:
        known = ", ".join(sorted(BACKENDS))
        raise ValueError(
            f"HOROVOD_CPU_OPERATIONS/HOROVOD_CONTROLLER/HOROVOD_GPU_OPERATIONS={raw!r}: "
            f"unsupported backend (this build of hora has: {known})"
        )
    return name


def create(name: str, ctx: BackendContext) -> Backend:
    module, cls = BACKENDS[name].split(":")
    backend_cls = getattr(importlib.import_module(module), cls)
    backend: Backend = backend_cls(ctx) if _takes_context(backend_cls) else backend_cls()
    return backend


def _gpu_present() -> bool:
    """Whether PyTorch sees a CUDA device (imports torch only when a GPU backend was asked)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def _takes_context(cls: type) -> bool:
    import inspect

    return len(inspect.signature(cls).parameters) >= 1
