"""Reducing one step's gradients across ranks, ``DistributedGradientTape`` and
``PartialDistributedGradientTape``.

``GradientReducer`` is shared by the tapes and the Keras ``DistributedOptimizer``: dense
gradients of a step travel in one grouped allreduce (or ``num_groups``/``groups`` of them), so
they are negotiated once and fused on the wire; ``tf.IndexedSlices`` are gathered (values and
indices), or densified first with ``sparse_as_dense=True``; a ``None`` gradient stays None.
With ``gradient_predivide_factor`` f (Average only) gradients are scaled by 1/f before the sum
and by f/size after it. Gradients of variables registered as local (``register_local``) are
not reduced: they stay this rank's own, divided by the set's size with
``scale_local_gradients`` (Horovod's default). Runs in the training thread, eagerly or inside
tf.function.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hora import global_process_set
from hora.frameworks.grad_compression import GradientCompressor
from hora.frameworks.ops import Adasum, Average
from hora.tensorflow.compression import Compression
from hora.tensorflow.grad_compression import compressed_reduce
from hora.tensorflow.mpi_ops import ProcessSet, allreduce, grouped_allreduce


def variable_key(var: Any) -> Any:
    """A hashable identity for a variable: ``tf.Variable.ref()``, for a Keras 3 variable the
    ref of the ``tf.Variable`` that holds its value (Keras 3 variables are not hashable)."""
    if isinstance(var, tf.Variable):
        return var.ref()
    inner = getattr(var, "value", None)
    if isinstance(inner, tf.Variable):
        return inner.ref()
    ref = getattr(var, "ref", None)
    return ref() if callable(ref) else id(var)


def local_layer_variables(local_layers: Any) -> list[Any]:
    """The trainable variables of ``local_layers`` (one Keras layer, a list of them or None)."""
    if local_layers is None:
        return []
    layer_types = _layer_types()
    if isinstance(local_layers, layer_types):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    if not all(isinstance(layer, layer_types) for layer in local_layers):
        raise ValueError(
            "All local layers must be of tf.keras.layers.Layer type: pass local_layers= a "
            "Keras layer or a list of Keras layers (model.layers[i])"
        )
    return [v for layer in local_layers for v in layer.trainable_weights]


def _layer_types() -> tuple[type, ...]:
    types: list[type] = [tf.keras.layers.Layer]
    try:
        import keras

        types.append(keras.layers.Layer)
    except ImportError:  # pragma: no cover - Keras 3 ships with TensorFlow 2.16+
        pass
    return tuple(types)


def _check_groups(num_groups: int, groups: Any) -> None:
    if groups is not None:
        if not isinstance(groups, (list, int)) or isinstance(groups, bool):
            raise ValueError(
                f"groups must be an int or a list of lists of variables, got {type(groups)}"
            )
        if isinstance(groups, int) and groups < 0:
            raise ValueError("groups must be a non-negative integer")
    if num_groups < 0:
        raise ValueError("num_groups must be a non-negative integer")


def deprecated_num_groups(num_groups: int, groups: Any, warning: str) -> tuple[int, Any]:
    """Horovod's deprecated ``num_groups``: a non-zero one warns (``warning``, a
    DeprecationWarning at the caller's caller) and, without ``groups``, becomes ``groups``.
    Returns ``(num_groups, groups)``: ``(0, num_groups)`` where it was moved, else both as given.
    """
    if num_groups != 0:
        warnings.warn(warning, DeprecationWarning, stacklevel=3)
        if groups is None:
            return 0, num_groups
    return num_groups, groups


class GradientReducer:
    """Callable: ``reducer(grads, variables) -> reduced grads`` (same order, Nones kept)."""

    def __init__(
        self,
        compression: Any = Compression.none,
        sparse_as_dense: bool = False,
        op: int = Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Any = None,
        process_set: ProcessSet = global_process_set,
        name: str | None = None,
        scale_local_gradients: bool = True,
    ) -> None:
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        _check_groups(num_groups, groups)
        if isinstance(groups, int):
            num_groups, groups = groups, None
        if isinstance(compression, type) and issubclass(compression, GradientCompressor):
            compression = compression()  # Compression.powersgd without arguments: defaults
        if isinstance(compression, GradientCompressor) and (op != Average or
                                                            gradient_predivide_factor != 1.0):
            raise ValueError(f"compression={compression.kind} averages: use op=Average and no "
                             "gradient_predivide_factor")  # fmt: skip
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.gpf = float(gradient_predivide_factor)
        self.num_groups = int(num_groups)
        self.groups = groups
        self.process_set = global_process_set if process_set is None else process_set
        self.name = name
        self.scale_local_gradients = bool(scale_local_gradients)
        self.local: set[Any] = set()

    def register_local(self, var: Any) -> None:
        """Keep ``var``'s gradients on this rank: never reduced (scaled by 1/size with
        ``scale_local_gradients``)."""
        self.local.add(variable_key(var))

    def is_local(self, var: Any) -> bool:
        return bool(self.local) and var is not None and variable_key(var) in self.local

    def active(self) -> bool:
        """Reduce only where there is someone to reduce with (or the job is elastic), and only
        on the set's members: a rank outside the process set keeps its own gradients."""
        if not self.process_set.included():
            return False
        return self.process_set.size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"

    def __call__(self, grads: Sequence[Any], variables: Sequence[Any] | None = None) -> list[Any]:
        grads = list(grads)
        if not self.active():
            return grads
        if not self.local or variables is None:
            return self._reduce(grads, variables)
        variables = list(variables)
        mine = [i for i, v in enumerate(variables) if self.is_local(v)]
        if not mine:
            return self._reduce(grads, variables)
        local_positions = set(mine)
        shared = [i for i in range(len(grads)) if i not in local_positions]
        out = list(grads)
        reduced = self._reduce([grads[i] for i in shared], [variables[i] for i in shared])
        for i, g in zip(shared, reduced):
            out[i] = g
        if self.scale_local_gradients:
            n = self._size()
            for i in mine:
                out[i] = _divide(grads[i], n)
        return out

    def _size(self) -> Any:
        """The set's size: read when the step runs in an elastic job, where it changes."""
        ps_id = self.process_set.process_set_id
        if os.environ.get("HOROVOD_ELASTIC") == "1" and ps_id is not None:
            from hora.tensorflow.mpi_ops import size_op

            return size_op(ps_id)
        return self.process_set.size()

    def _reduce(self, grads: list[Any], variables: Sequence[Any] | None) -> list[Any]:
        if not grads:
            return []
        if isinstance(self.compression, GradientCompressor):  # PowerSGD, top-k: all at once
            at = [i for i, g in enumerate(grads) if g is not None]
            names = [f"grad.{i}" if variables is None else f"{i}.{variables[i].name}" for i in at]
            out = list(grads)
            done = compressed_reduce(self.compression, [grads[i] for i in at], names,
                                     self.process_set)  # fmt: skip
            for i, g in zip(at, done):
                out[i] = g
            return out
        if self.sparse_as_dense:
            grads = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads
            ]
        pre, post = (1.0 / self.gpf, self.gpf) if self.op == Average else (1.0, 1.0)
        out: list[Any] = list(grads)
        dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(
            g, tf.IndexedSlices)]  # fmt: skip
        for k, i in enumerate(i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)):
            out[i] = allreduce(  # gathered: the predivide factors would cancel out
                grads[i], op=self.op, compression=self.compression,
                name=None if self.name is None else f"{self.name}.sparse.{k}",
                process_set=self.process_set,
            )  # fmt: skip
        for g, members in enumerate(self._split(dense, variables)):
            if not members:
                continue
            reduced = grouped_allreduce(
                [grads[i] for i in members],
                compression=self.compression,
                op=self.op,
                prescale_factor=pre,
                postscale_factor=post,
                process_set=self.process_set,
                name=None if self.name is None else f"{self.name}.{g}",
            )
            for i, r in zip(members, reduced):
                out[i] = r
        return out

    def _split(self, dense: list[int], variables: Sequence[Any] | None) -> list[list[int]]:
        """The positions of the dense gradients, in the groups they are reduced in."""
        if self.groups is not None:
            if variables is None:
                raise ValueError("groups= of variables needs the variables of the gradients")
            where = {variable_key(v): n for n, grp in enumerate(self.groups) for v in grp}
            split: list[list[int]] = [[] for _ in range(len(self.groups) + 1)]
            for i in dense:
                split[where.get(variable_key(variables[i]), len(self.groups))].append(i)
            return split
        if self.num_groups > 0:
            n = min(self.num_groups, max(len(dense), 1))
            size, extra = divmod(len(dense), n)
            split, start = [], 0
            for k in range(n):
                end = start + size + (1 if k < extra else 0)
                split.append(dense[start:end])
                start = end
            return split
        return [dense]


def _divide(grad: Any, n: Any) -> Any:
    """``grad / n`` in ``grad``'s dtype (IndexedSlices: their values)."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(_divide(grad.values, n), grad.indices, grad.dense_shape)
    return grad / tf.cast(n, grad.dtype)


class _DistributedGradientTape(tf.GradientTape):
    """A ``tf.GradientTape`` whose ``gradient`` returns gradients reduced over the ranks
    (but those of sources registered with ``register_local_source``)."""

    _hora_reducer: GradientReducer

    def register_local_source(self, source: Any) -> None:
        """Make ``source`` (a variable) worker-local: its gradient is never reduced, only
        divided by the set's size when the tape was made with ``scale_local_gradients=True``."""
        self._hora_reducer.register_local(source)

    def get_local_and_global_gradients(
        self, target: Any, sources: Any, output_gradients: Any = None,
        unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
    ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:  # fmt: skip
        """``gradient()``, split: ``([(source, grad)] of local sources, [(source, grad)] of
        the others)``, each in the order of ``sources``."""
        flat_sources = tf.nest.flatten(sources)
        grads = tf.nest.flatten(
            self.gradient(target, sources, output_gradients, unconnected_gradients)
        )
        local: list[tuple[Any, Any]] = []
        shared: list[tuple[Any, Any]] = []
        for s, g in zip(flat_sources, grads):
            (local if self._hora_reducer.is_local(s) else shared).append((s, g))
        return local, shared

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:  # fmt: skip
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads, expand_composites=False)
        reduced = self._hora_reducer(flat, flat_sources)
        return tf.nest.pack_sequence_as(grads, reduced)


def DistributedGradientTape(  # noqa: N802 - Horovod's name
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` averages (``op``) gradients over the ranks.

    The returned tape shares ``gradtape``'s recording; use it as the original would be used.
    Sources registered with ``tape.register_local_source(var)`` keep their own gradients,
    divided by the set's size with ``scale_local_gradients`` (the default).
    """
    if op == Adasum and gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    reducer = GradientReducer(
        compression, sparse_as_dense, op, gradient_predivide_factor, num_groups, groups,
        process_set, scale_local_gradients=scale_local_gradients,
    )  # fmt: skip
    base = gradtape.__class__
    cls = base if issubclass(base, _DistributedGradientTape) else type(
        base.__name__, (_DistributedGradientTape, base), {})  # fmt: skip
    tape = cls.__new__(cls)
    tape.__dict__ = gradtape.__dict__  # the same recording, seen through both objects
    tape._hora_reducer = reducer
    return tape


def PartialDistributedGradientTape(  # noqa: N802 - Horovod's name
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """``DistributedGradientTape`` whose ``local_layers`` (a Keras layer or a list of them)
    keep their gradients local: their trainable variables are registered with
    ``register_local_source``. Without ``local_layers`` it is ``DistributedGradientTape``."""
    local_vars = local_layer_variables(local_layers)
    tape = DistributedGradientTape(
        gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
        gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients,
    )  # fmt: skip
    for var in local_vars:
        tape.register_local_source(var)
    return tape
