"""Horovod's Keras callbacks for ``tf.keras`` (Keras 3, or tf_keras with
``TF_USE_LEGACY_KERAS=1``): see ``hora.tensorflow.keras._impl`` for what each does."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora.tensorflow.keras import _impl

_Callback = tf.keras.callbacks.Callback
_ModelCheckpoint = tf.keras.callbacks.ModelCheckpoint


class BroadcastGlobalVariablesCallback(_impl.BroadcastGlobalVariablesCallbackImpl, _Callback):
    __doc__ = _impl.BroadcastGlobalVariablesCallbackImpl.__doc__


class MetricAverageCallback(_impl.MetricAverageCallbackImpl, _Callback):
    __doc__ = _impl.MetricAverageCallbackImpl.__doc__


class LearningRateScheduleCallback(_impl.LearningRateScheduleCallbackImpl, _Callback):
    __doc__ = _impl.LearningRateScheduleCallbackImpl.__doc__


class LearningRateWarmupCallback(_impl.LearningRateWarmupCallbackImpl, _Callback):
    __doc__ = _impl.LearningRateWarmupCallbackImpl.__doc__


class BestModelCheckpoint(_ModelCheckpoint):
    """A ``ModelCheckpoint`` that keeps only the best model by ``monitor`` (Horovod's
    signature). ``save_weights_only``: save the weights alone, as Keras' ``ModelCheckpoint``
    does (no architecture, no optimizer). It saves to ``filepath`` (default
    ``best_model.keras``, or ``best_model.weights.h5`` with ``save_weights_only``, in the
    working directory; set ``.filepath`` to change it, as Horovod's estimators do). Add it on
    rank 0 only."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto", save_freq: Any = "epoch",
                 *, filepath: str | None = None) -> None:  # fmt: skip
        if filepath is None:
            filepath = "best_model.weights.h5" if save_weights_only else "best_model.keras"
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)  # fmt: skip
