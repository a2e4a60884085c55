"""Horovod's Keras callbacks for the ``keras`` package: see ``hora.tensorflow.keras._impl``."""

from __future__ import annotations

from typing import Any

import keras

from hora.tensorflow.keras import _impl

_Callback = keras.callbacks.Callback
_ModelCheckpoint = keras.callbacks.ModelCheckpoint


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
    signature). It saves to ``filepath`` (default ``best_model.keras`` in the working
    directory; set ``.filepath`` to change it, as Horovod's estimators do). Add it on rank 0
    only."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq: Any = "epoch", *,
                 filepath: str = "best_model.keras") -> None:  # fmt: skip
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=False, mode=mode,
                         save_freq=save_freq)  # fmt: skip
