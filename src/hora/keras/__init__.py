"""``import hora.keras as hvd``: Horovod's ``horovod.keras`` on hora, for the ``keras`` package.

The same API as ``hora.tensorflow.keras`` (``DistributedOptimizer``,
``PartialDistributedOptimizer``, ``hvd.callbacks``,
``load_model``, the Keras-level collectives), bound to ``import keras`` (Keras 3 on TensorFlow)
instead of ``tf.keras``. Call from the training thread.
"""

from __future__ import annotations

from typing import Any

from hora import (
    ProcessSet,
    add_process_set,
    cross_rank,
    cross_size,
    global_process_set,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    remove_process_set,
    shutdown,
    size,
)
from hora.frameworks.ops import Adasum, Average, Max, Min, Product, Sum
from hora.keras import callbacks as callbacks
from hora.keras import elastic as elastic  # hvd.elastic
from hora.tensorflow import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
    start_timeline,
    stop_timeline,
)
from hora.tensorflow.compression import Compression
from hora.tensorflow.functions import allgather_object, broadcast_object
from hora.tensorflow.keras._impl import (
    allgather,
    allreduce,
    broadcast,
    broadcast_global_variables,
    reducescatter,
)
from hora.tensorflow.keras._impl import load_model as _load_model
from hora.tensorflow.keras.optimizer import DistributedOptimizer as _DistributedOptimizer
from hora.tensorflow.keras.optimizer import PartialDistributedOptimizer


def DistributedOptimizer(  # noqa: N802 (Horovod's name)
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = Average,
    num_groups: int = 0,
    groups: Any = None,
    *,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    process_set: Any = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """``horovod.keras.DistributedOptimizer``: ``hora.tensorflow.keras``'s, with
    ``horovod.keras``'s parameter order (``num_groups`` and ``groups`` right after ``op``); the
    options only ``horovod.tensorflow.keras`` has are keyword-only here."""
    return _DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients,
    )  # fmt: skip


def load_model(filepath: Any, custom_optimizers: Any = None, custom_objects: Any = None,
               compression: Any = Compression.none, legacy_opts: bool = False) -> Any:  # fmt: skip
    """``keras.models.load_model`` whose optimizer comes back distributed, state kept.

    ``legacy_opts`` is Horovod's switch to tf_keras' legacy optimizers; hora wraps whatever
    optimizer class the file names, legacy or not, so it changes nothing."""
    import keras

    return _load_model(keras, filepath, custom_optimizers, custom_objects, compression)


__all__ = [
    "Adasum", "Average", "elastic", "Compression", "DistributedOptimizer", "Max", "Min",
    "PartialDistributedOptimizer", "ProcessSet", "Product", "Sum", "add_process_set",
    "allgather", "allgather_object",
    "allreduce", "broadcast", "broadcast_global_variables", "broadcast_object", "callbacks",
    "cross_rank", "cross_size", "global_process_set", "init", "is_initialized", "load_model",
    "local_rank", "local_size", "rank", "reducescatter", "remove_process_set", "shutdown", "size",
    "ccl_built", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "rocm_built", "start_timeline",
    "stop_timeline",
]  # fmt: skip
