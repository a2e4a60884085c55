"""What hora.spark's estimators share (``horovod.spark.common``): the stores."""

from hora.spark.common.store import LocalStore, Store

__all__ = ["LocalStore", "Store"]
