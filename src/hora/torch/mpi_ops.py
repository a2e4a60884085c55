"""``horovod.torch.mpi_ops``: every public name of Horovod's module, from hora's two layers.

Horovod keeps the lifecycle and topology calls, the reduction ops, the async/in-place/grouped
collectives, the blocking differentiable ones (``allreduce``, ``allgather``, ``broadcast``,
``alltoall``, ``reducescatter`` and their grouped forms), their ``torch.autograd.Function``
classes (``HorovodAllreduce``, ...), ``poll``/``synchronize``/``join``/``barrier`` and a few
helpers in this one module, and scripts import any of them from here. hora builds them in
layers: ``hora.torch.async_ops`` (handles, staging) below ``hora.torch.autograd`` (the
blocking, differentiable forms); this module only gathers both, so every name here is the very
object ``hora.torch`` exports.

Nothing runs at import beyond the imports; see the two layers for threads.
"""

from __future__ import annotations

from hora import (
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from hora.common.util import (
    check_installed_version,
    get_average_backwards_compatibility_fun,
    gpu_available,
    num_rank_is_power_2,
)
from hora.core.process_sets import ProcessSet
from hora.errors import HorovodInternalError
from hora.frameworks import ops as _reduce_ops
from hora.torch.async_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather_async,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    poll,
    reduce_op,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from hora.torch.autograd import (
    HorovodAllgather,
    HorovodAllreduce,
    HorovodAlltoall,
    HorovodBroadcast,
    HorovodGroupedAllgather,
    HorovodGroupedAllreduce,
    HorovodGroupedReducescatter,
    HorovodReducescatter,
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from hora.torch.compression import Compression

# ``(op, average) -> op``: the deprecated average= rule as Horovod's module offers it.
handle_average_backwards_compatibility = get_average_backwards_compatibility_fun(_reduce_ops)

__all__ = [
    "Adasum", "Average", "Compression", "HorovodAllgather", "HorovodAllreduce",
    "HorovodAlltoall", "HorovodBroadcast", "HorovodGroupedAllgather", "HorovodGroupedAllreduce",
    "HorovodGroupedReducescatter", "HorovodInternalError", "HorovodReducescatter", "Max", "Min",
    "ProcessSet", "Product", "Sum", "add_process_set", "allgather", "allgather_async",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "ccl_built", "check_installed_version", "cross_rank", "cross_size",
    "cuda_built", "ddl_built", "get_average_backwards_compatibility_fun", "global_process_set",
    "gloo_built", "gloo_enabled", "gpu_available", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "handle_average_backwards_compatibility", "init",
    "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "num_rank_is_power_2", "poll", "rank",
    "reduce_op", "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built",
    "shutdown", "size", "sparse_allreduce_async", "start_timeline", "stop_timeline",
    "synchronize",
]  # fmt: skip
