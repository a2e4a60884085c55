"""``hora.spark.torch`` (``horovod.spark.torch``): train a PyTorch model on a Spark DataFrame."""

from hora.spark.torch.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
