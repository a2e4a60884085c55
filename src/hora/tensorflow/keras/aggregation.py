"""Local gradient aggregation for tf_keras optimizers (``backward_passes_per_step`` N > 1).

Horovod's semantics: each pass adds its gradients to per-variable sums held on this rank (no
communication); on every Nth pass the sums are reduced across ranks (one grouped allreduce
through the optimizer's ``GradientReducer``, local variables left out), divided by N with
``average_aggregated_gradients``, handed to the optimizer's update, and reset to zero. On the
other passes the optimizer does not update the variables but ``iterations`` still counts the
pass. Sparse gradients are summed dense. A non-finite gradient goes through as it is (the sum
and the update carry it); the reset assigns zeros, so the next cycle starts clean.

The pass counter and the sums are ``tf.Variable`` s made on first use outside any
``tf.function`` (``tf.init_scope``), so the same object works eagerly and inside the train
step's tf.function; there the "reduce and apply or keep" choice is a ``tf.cond``, and every
rank takes the same branch because every rank counts the same passes. Runs in the training
thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from hora.tensorflow.gradients import GradientReducer, variable_key


class GradientAggregator:
    """Sums ``passes`` passes of gradients locally, then reduces them (Horovod's
    ``backward_passes_per_step``). ``counter`` is the number of passes in the current cycle."""

    def __init__(self, passes: int, reducer: GradientReducer, average: bool) -> None:
        if passes < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self.passes = int(passes)
        self.reducer = reducer
        self.average = bool(average)
        self.counter: tf.Variable | None = None
        self.sums: dict[Any, tf.Variable] = {}

    def register_local_var(self, var: Any) -> None:
        self.reducer.register_local(var)

    @staticmethod
    def _key(position: int, var: Any) -> Any:
        return ("position", position) if var is None else ("variable", variable_key(var))

    def _make_variables(self, grads: list[Any], variables: list[Any]) -> None:
        with tf.init_scope():
            if self.counter is None:
                self.counter = tf.Variable(0, dtype=tf.int32, trainable=False,
                                           name="hora_aggregation_counter")  # fmt: skip
            for i, (g, v) in enumerate(zip(grads, variables)):
                key = self._key(i, v)
                if g is None or key in self.sums:
                    continue
                shape = v.shape if v is not None else g.shape
                self.sums[key] = tf.Variable(tf.zeros(shape, g.dtype), trainable=False,
                                             name="hora_aggregated_gradient")  # fmt: skip

    def compute_gradients(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        """Add this pass's gradients to the sums; return the sums, reduced (and the sums reset)
        when this pass completes a cycle of N. ``None`` gradients stay ``None``."""
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in grads]  # fmt: skip
        variables = list(variables) if variables is not None else [None] * len(grads)
        self._make_variables(grads, variables)
        assert self.counter is not None
        present = [i for i, g in enumerate(grads) if g is not None]
        holders = [self.sums[self._key(i, variables[i])] for i in present]
        summed = [tf.identity(h.assign_add(grads[i])) for h, i in zip(holders, present)]
        count = tf.identity(self.counter.assign_add(1))
        present_vars = [variables[i] for i in present]

        def reduce_and_reset() -> list[Any]:
            out = self.reducer(summed, present_vars)
            if self.average:
                out = [o / tf.cast(self.passes, o.dtype) for o in out]
            with tf.control_dependencies(out):  # the sums are read before they are reset
                resets = [h.assign(tf.zeros_like(h)) for h in holders]
                resets.append(self.counter.assign(0))
            with tf.control_dependencies(resets):
                return [tf.identity(o) for o in out]

        def keep() -> list[Any]:
            return [tf.identity(s) for s in summed]

        if not present:  # nothing to sum: only the pass is counted
            self.counter.assign(tf.math.floormod(count, self.passes))
            return list(grads)
        result = tf.cond(tf.equal(count, self.passes), reduce_and_reset, keep)
        out: list[Any] = list(grads)
        for i, r in zip(present, result):
            out[i] = r
        return out

    def apply_on_last_pass(self, apply: Callable[[], Any], optimizer: Any) -> Any:
        """Run ``apply`` (the optimizer's own ``apply_gradients``) when the cycle was just
        completed (the counter is back at 0); otherwise only count the pass in
        ``optimizer.iterations``."""
        if self.counter is None:  # no gradients seen yet: nothing to apply
            return apply()
        with tf.init_scope():
            iterations = optimizer.iterations  # made outside the branches
        if tf.executing_eagerly():
            if int(self.counter.numpy()) == 0:
                return apply()
            return iterations.assign_add(1)

        def do_apply() -> tf.Tensor:
            apply()
            return tf.constant(True)

        def count_only() -> tf.Tensor:
            iterations.assign_add(1)
            return tf.constant(False)

        return tf.cond(tf.equal(self.counter, 0), do_apply, count_only)
