"""Keras ``DistributedOptimizer``: any Keras optimizer, its gradients reduced across ranks.

Works with both Keras worlds: Keras 3 (``keras``, what ``tf.keras`` is by default) and tf_keras
(``TF_USE_LEGACY_KERAS=1``). The wrapper is a subclass of the optimizer's own class, made on the
fly with the same name and module (so a saved model names the original class), whose gradient
entry point (``apply`` on Keras 3, ``apply_gradients`` on tf_keras) hands the step's gradients to
a ``GradientReducer`` (one grouped allreduce) before the optimizer's own update. On tf_keras the
gradient getters (``compute_gradients``, legacy ``_compute_gradients`` and ``get_gradients``)
return reduced gradients too, as Horovod's do, and ``apply_gradients`` does not reduce those a
second time. With ``backward_passes_per_step`` N > 1 a tf_keras optimizer sums gradients locally
(``aggregation.GradientAggregator``) and reduces and applies them every Nth pass. Runs wherever
Keras runs the train step (eager or inside its tf.function).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora import global_process_set
from hora.frameworks.ops import Average, Sum
from hora.tensorflow.compression import Compression
from hora.tensorflow.gradients import (
    GradientReducer,
    deprecated_num_groups,
    local_layer_variables,
)
from hora.tensorflow.keras.aggregation import GradientAggregator

_CLASSES: dict[type, type] = {}


def _is_keras3(cls: type) -> bool:
    return any(c.__module__.startswith("keras.") and c.__name__ == "BaseOptimizer"
               for c in cls.__mro__)  # fmt: skip


def _is_tf_keras_legacy(cls: type) -> bool:
    """A ``tf_keras.optimizers.legacy`` optimizer class (``OptimizerV2``)."""
    return any(c.__name__ == "OptimizerV2" for c in cls.__mro__)


def _keras3_apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
    grads = list(grads)
    variables = self._trainable_variables if trainable_variables is None else trainable_variables
    reduced = self._hora_reduce(grads, list(variables))
    return super(self._hora_class, self).apply(reduced, trainable_variables)


def _tf_keras_apply_gradients(self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
    pairs = list(grads_and_vars)
    if self._hora_computed:  # from this optimizer's gradient getters: already reduced
        self._hora_computed = False
    else:
        variables = [v for _, v in pairs]
        pairs = list(zip(self._hora_process([g for g, _ in pairs], variables), variables))
    base = super(self._hora_class, self)
    agg = self._agg_helper
    if agg is None:
        return base.apply_gradients(pairs, *args, **kwargs)
    return agg.apply_on_last_pass(lambda: base.apply_gradients(pairs, *args, **kwargs), self)


def _process(self: Any, grads: list[Any], variables: list[Any]) -> list[Any]:
    """Reduce (or, with local aggregation, add to the sums and reduce every Nth pass)."""
    if self._agg_helper is None:
        return self._hora_reduce(grads, variables)
    return self._agg_helper.compute_gradients(grads, variables)


def _processed_pairs(self: Any, pairs: Any) -> list[tuple[Any, Any]]:
    pairs = list(pairs)
    variables = [v for _, v in pairs]
    grads = self._hora_process([g for g, _ in pairs], variables)
    self._hora_computed = True
    return list(zip(grads, variables))


def _tf_keras_compute_gradients(self: Any, loss: Any, var_list: Any, tape: Any = None) -> Any:
    pairs = super(self._hora_class, self).compute_gradients(loss, var_list, tape)
    return self._hora_processed_pairs(pairs)


def _tf_keras_private_compute_gradients(
    self: Any, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None
) -> Any:
    return self.compute_gradients(loss, var_list, tape)


def _legacy_private_compute_gradients(self: Any, loss: Any, var_list: Any, grad_loss: Any = None,
                                      tape: Any = None) -> Any:  # fmt: skip
    pairs = super(self._hora_class, self)._compute_gradients(loss, var_list, grad_loss, tape)
    return self._hora_processed_pairs(pairs)


def _legacy_compute_gradients(self: Any, loss: Any, var_list: Any, tape: Any = None) -> Any:
    return self._compute_gradients(loss, var_list, None, tape)


def _legacy_get_gradients(self: Any, loss: Any, params: Any) -> list[Any]:
    """The optimizer class's own ``get_gradients`` (the legacy optimizers' graph-mode one, or
    a subclass's), reduced: tensors, in order."""
    grads = super(self._hora_class, self).get_gradients(loss, params)
    out = self._hora_process(list(grads), list(tf.nest.flatten(params)))
    self._hora_computed = True
    return out


def _register_local_var(self: Any, var: Any) -> None:
    """Make ``var`` worker-local: its gradients are not reduced across ranks (divided by the
    set's size when the optimizer was made with ``scale_local_gradients=True``)."""
    self._hora_reducer.register_local(var)


def _reduce(self: Any, grads: list[Any], variables: list[Any]) -> list[Any]:
    reduced = self._hora_reducer(grads, variables)
    scale = getattr(self, "_hora_grad_scale", 1.0)
    if scale != 1.0:
        reduced = [g if g is None else g * scale for g in reduced]
    return reduced


def distributed_class(base: type) -> type:
    """The distributed subclass of optimizer class ``base`` (made once per class)."""
    if getattr(base, "_hora_class", None) is base:
        return base
    cls = _CLASSES.get(base)
    if cls is None:
        body: dict[str, Any] = {
            "_hora_reduce": _reduce, "_hora_process": _process,
            "_hora_processed_pairs": _processed_pairs, "register_local_var": _register_local_var,
            "__module__": base.__module__,
        }  # fmt: skip
        if _is_keras3(base):
            body["apply"] = _keras3_apply
        else:
            body["apply_gradients"] = _tf_keras_apply_gradients
            if _is_tf_keras_legacy(base):
                body["_compute_gradients"] = _legacy_private_compute_gradients
                body["compute_gradients"] = _legacy_compute_gradients
            else:
                body["compute_gradients"] = _tf_keras_compute_gradients
                body["_compute_gradients"] = _tf_keras_private_compute_gradients
            # the legacy optimizers' own, or one a subclass of a current optimizer defines
            if hasattr(base, "get_gradients"):
                body["get_gradients"] = _legacy_get_gradients
        body["__qualname__"] = base.__qualname__
        cls = type(base.__name__, (base,), body)
        cls._hora_class = cls
        _CLASSES[base] = cls
    return cls


def make_distributed(optimizer: Any, reducer: GradientReducer, grad_scale: float = 1.0,
                     aggregator: GradientAggregator | None = None) -> Any:  # fmt: skip
    """Turn ``optimizer`` itself into its distributed subclass (its state is kept)."""
    optimizer.__class__ = distributed_class(type(optimizer))
    optimizer._hora_reducer = reducer
    optimizer._hora_grad_scale = grad_scale
    optimizer._hora_computed = False
    optimizer._agg_helper = aggregator
    return optimizer


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """A new optimizer with ``optimizer``'s configuration whose gradients are reduced
    (``op``, default Average) over the ranks before each update.

    ``backward_passes_per_step`` N > 1: variables are updated every N passes with the
    gradients of those passes summed (averaged with ``average_aggregated_gradients=True``).
    tf_keras optimizers sum locally and reduce the sums every Nth pass (Horovod's local
    aggregation; sparse gradients are summed dense); Keras 3 optimizers use their own
    ``gradient_accumulation_steps`` and reduce every pass. ``opt.register_local_var(var)``
    keeps ``var``'s gradients local (divided by the set's size with ``scale_local_gradients``).
    """
    if op != Average and op != Sum:
        raise ValueError(
            "op currently only supports Average and Sum: a Keras DistributedOptimizer averages "
            "or sums the gradients (for Adasum use hora.tensorflow.DistributedGradientTape)"
        )
    num_groups, groups = deprecated_num_groups(
        num_groups, groups,
        "Parameter `num_groups` has been replaced by `groups` and will be removed",
    )  # fmt: skip
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a positive integer or a list of lists of variables")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")
    reducer = GradientReducer(
        compression, sparse_as_dense, op, gradient_predivide_factor, num_groups, groups,
        process_set, scale_local_gradients=scale_local_gradients,
    )  # fmt: skip
    base = type(optimizer)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    scale = 1.0
    aggregator = None
    if backward_passes_per_step > 1:
        if _is_keras3(base):
            config["gradient_accumulation_steps"] = backward_passes_per_step
            scale = 1.0 if average_aggregated_gradients else float(backward_passes_per_step)
        else:
            aggregator = GradientAggregator(
                backward_passes_per_step, reducer, average_aggregated_gradients
            )
    fresh = base.from_config(config)
    return make_distributed(fresh, reducer, scale, aggregator)


def PartialDistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = Average,
    groups: Any = None,
    process_set: Any = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> Any:
    """``DistributedOptimizer`` whose ``local_layers`` (a Keras layer or a list of them) keep
    their gradients local: their trainable variables are registered with
    ``register_local_var``. Without ``local_layers`` it is ``DistributedOptimizer``."""
    local_vars = local_layer_variables(local_layers)
    opt = DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients,
    )  # fmt: skip
    for var in local_vars:
        opt.register_local_var(var)
    return opt


def TensorFlowDistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: Any,
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
    process_set: Any = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """``horovod.tensorflow.DistributedOptimizer``: for a Keras optimizer, the Keras
    ``DistributedOptimizer``; for a TensorFlow 1 optimizer (``tf.compat.v1.train``),
    :mod:`hora.tensorflow.optimizer_v1`'s."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        from hora.tensorflow import optimizer_v1

        return optimizer_v1.DistributedOptimizer(
            optimizer, name, use_locking, device_dense, device_sparse, compression,
            sparse_as_dense, backward_passes_per_step, op, gradient_predivide_factor,
            average_aggregated_gradients, num_groups, groups, process_set, scale_local_gradients,
        )  # fmt: skip
    if not hasattr(optimizer, "get_config"):
        raise ValueError(
            f"hora.tensorflow.DistributedOptimizer needs a Keras optimizer or a "
            f"tf.compat.v1.train.Optimizer, got {type(optimizer).__name__}"
        )
    return DistributedOptimizer(
        optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients,
    )  # fmt: skip
