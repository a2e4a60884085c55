"""``import hora.tensorflow as hvd``: Horovod's ``horovod.tensorflow`` API on hora.

Change ``import horovod.tensorflow as hvd`` to ``import hora.tensorflow as hvd`` and nothing
else: the lifecycle, topology and process-set calls, every collective on ``tf.Tensor`` and
``tf.Variable`` (eager and inside ``tf.function``, differentiable with Horovod's gradient
rules), ``DistributedGradientTape``, ``DistributedOptimizer`` (Keras optimizers, and TensorFlow
1's ``tf.compat.v1.train`` optimizers), ``broadcast_variables``, TensorFlow 1's
``broadcast_global_variables`` and ``BroadcastGlobalVariablesHook``,
``broadcast_object``/``allgather_object``, ``Compression`` and ``SyncBatchNormalization`` keep
their names, signatures and defaults.

Call from the training thread (eager), from inside ``tf.function``, or while building a
TensorFlow 1 graph (``tf.compat.v1``; the ops then run when a session runs them).
"""

from __future__ import annotations

from hora import (
    ProcessSet,
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
from hora.errors import HoraInternalError, HorovodInternalError, HostsUpdatedInterrupt
from hora.tensorflow import elastic as elastic  # hvd.elastic
from hora.tensorflow.compression import Compression
from hora.tensorflow.functions import (
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from hora.tensorflow.gradients import DistributedGradientTape, PartialDistributedGradientTape
from hora.tensorflow.graph_v1 import BroadcastGlobalVariablesHook
from hora.tensorflow.keras.optimizer import (
    TensorFlowDistributedOptimizer as DistributedOptimizer,
)
from hora.tensorflow.mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    reducescatter,
    size_op,
)
from hora.tensorflow.sync_batch_norm import SyncBatchNormalization
from hora.tensorflow.util import _executing_eagerly  # noqa: F401 - Horovod's hvd._executing_eagerly

__all__ = [
    "Adasum", "Average", "BroadcastGlobalVariablesHook", "elastic", "Compression",
    "DistributedGradientTape", "PartialDistributedGradientTape",
    "DistributedOptimizer", "HoraInternalError", "HorovodInternalError", "HostsUpdatedInterrupt",
    "Max", "Min", "ProcessSet", "Product", "Sum", "SyncBatchNormalization", "add_process_set",
    "allgather", "allgather_object", "allreduce", "alltoall", "barrier", "broadcast", "broadcast_",
    "broadcast_global_variables", "broadcast_object", "broadcast_object_fn", "broadcast_variables",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set",
    "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allreduce",
    "grouped_reducescatter", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
    "local_rank_op", "local_size", "local_size_op", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "process_set_included_op", "rank", "rank_op",
    "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size", "size_op",
    "start_timeline", "stop_timeline",
]  # fmt: skip
