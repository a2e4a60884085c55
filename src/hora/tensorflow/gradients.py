"""Reducing one step's gradients across ranks, and ``DistributedGradientTape``.

``GradientReducer`` is shared by the tape and the Keras ``DistributedOptimizer``: dense
gradients of a step travel in one grouped allreduce (or ``num_groups``/``groups`` of them), so
they are negotiated once and fused on the wire; ``tf.IndexedSlices`` are gathered (values and
indices), or densified first with ``sparse_as_dense=True``; a ``None`` gradient stays None.
With ``gradient_predivide_factor`` f (Average only) gradients are scaled by 1/f before the sum
and by f/size after it. Runs in the training thread, eagerly or inside tf.function.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hora import global_process_set
from hora.frameworks.ops import Adasum, Average
from hora.tensorflow.compression import Compression
from hora.tensorflow.mpi_ops import ProcessSet, allreduce, grouped_allreduce


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
    ) -> None:
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        _check_groups(num_groups, groups)
        if isinstance(groups, int):
            num_groups, groups = groups, None
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.gpf = float(gradient_predivide_factor)
        self.num_groups = int(num_groups)
        self.groups = groups
        self.process_set = global_process_set if process_set is None else process_set
        self.name = name

    def active(self) -> bool:
        """Reduce only where there is someone to reduce with (or the job is elastic)."""
        return self.process_set.size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"

    def __call__(self, grads: Sequence[Any], variables: Sequence[Any] | None = None) -> list[Any]:
        grads = list(grads)
        if not self.active():
            return grads
        if self.sparse_as_dense:
            grads = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads
            ]
        pre, post = (1.0 / self.gpf, self.gpf) if self.op == Average else (1.0, 1.0)
        out: list[Any] = list(grads)
        dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(
            g, tf.IndexedSlices)]  # fmt: skip
        for k, i in enumerate(i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)):
            out[i] = allreduce(
                grads[i], op=self.op, compression=self.compression,
                prescale_factor=pre, postscale_factor=post,
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
            where = {v.ref(): n for n, grp in enumerate(self.groups) for v in grp}
            split: list[list[int]] = [[] for _ in range(len(self.groups) + 1)]
            for i in dense:
                split[where.get(variables[i].ref(), len(self.groups))].append(i)
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


class _DistributedGradientTape(tf.GradientTape):
    """A ``tf.GradientTape`` whose ``gradient`` returns gradients reduced over the ranks."""

    _hora_reducer: GradientReducer

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
) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` averages (``op``) gradients over the ranks.

    The returned tape shares ``gradtape``'s recording; use it as the original would be used.
    """
    if op == Adasum and gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    reducer = GradientReducer(
        compression, sparse_as_dense, op, gradient_predivide_factor, num_groups, groups,
        process_set,
    )  # fmt: skip
    base = gradtape.__class__
    cls = base if issubclass(base, _DistributedGradientTape) else type(
        base.__name__, (_DistributedGradientTape, base), {})  # fmt: skip
    tape = cls.__new__(cls)
    tape.__dict__ = gradtape.__dict__  # the same recording, seen through both objects
    tape._hora_reducer = reducer
    return tape

