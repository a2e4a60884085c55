"""Horovod's Keras callbacks for ``tf.keras`` (Keras 3, or tf_keras with
``TF_USE_LEGACY_KERAS=1``): see ``hora.tensorflow.keras._impl`` for what each does."""

from __future__ import annotations

import tensorflow as tf

from hora.tensorflow.keras import _impl

_Callback = tf.keras.callbacks.Callback


class BroadcastGlobalVariablesCallback(_impl.BroadcastGlobalVariablesCallbackImpl, _Callback):
    __doc__ = _impl.BroadcastGlobalVariablesCallbackImpl.__doc__


class MetricAverageCallback(_impl.MetricAverageCallbackImpl, _Callback):
    __doc__ = _impl.MetricAverageCallbackImpl.__doc__


class LearningRateScheduleCallback(_impl.LearningRateScheduleCallbackImpl, _Callback):
    __doc__ = _impl.LearningRateScheduleCallbackImpl.__doc__


class LearningRateWarmupCallback(_impl.LearningRateWarmupCallbackImpl, _Callback):
    __doc__ = _impl.LearningRateWarmupCallbackImpl.__doc__
