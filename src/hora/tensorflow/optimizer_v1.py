"""``DistributedOptimizer`` for TensorFlow 1 optimizers (``tf.compat.v1.train.Optimizer``).

The wrapper is itself a ``tf.compat.v1.train.Optimizer``: ``compute_gradients`` asks the
wrapped optimizer for the gradients and reduces them across ranks with a ``GradientReducer``
(the dense gradients of a step in one grouped allreduce, so a ``session.run`` of the train op
holds one hora op); ``apply_gradients``, ``get_slot``, ``get_slot_names`` and ``variables``
are the wrapped optimizer's. ``minimize`` goes through both, as in Horovod.

With ``backward_passes_per_step`` N > 1 (graph mode only) gradients are summed locally into
local variables for N steps; on the N-th they are reduced (and divided by N with
``average_aggregated_gradients=True``) and applied, while the other steps only add (the
``global_step`` passed to ``apply_gradients`` still counts every step).

Graph building runs in the caller's thread; the reduction runs in a TensorFlow executor thread
when the session runs the train op (eager: in the caller's thread).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora import global_process_set
from hora.frameworks.ops import Adasum, Average
from hora.tensorflow.compression import Compression
from hora.tensorflow.gradients import GradientReducer, deprecated_num_groups
from hora.tensorflow.mpi_ops import ProcessSet


class _DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """A TensorFlow 1 optimizer whose ``compute_gradients`` returns reduced gradients."""

    def __init__(
        self,
        optimizer: tf.compat.v1.train.Optimizer,
        reducer: GradientReducer,
        name: str | None = None,
        use_locking: bool = False,
        sparse_as_dense: bool = False,
        backward_passes_per_step: int = 1,
        average_aggregated_gradients: bool = False,
        scale_local_gradients: bool = True,
    ) -> None:
        if name is None:
            name = f"Distributed{type(optimizer).__name__}"
        super().__init__(use_locking=use_locking, name=name)
        self._optimizer = optimizer
        self.process_set = reducer.process_set
        self._reducer = reducer
        self.scale_local_gradients = scale_local_gradients
        self._local_vars: set[Any] = set()
        self._agg: _LocalAggregation | None = None
        if backward_passes_per_step > 1:
            if tf.executing_eagerly():
                raise ValueError(
                    "backward_passes_per_step > 1 is not yet supported for _LegacyOptimizer "
                    "with eager execution."
                )
            self._agg = _LocalAggregation(
                backward_passes_per_step, average_aggregated_gradients, sparse_as_dense,
                self._reduce, name,
            )  # fmt: skip

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local: it is not reduced (but divided by the set's size with
        ``scale_local_gradients=True``, as Horovod does)."""
        self._local_vars.add(var.ref())

    def _reduce(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        """``grads`` reduced over the set (local variables' gradients kept, maybe scaled)."""
        shared = [i for i, v in enumerate(variables) if v.ref() not in self._local_vars]
        out = list(grads)
        reduced = self._reducer([grads[i] for i in shared], [variables[i] for i in shared])
        for i, g in zip(shared, reduced):
            out[i] = g
        if self.scale_local_gradients and self._local_vars:
            size = float(self.process_set.size())
            for i, v in enumerate(variables):
                g = out[i]
                if v.ref() not in self._local_vars or g is None:
                    continue
                if isinstance(g, tf.IndexedSlices):
                    out[i] = tf.IndexedSlices(g.values / size, g.indices, g.dense_shape)
                else:
                    out[i] = g / size
        return out

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's ``(gradient, variable)`` pairs, gradients reduced over the
        ranks (see ``Optimizer.compute_gradients``)."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        if self._agg is not None:
            reduced = self._agg.compute_gradients(grads, variables)
        else:
            reduced = self._reduce(grads, variables)
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                        name: str | None = None) -> Any:  # fmt: skip
        """The wrapped optimizer's ``apply_gradients`` (every N-th step with
        ``backward_passes_per_step`` N)."""
        if self._agg is not None:
            return self._agg.apply_gradients(self._optimizer, grads_and_vars, global_step, name)
        return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)


class _LocalAggregation:
    """Sums gradients in local variables and reduces them every ``passes`` steps (graph mode).

    A local step counter counts the steps since the last reduction; the accumulators are
    cleared when it is 0, and the reduction and the update happen when it reaches ``passes``
    (it is then reset to 0).
    """

    def __init__(self, passes: int, average: bool, sparse_as_dense: bool, reduce: Any,
                 name: str) -> None:  # fmt: skip
        self.passes = int(passes)
        self.average = average
        self.sparse_as_dense = sparse_as_dense
        self.reduce = reduce
        self.name = name
        self.counter: Any = None
        self.sums: list[Any] = []

    def _dense(self, g: Any) -> Any:
        if isinstance(g, tf.IndexedSlices):
            if not self.sparse_as_dense:
                raise ValueError(
                    "IndexedSlices are not supported when `backward_passes_per_step` > 1 and "
                    "`sparse_as_dense` is False."
                )
            return tf.convert_to_tensor(g)
        return g

    def _make_variables(self, grads: list[Any]) -> None:
        local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
        with tf.compat.v1.variable_scope(f"hora_aggregation_{self.name}",
                                         reuse=tf.compat.v1.AUTO_REUSE):  # fmt: skip
            self.counter = tf.compat.v1.get_variable(
                "counter", shape=(), dtype=tf.int32, trainable=False,
                initializer=tf.compat.v1.zeros_initializer(), collections=local,
            )  # fmt: skip
            self.sums = [
                tf.compat.v1.get_variable(
                    f"sum_{i}", shape=g.shape, dtype=g.dtype, trainable=False,
                    initializer=tf.compat.v1.zeros_initializer(), collections=local,
                )  # fmt: skip
                for i, g in enumerate(grads)
            ]

    def compute_gradients(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        present = [i for i, g in enumerate(grads) if g is not None]
        dense = [self._dense(grads[i]) for i in present]
        self._make_variables(dense)
        clear = tf.cond(
            tf.equal(self.counter.read_value(), 0),
            lambda: tf.group(*[s.assign(tf.zeros_like(s)) for s in self.sums]),
            tf.no_op,
        )
        with tf.control_dependencies([clear]):
            added = [s.assign_add(g) for s, g in zip(self.sums, dense)]
        with tf.control_dependencies(added):
            counted = self.counter.assign_add(1)
        present_vars = [variables[i] for i in present]

        def reduce_sums() -> list[Any]:
            reduced = self.reduce([s.read_value() for s in self.sums], present_vars)
            with tf.control_dependencies(reduced):
                reset = self.counter.assign(0)
            with tf.control_dependencies([reset]):
                scale = 1.0 / self.passes if self.average else 1.0
                return [r * tf.cast(scale, r.dtype) for r in reduced]

        with tf.control_dependencies([counted]):
            out = tf.cond(
                tf.equal(self.counter.read_value(), self.passes),
                reduce_sums,
                lambda: [tf.identity(g) for g in dense],
            )
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        result: list[Any] = [None] * len(grads)
        for i, g in zip(present, out):
            result[i] = g
        return result

    def apply_gradients(self, optimizer: Any, grads_and_vars: Any, global_step: Any,
                        name: str | None) -> Any:  # fmt: skip
        pairs = list(grads_and_vars)
        ready = [g for g, _ in pairs if g is not None]
        with tf.control_dependencies(ready):
            applied = tf.cond(
                tf.equal(self.counter.read_value(), 0),
                lambda: tf.group(optimizer.apply_gradients(pairs, global_step=global_step,
                                                           name=name)),  # fmt: skip
                tf.no_op,
            )

        def count_step() -> Any:
            if global_step is None:
                return tf.no_op()
            return tf.group(global_step.assign_add(tf.constant(1, global_step.dtype)))

        with tf.control_dependencies([applied]):
            return tf.cond(tf.equal(self.counter.read_value(), 0), tf.no_op, count_step)


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: tf.compat.v1.train.Optimizer,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> _DistributedOptimizer:
    """Wrap a TensorFlow 1 optimizer so that ``compute_gradients`` reduces (``op``, default
    Average) the gradients over the ranks; ``name`` defaults to ``Distributed<class name>``.

    ``num_groups`` is Horovod's deprecated spelling of an integer ``groups``. ``op=Adasum``
    (Horovod's model-delta optimizer) is not available for TensorFlow 1 optimizers.
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if op == Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be > 0")
    _, groups = deprecated_num_groups(
        num_groups, groups,
        "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
    )  # fmt: skip
    if groups is not None and not (isinstance(groups, list) or (
            isinstance(groups, int) and not isinstance(groups, bool) and groups > 0)):  # fmt: skip
        raise ValueError(
            "groups should be a non-negative integer or a list of list of tf.Variable."
        )
    if op == Adasum:
        raise NotImplementedError(
            "op=hvd.Adasum with a TensorFlow 1 optimizer (Horovod's model-delta optimizer) is "
            "not available in hora; use op=hvd.Average, or reduce with Adasum through "
            "hvd.DistributedGradientTape(tape, op=hvd.Adasum) in TensorFlow 2"
        )
    reducer = GradientReducer(
        compression, sparse_as_dense, op, gradient_predivide_factor, 0, groups, process_set,
    )  # fmt: skip
    return _DistributedOptimizer(
        optimizer, reducer, name=name, use_locking=use_locking, sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        scale_local_gradients=scale_local_gradients,
    )  # fmt: skip


__all__ = ["DistributedOptimizer"]
