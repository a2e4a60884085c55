"""Bringing every rank to the root's values: variables and arbitrary objects.

``broadcast_variables`` assigns the root's values to a list of ``tf.Variable`` (one grouped
bridge call); ``broadcast_object``/``allgather_object`` pickle any object. Collective: every rank
calls these in the same order. Run in the training thread (eager, or inside tf.function for
``broadcast_variables``). In a TensorFlow 1 graph ``broadcast_variables`` and
``broadcast_global_variables`` return an op that a session runs (:mod:`hora.tensorflow.graph_v1`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora import global_process_set
from hora.frameworks import ops
from hora.tensorflow import graph_v1
from hora.tensorflow.mpi_ops import ProcessSet, broadcast_


def broadcast_variables(
    variables: Any,
    root_rank: int,
    process_set: ProcessSet = global_process_set,
    inplace: bool = False,
) -> Any:
    """Assign ``root_rank``'s value to every variable of ``variables`` on every rank.

    Eager (or inside tf.function): assigns at once, returns None. In a TensorFlow 1 graph:
    returns the op that does it when a session runs it. ``inplace`` is accepted for
    compatibility: hora always assigns in place.
    """
    vs = list(variables)
    if not tf.executing_eagerly() and not tf.inside_function():  # a TensorFlow 1 graph
        return graph_v1.broadcast_group_op(vs, root_rank, process_set, name="broadcast_variables")
    if not vs:
        return None
    broadcast_(vs, root_rank, name="broadcast_variables", process_set=process_set)
    return None


def broadcast_global_variables(root_rank: int) -> Any:
    """TensorFlow 1: the op that broadcasts every global variable of the default graph from
    ``root_rank`` (run it in a session). Eager execution raises ``RuntimeError``."""
    return graph_v1.broadcast_global_variables(root_rank)


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
