"""``SyncBatchNormalization``: Keras batch normalisation with statistics over the global batch.

A subclass of ``tf.keras.layers.BatchNormalization`` (Keras 3 or tf_keras). In training each
rank sums its sample count, per-channel sum and sum of squares; one grouped Sum allreduce makes
them global, from which the mean and variance follow, so the layer normalises as
``BatchNormalization`` would over the concatenated batch of every rank (ranks may hold different
numbers of samples). The gradient flows through the allreduce (its gradient is a Sum
allreduce). On one rank, with a mask, or in inference it is plain ``BatchNormalization``.

Runs wherever Keras runs the layer (eager or tf.function); every rank of the set must run the
same layers in the same order.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora import global_process_set
from hora.frameworks.ops import Sum
from hora.tensorflow.mpi_ops import grouped_allreduce


def _global_moments(
    inputs: tf.Tensor, axes: Any, keepdims: bool, process_set: Any
) -> tuple[tf.Tensor, tf.Tensor]:
    x = tf.convert_to_tensor(inputs)
    stat = tf.float64 if x.dtype == tf.float64 else tf.float32
    xs = tf.cast(x, stat)
    axes = [a % x.shape.rank for a in axes]
    count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(xs), axes)), stat)
    total = tf.reduce_sum(xs, axes, keepdims=True)
    squares = tf.reduce_sum(tf.square(xs), axes, keepdims=True)
    count_g, total_g, squares_g = grouped_allreduce(
        [tf.reshape(count, [1]), total, squares], op=Sum, process_set=process_set
    )
    mean = total_g / count_g[0]
    variance = tf.maximum(squares_g / count_g[0] - tf.square(mean), 0.0)
    if not keepdims:
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    return tf.cast(mean, x.dtype), tf.cast(variance, x.dtype)


_KERAS3 = tf.keras.layers.BatchNormalization.__module__.startswith("keras.")


class SyncBatchNormalization(tf.keras.layers.BatchNormalization):
    """``BatchNormalization`` whose batch statistics are those of every rank's batch together.

    ``SyncBatchNormalization(fused=False, **kwargs)`` as in Horovod: ``BatchNormalization``'s
    keyword arguments, and hora's ``process_set=`` (default: every rank). ``fused`` must stay
    False (the fused kernel would compute each rank's own statistics): True or None is a
    ValueError. Keras 3 has no fused kernel; tf_keras gets ``fused=False``.
    """

    def __init__(
        self, fused: bool | None = False, *, process_set: Any = global_process_set, **kwargs: Any
    ) -> None:
        if fused in (True, None):
            raise ValueError(
                f"SyncBatchNormalization(fused={fused}): the fused kernel computes each rank's "
                "own batch statistics; leave fused=False (the default)"
            )
        if not _KERAS3:
            kwargs["fused"] = False
        super().__init__(**kwargs)
        self._hora_process_set = process_set

    def _sync(self) -> bool:
        return bool(self._hora_process_set.size() > 1)

    def _moments(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if not _KERAS3:  # tf_keras: _moments(inputs, reduction_axes, keep_dims, mask=None)
            return super()._moments(inputs, *args, **kwargs)
        mask = args[0] if args else kwargs.get("mask")  # Keras 3: _moments(inputs, mask)
        if mask is not None or not self._sync():
            return super()._moments(inputs, *args, **kwargs)
        return _global_moments(inputs, self._reduction_axes, False, self._hora_process_set)

    def _calculate_mean_and_var(
        self, inputs: Any, reduction_axes: Any, keep_dims: bool, mask: Any = None
    ) -> Any:  # tf_keras
        if mask is not None or not self._sync():
            return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask=mask)
        return _global_moments(inputs, reduction_axes, keep_dims, self._hora_process_set)
