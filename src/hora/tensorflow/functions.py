"""Bringing every rank to the root's values: variables and arbitrary objects.

``broadcast_variables`` assigns the root's values to a list of ``tf.Variable`` (one grouped
bridge call); ``broadcast_object``/``allgather_object`` pickle any object. Collective: every rank
calls these in the same order. Run in the training thread (eager, or inside tf.function for
``broadcast_variables``).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora import global_process_set
from hora.frameworks import ops
from hora.tensorflow.mpi_ops import ProcessSet, broadcast_


def broadcast_variables(
    variables: Any,
    root_rank: int,
    process_set: ProcessSet = global_process_set,
    inplace: bool = False,
) -> None:
    """Assign ``root_rank``'s value to every variable of ``variables`` on every rank.

    ``inplace`` is accepted for compatibility: hora always assigns in place.
    """
    vs = list(variables)
    if not vs:
        return
    broadcast_(vs, root_rank, name="broadcast_variables", process_set=process_set)


def broadcast_global_variables(root_rank: int) -> None:
    """TensorFlow 1's global-variable broadcast: not available in eager TensorFlow 2."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. "
            "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead."
        )
    raise RuntimeError(
        "global variables belong to TensorFlow 1 graphs; "
        "use hvd.broadcast_variables(variables, root_rank) instead"
    )


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """The root's ``obj`` on every rank (pickled with cloudpickle). ``session`` is TF1's and
    ignored."""
    return ops.broadcast_object(obj, root_rank, name, process_set)


def broadcast_object_fn(
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """A function ``f(obj)`` that broadcasts ``obj`` from ``root_rank``."""
    return lambda obj: ops.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(
    obj: Any,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[Any]:
    """Every rank's ``obj``, as a list in rank order."""
    return ops.allgather_object(obj, name, process_set)
