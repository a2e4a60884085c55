"""``import hora.torch as hvd``: Horovod's ``horovod.torch`` API on hora.

Change ``import horovod.torch as hvd`` to ``import hora.torch as hvd`` and nothing else: the
lifecycle and topology calls, every collective on torch tensors (blocking and differentiable,
``*_async`` returning handles for ``poll``/``synchronize``, in-place ``*_``, grouped), the
deprecated ``average=`` rule, ``DistributedOptimizer``, ``broadcast_parameters`` and friends,
``Compression`` and ``SyncBatchNorm`` keep their names, signatures and defaults. hora adds
``Compression.bf16``, a resumable ``DistributedSampler``, the ``LinearScalingWarmup`` LR
scheduler and the ``LARS`` optimizer wrapper.

Everything here may be called from the training thread; see each module for its threads.
"""

from __future__ import annotations

from hora import Handle
from hora.common.util import check_extension
from hora.errors import (
    HoraInternalError,
    HostsUpdatedInterrupt,
)
from hora.torch import casts as _casts  # noqa: F401 - float16/bfloat16 reduced via torch
from hora.torch import elastic as elastic  # hvd.elastic
from hora.torch import threads as _threads  # noqa: F401 - sizes torch's pool at init()
from hora.torch.compression import Compression
from hora.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from hora.torch.lr import LARS, LinearScalingWarmup
from hora.torch.mpi_ops import (  # the very objects horovod.torch.mpi_ops holds
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
    synchronize,
)
from hora.torch.optimizer import DistributedOptimizer
from hora.torch.sampler import DistributedSampler
from hora.torch.sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "DistributedSampler", "Handle",
    "HoraInternalError", "HorovodInternalError", "HostsUpdatedInterrupt", "LARS",
    "LinearScalingWarmup", "Max", "Min", "ProcessSet", "Product", "Sum", "SyncBatchNorm",
    "add_process_set", "allgather", "allgather_async", "allgather_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async",
    "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "ccl_built",
    "check_extension", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "global_process_set", "gloo_built",
    "gloo_enabled", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous",
    "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter",
    "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
]  # fmt: skip
