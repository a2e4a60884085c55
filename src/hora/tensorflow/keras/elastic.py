"""``hvd.elastic`` for ``hora.tensorflow.keras``: ``KerasState``, the elastic callbacks bound to
``tf.keras``, and ``run``. See ``hora.tensorflow.elastic``."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora.tensorflow import elastic as _e
from hora.tensorflow.elastic import ObjectState, State, TensorFlowKerasState, run

_Callback = tf.keras.callbacks.Callback


class KerasState(TensorFlowKerasState):
    """Elastic state of a Keras model, its optimizer and plain values:
    ``KerasState(model, optimizer=None, **kwargs)``."""

    def __init__(self, model: Any, optimizer: Any = None, *, backend: Any = None,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(model, optimizer, backend=backend, **kwargs)


class CommitStateCallback(_e.CommitStateCallbackImpl, _Callback):
    __doc__ = _e.CommitStateCallbackImpl.__doc__


class UpdateBatchStateCallback(_e.UpdateBatchStateCallbackImpl, _Callback):
    __doc__ = _e.UpdateBatchStateCallbackImpl.__doc__


class UpdateEpochStateCallback(_e.UpdateEpochStateCallbackImpl, _Callback):
    __doc__ = _e.UpdateEpochStateCallbackImpl.__doc__


__all__ = [
    "CommitStateCallback", "KerasState", "ObjectState", "State", "TensorFlowKerasState",
    "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run",
]  # fmt: skip
