"""``hora.ray.ray_logger`` (Horovod's ``horovod.ray.ray_logger``): values a worker sends to the
``callbacks`` of :meth:`hora.ray.RayExecutor.run` and :meth:`hora.ray.ElasticRayExecutor.run`.

``log(info)`` inside the function that ``run`` runs sends ``info`` (any picklable value,
usually a dict of metrics) to the driver, where every callback is called with it, in the order
logged. By default only rank 0 sends (``chief_only=True``), as in Horovod. A run without
callbacks has no channel: ``log`` then warns once and drops the value. Runs in the worker's
process; the channel is a Ray queue that the run hands to each worker.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

_queue: Any = None
_warned = False


def configure(queue: Any) -> None:
    """Send logged values to ``queue`` (a ``ray.util.queue.Queue``); ``None``: nowhere."""
    global _queue
    _queue = queue


def log(info_dict: Any, chief_only: bool = True) -> None:
    """Send ``info_dict`` to the driver's callbacks; with ``chief_only``, only from rank 0."""
    global _warned
    if chief_only and os.environ.get("HOROVOD_RANK", os.environ.get("HORA_RANK")) != "0":
        return
    if _queue is not None:
        _queue.put(info_dict)
    elif not _warned:
        warnings.warn(
            "hora.ray.ray_logger.log() called but no callbacks were given to run(); the value "
            "is dropped",
            stacklevel=2,
        )
        _warned = True
