"""Horovod's Keras callbacks for the ``keras`` package: see ``hora.tensorflow.keras._impl``."""

from __future__ import annotations

import keras

from hora.tensorflow.keras import _impl

_Callback = keras.callbacks.Callback


class BroadcastGlobalVariablesCallback(_impl.BroadcastGlobalVariablesCallbackImpl, _Callback):
    __doc__ = _impl.BroadcastGlobalVariablesCallbackImpl.__doc__


class MetricAverageCallback(_impl.MetricAverageCallbackImpl, _Callback):
    __doc__ = _impl.MetricAverageCallbackImpl.__doc__


class LearningRateScheduleCallback(_impl.LearningRateScheduleCallbackImpl, _Callback):
    __doc__ = _impl.LearningRateScheduleCallbackImpl.__doc__


class LearningRateWarmupCallback(_impl.LearningRateWarmupCallbackImpl, _Callback):
    __doc__ = _impl.LearningRateWarmupCallbackImpl.__doc__
