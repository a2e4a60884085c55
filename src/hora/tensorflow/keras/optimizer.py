"""Keras ``DistributedOptimizer``: any Keras optimizer, its gradients reduced across ranks.

Works with both Keras worlds: Keras 3 (``keras``, what ``tf.keras`` is by default) and tf_keras
(``TF_USE_LEGACY_KERAS=1``). The wrapper is a subclass of the optimizer's own class, made on the
fly with the same name and module (so a saved model names the original class), whose gradient
entry point (``apply`` on Keras 3, ``apply_gradients`` on tf_keras) hands the step's gradients to
a ``GradientReducer`` (one grouped allreduce) before the optimizer's own update. Runs wherever
Keras runs the train step (eager or inside its tf.function).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora import global_process_set
from hora.frameworks.ops import Average
from hora.tensorflow.compression import Compression
from hora.tensorflow.gradients import GradientReducer

_CLASSES: dict[type, type] = {}


def _is_keras3(cls: type) -> bool:
    return any(c.__module__.startswith("keras.") and c.__name__ == "BaseOptimizer"
               for c in cls.__mro__)  # fmt: skip


def _keras3_apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
    grads = list(grads)
    variables = self._trainable_variables if trainable_variables is None else trainable_variables
    reduced = self._hora_reduce(grads, list(variables))
    return super(self._hora_class, self).apply(reduced, trainable_variables)


def _tf_keras_apply_gradients(self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
    pairs = list(grads_and_vars)
    grads = [g for g, _ in pairs]
    variables = [v for _, v in pairs]
    reduced = self._hora_reduce(grads, variables)
    return super(self._hora_class, self).apply_gradients(
        list(zip(reduced, variables)), *args, **kwargs
    )


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
        body: dict[str, Any] = {"_hora_reduce": _reduce, "__module__": base.__module__}
        if _is_keras3(base):
            body["apply"] = _keras3_apply
        else:
            body["apply_gradients"] = _tf_keras_apply_gradients
        body["__qualname__"] = base.__qualname__
        cls = type(base.__name__, (base,), body)
        cls._hora_class = cls
        _CLASSES[base] = cls
    return cls


def make_distributed(optimizer: Any, reducer: GradientReducer, grad_scale: float = 1.0) -> Any:
    """Turn ``optimizer`` itself into its distributed subclass (its state is kept)."""
    optimizer.__class__ = distributed_class(type(optimizer))
    optimizer._hora_reducer = reducer
    optimizer._hora_grad_scale = grad_scale
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
) -> Any:
    """A new optimizer with ``optimizer``'s configuration whose gradients are reduced
    (``op``, default Average) over the ranks before each update.

    ``backward_passes_per_step`` N > 1 (Keras 3): variables are updated every N steps with the
    gradients of those steps summed (averaged with ``average_aggregated_gradients=True``);
    gradients are still reduced every step.
    """
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")
    reducer = GradientReducer(
        compression, sparse_as_dense, op, gradient_predivide_factor, num_groups, groups,
        process_set,
    )  # fmt: skip
    base = type(optimizer)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    scale = 1.0
    if backward_passes_per_step > 1:
        if not _is_keras3(base):
            raise NotImplementedError(
                "backward_passes_per_step > 1 needs a Keras 3 optimizer "
                "(its gradient_accumulation_steps); tf_keras optimizers take 1"
            )
        config["gradient_accumulation_steps"] = backward_passes_per_step
        scale = 1.0 if average_aggregated_gradients else float(backward_passes_per_step)
    fresh = base.from_config(config)
    return make_distributed(fresh, reducer, scale)


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
) -> Any:
    """``horovod.tensorflow.DistributedOptimizer``: for a Keras optimizer, the Keras
    ``DistributedOptimizer``; for a TensorFlow 1 optimizer (``tf.compat.v1.train``),
    :mod:`hora.tensorflow.optimizer_v1`'s."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        from hora.tensorflow import optimizer_v1

        return optimizer_v1.DistributedOptimizer(
            optimizer, name, use_locking, device_dense, device_sparse, compression,
            sparse_as_dense, backward_passes_per_step, op, gradient_predivide_factor,
            average_aggregated_gradients, num_groups, groups, process_set,
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
        groups=groups, process_set=process_set,
    )  # fmt: skip
