"""TensorFlow's gradients through a stateful compressor (PowerSGD, top-k).

:class:`hora.frameworks.grad_compression.GradientCompressor` works on NumPy arrays: each dense
gradient is handed over as a NumPy copy and the averages come back as tensors. Eagerly this is a
direct call; inside a ``tf.function`` a ``tf.py_function`` makes it when the step runs. Runs in
the training thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hora.core.process_sets import ProcessSet
from hora.frameworks.grad_compression import GradientCompressor


def compressed_reduce(compressor: GradientCompressor, grads: list[Any], names: Sequence[str],
                      process_set: ProcessSet) -> list[Any]:  # fmt: skip
    """Average ``grads`` (dense tensors or IndexedSlices, none None) named ``names`` over
    ``process_set`` through ``compressor``."""
    dense = [tf.convert_to_tensor(g) for g in grads]

    def run(*tensors: Any) -> list[Any]:
        arrays = {n: np.array(t.numpy(), copy=True, order="C") for n, t in zip(names, tensors)}
        compressor.reduce(arrays, process_set)
        return [tf.convert_to_tensor(a) for a in arrays.values()]

    if tf.executing_eagerly():
        return run(*dense)
    out = tf.py_function(run, dense, Tout=[t.dtype for t in dense])
    for o, t in zip(out, dense):
        o.set_shape(t.shape)
    return list(out)
