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
from hora.tensorflow.keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer


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
