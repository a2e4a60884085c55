"""``import hora.tensorflow.keras as hvd``: Horovod's ``horovod.tensorflow.keras`` on hora.

The lifecycle and topology calls, ``DistributedOptimizer``,
``PartialDistributedOptimizer``, the callbacks (``hvd.callbacks``),
``load_model``, and Keras-level ``allreduce``/``allgather``/``broadcast``/``reducescatter`` that
take a value and return the result (eagerly a tensor; in a TensorFlow 1 graph, the value run in
the Keras session), plus Horovod's build and timeline queries. Works with whatever ``tf.keras``
is: Keras 3 by default, tf_keras with ``TF_USE_LEGACY_KERAS=1``. Call from the training thread.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

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
from hora.tensorflow.keras import callbacks as callbacks
from hora.tensorflow.keras import elastic as elastic  # hvd.elastic
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
    """``tf.keras.models.load_model`` whose optimizer comes back distributed, state kept.

    ``legacy_opts`` is Horovod's switch to tf_keras' legacy optimizers; hora wraps whatever
    optimizer class the file names, legacy or not, so it changes nothing."""
    return _load_model(tf.keras, filepath, custom_optimizers, custom_objects, compression)


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
