"""TensorFlow 1 graphs and sessions: broadcasting variables as one op, and the session hook.

``broadcast_group_op`` builds, in the default graph, one op that assigns ``root_rank``'s values
to a list of variables: ``broadcast_``'s TF1 form, grouped (every value travels in one bridge
call), so a ``session.run`` of it holds a single hora op. ``broadcast_global_variables`` is
that op over ``tf.compat.v1.global_variables()``; ``BroadcastGlobalVariablesHook`` builds it
when a ``MonitoredTrainingSession`` begins and runs it once the session exists (after the
variables were initialised or restored from a checkpoint), so every rank starts from the root's
values.

Graph building runs in the caller's thread; the op runs in a TensorFlow executor thread when a
session runs it, and blocks it until every rank of the set has run it too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tensorflow as tf

from hora import global_process_set
from hora.tensorflow.mpi_ops import ProcessSet, broadcast_

EAGER_ERROR = (
    "hvd.broadcast_global_variables() does not support eager execution. "
    "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead."
)


def broadcast_group_op(
    variables: Iterable[Any],
    root_rank: int,
    process_set: ProcessSet = global_process_set,
    name: str | None = None,
) -> tf.Operation:
    """An op (of the default graph) assigning ``root_rank``'s value to every variable."""
    vs = list(variables)
    if not vs:
        return tf.no_op(name="HoraBroadcastNothing")
    assigned = broadcast_(vs, int(root_rank), name, process_set)  # evaluating them assigns
    return tf.group(*assigned, name="HoraBroadcastVariables")


def broadcast_global_variables(root_rank: int) -> tf.Operation:
    """An op that broadcasts every global variable of the default graph from ``root_rank``.

    Graph mode only (``tf.compat.v1``): eager execution raises ``RuntimeError``.
    """
    if tf.executing_eagerly():
        raise RuntimeError(EAGER_ERROR)
    return broadcast_group_op(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Broadcasts every global variable from ``root_rank`` once the session is created.

    For ``tf.compat.v1.train.MonitoredTrainingSession(hooks=[...])``: ranks that start from
    random weights, or from a checkpoint only the root has, all continue from the root's values.
    ``device`` is accepted for Horovod's signature (hora broadcasts from host memory).
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op: tf.Operation | None = None
        self.device = device

    def begin(self) -> None:
        graph = tf.compat.v1.get_default_graph()
        if self.bcast_op is None or self.bcast_op.graph is not graph:
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)


__all__ = ["BroadcastGlobalVariablesHook", "broadcast_global_variables", "broadcast_group_op"]
