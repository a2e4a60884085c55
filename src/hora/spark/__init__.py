"""``hora.spark`` (Horovod's ``horovod.spark``): run hora jobs inside Spark tasks.

Spark schedules, hora trains: :func:`run` starts ``num_proc`` Spark tasks in barrier execution
mode, each task starts one hora rank, and the results come back to the driver in rank order.
:func:`run_elastic` runs an elastic job whose workers come and go with Spark's tasks.
Needs ``pyspark`` (the ``hora[spark]`` extra) and an active SparkContext; importing this module
does not import pyspark.
"""

from __future__ import annotations

from hora.spark.elastic import run_elastic
from hora.spark.runner import run

__all__ = ["run", "run_elastic"]
