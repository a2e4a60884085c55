"""``hora.spark.keras`` (``horovod.spark.keras``): train a Keras model on a Spark DataFrame."""

from hora.spark.keras.estimator import KerasEstimator, KerasModel

__all__ = ["KerasEstimator", "KerasModel"]
