"""horovod.tensorflow's collectives on TensorFlow tensors, differentiable with Horovod's rules.

Each collective is an adapter over ``hora.frameworks.ops`` run through ``adapter.bridge`` (one
stateful ``tf.numpy_function``), so it works on tensors and variables in eager mode and inside
``tf.function``. Gradients (``tf.custom_gradient``, floating-point inputs):

- allreduce: the gradient is allreduced with the same op and scale factors.
- allgather: the gradient is Average-allreduced, then this rank's rows are kept.
- broadcast: the gradient is Average-allreduced on the root and zero elsewhere.
- alltoall: the gradient's rows go back where they came from (alltoall with the received splits).
- reducescatter: the gradient is allgathered (times the set's size for Sum).

Backward ops are named ``<name>.grad`` when the forward op was named. ``device_dense``,
``device_sparse`` and ``ignore_name_scope`` are accepted for compatibility (hora reduces on the
host). Blocking; runs in the caller's thread (eager) or a TensorFlow executor thread (graph).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hora import global_process_set
from hora.frameworks import ops
from hora.frameworks.ops import Adasum, Average, Max, Min, Product, Sum, reduce_op
from hora.tensorflow.adapter import aligned_empty, as_tensor, bridge, rows_unknown
from hora.tensorflow.compression import Compression

ProcessSet = Any  # hora.ProcessSet; None means the global set


def _ps(process_set: ProcessSet) -> Any:
    return global_process_set if process_set is None else process_set


def _grad_name(name: str | None) -> str | None:
    return None if name is None else f"{name}.grad"


def _differentiable(t: tf.Tensor) -> bool:
    return bool(t.dtype.is_floating)


# -- the raw ops: one bridge call each, no gradient ----------------------------------------
def _allreduce_raw(
    ts: list[tf.Tensor], name: str | None, op: int, pre: float, post: float, ps: ProcessSet
) -> list[tf.Tensor]:
    grouped = len(ts) > 1

    def fn(nm: str | None, *arrays: np.ndarray) -> list[np.ndarray]:
        kw = dict(name=nm, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps)
        outs = [aligned_empty(a) for a in arrays]  # the engine writes the results here
        if grouped:
            return list(ops.grouped_allreduce(list(arrays), outputs=outs, **kw))
        return [ops.allreduce(arrays[0], output=outs[0], **kw)]

    what = "GroupedAllreduce" if grouped else "Allreduce"
    return bridge(fn, ts, [t.dtype for t in ts], [t.shape for t in ts], what, name)


def _allgather_raw(ts: list[tf.Tensor], name: str | None, ps: ProcessSet) -> list[tf.Tensor]:
    grouped = len(ts) > 1

    def fn(nm: str | None, *arrays: np.ndarray) -> list[np.ndarray]:
        if grouped:
            return list(ops.grouped_allgather(list(arrays), name=nm, process_set=ps))
        return [ops.allgather(arrays[0], name=nm, process_set=ps)]

    shapes = [rows_unknown(t.shape) for t in ts]
    return bridge(fn, ts, [t.dtype for t in ts], shapes, "Allgather", name)


def _broadcast_raw(t: tf.Tensor, root: int, name: str | None, ps: ProcessSet) -> tf.Tensor:
    def fn(nm: str | None, a: np.ndarray) -> list[np.ndarray]:
        return [ops.broadcast(a, root, name=nm, process_set=ps, output=aligned_empty(a))]

    return bridge(fn, [t], [t.dtype], [t.shape], "Broadcast", name)[0]


def _alltoall_raw(
    t: tf.Tensor, splits: tf.Tensor | None, name: str | None, ps: ProcessSet
) -> tuple[tf.Tensor, tf.Tensor]:
    def fn(nm: str | None, a: np.ndarray, *sp: np.ndarray) -> list[np.ndarray]:
        handle = ops.alltoall_async(a, sp[0] if sp else None, name=nm, process_set=ps)
        out, received = ops.synchronize(handle)  # the pair, with or without splits
        return [out, np.asarray(received, dtype=np.int32)]

    inputs = [t] if splits is None else [t, splits]
    shapes = [rows_unknown(t.shape), tf.TensorShape([_ps(ps).size()])]
    out, received = bridge(fn, inputs, [t.dtype, tf.int32], shapes, "Alltoall", name)
    return out, received


def _reducescatter_raw(
    ts: list[tf.Tensor], name: str | None, op: int, pre: float, post: float, ps: ProcessSet
) -> list[tf.Tensor]:
    grouped = len(ts) > 1

    def fn(nm: str | None, *arrays: np.ndarray) -> list[np.ndarray]:
        kw = dict(name=nm, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps)
        if grouped:
            return list(ops.grouped_reducescatter(list(arrays), **kw))
        return [ops.reducescatter(arrays[0], **kw)]

    shapes = [rows_unknown(t.shape) for t in ts]
    return bridge(fn, ts, [t.dtype for t in ts], shapes, "Reducescatter", name)


# -- differentiable forms ------------------------------------------------------------------
def _allreduce_diff(
    ts: list[tf.Tensor], name: str | None, op: int, pre: float, post: float, ps: ProcessSet
) -> list[tf.Tensor]:
    if not all(_differentiable(t) for t in ts):
        return _allreduce_raw(ts, name, op, pre, post, ps)

    @tf.custom_gradient
    def f(*xs: tf.Tensor) -> Any:
        ys = _allreduce_raw(list(xs), name, op, pre, post, ps)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            dys_ = [tf.convert_to_tensor(d) for d in dys]
            return _allreduce_diff(dys_, _grad_name(name), op, pre, post, ps)

        return ys, grad

    return list(f(*ts))


def _offsets(xs: Sequence[tf.Tensor], name: str | None, ps: ProcessSet) -> tf.Tensor:
    """Where this rank's rows start in each of the allgathers of ``xs``: the rows the lower
    ranks of the set gave, for all tensors in one collective."""
    rows = tf.stack([tf.shape(x, out_type=tf.int64)[0] if x.shape.rank != 0
                     else tf.constant(1, tf.int64) for x in xs])  # fmt: skip
    counts = _allgather_raw([tf.reshape(rows, [1, len(xs)])], name, ps)[0]
    return tf.reduce_sum(counts[: _ps(ps).rank()], axis=0)


def _allgather_diff(ts: list[tf.Tensor], name: str | None, ps: ProcessSet) -> list[tf.Tensor]:
    if not all(_differentiable(t) for t in ts):
        return _allgather_raw(ts, name, ps)

    @tf.custom_gradient
    def f(*xs: tf.Tensor) -> Any:
        ys = _allgather_raw(list(xs), name, ps)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            dys_ = [tf.convert_to_tensor(d) for d in dys]
            reduced = _allreduce_diff(dys_, _grad_name(name), Average, 1.0, 1.0, ps)
            starts = _offsets(xs, None if name is None else f"{name}.grad_rows", ps)
            out = []
            for i, (x, g) in enumerate(zip(xs, reduced)):
                shape = tf.shape(x)
                rows = tf.cast(shape[0] if x.shape.rank != 0 else tf.constant(1), tf.int64)
                out.append(tf.reshape(g[starts[i] : starts[i] + rows], shape))
            return out

        return ys, grad

    return list(f(*ts))


def _broadcast_diff(t: tf.Tensor, root: int, name: str | None, ps: ProcessSet) -> tf.Tensor:
    if not _differentiable(t):
        return _broadcast_raw(t, root, name, ps)
    from hora import rank

    @tf.custom_gradient
    def f(x: tf.Tensor) -> Any:
        y = _broadcast_raw(x, root, name, ps)

        def grad(dy: tf.Tensor) -> tf.Tensor:
            reduced = _allreduce_diff(
                [tf.convert_to_tensor(dy)], _grad_name(name), Average, 1.0, 1.0, ps
            )[0]
            if rank() == root:
                return reduced
            with tf.control_dependencies([reduced]):  # a zero TensorFlow may not fold away
                return reduced * tf.zeros([], reduced.dtype)  # (the peers wait for this rank)

        return y, grad

    return f(t)


def _alltoall_diff(
    t: tf.Tensor, splits: tf.Tensor | None, name: str | None, ps: ProcessSet
) -> tuple[tf.Tensor, tf.Tensor]:
    if not _differentiable(t):
        return _alltoall_raw(t, splits, name, ps)
    received_box: list[tf.Tensor] = []

    @tf.custom_gradient
    def f(x: tf.Tensor) -> Any:
        out, received = _alltoall_raw(x, splits, name, ps)
        received_box.append(received)

        def grad(dy: tf.Tensor) -> tf.Tensor:
            back, _ = _alltoall_diff(tf.convert_to_tensor(dy), received, _grad_name(name), ps)
            return back

        return out, grad

    out = f(t)
    return out, tf.stop_gradient(received_box[0])


def _reducescatter_diff(
    ts: list[tf.Tensor], name: str | None, op: int, pre: float, post: float, ps: ProcessSet
) -> list[tf.Tensor]:
    if not all(_differentiable(t) for t in ts):
        return _reducescatter_raw(ts, name, op, pre, post, ps)

    @tf.custom_gradient
    def f(*xs: tf.Tensor) -> Any:
        ys = _reducescatter_raw(list(xs), name, op, pre, post, ps)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            gs = [tf.convert_to_tensor(d) for d in dys]
            scale = pre * post * (_ps(ps).size() if op == Sum else 1)  # Horovod's rule
            if scale != 1.0:
                gs = [g * tf.cast(scale, g.dtype) for g in gs]
            return [
                tf.reshape(_allgather_diff([g], _grad_name(name), ps)[0], tf.shape(x))
                for g, x in zip(gs, xs)
            ]

        return ys, grad

    return list(f(*ts))


# -- the public collectives ----------------------------------------------------------------
def _sparse_allreduce(
    slices: tf.IndexedSlices, name: str | None, op: int, ps: ProcessSet
) -> tf.IndexedSlices:
    """Reduce IndexedSlices by gathering every rank's values and indices (Horovod's rule); an
    Average divides the gathered values by the set's size (true division, as TensorFlow's
    ``/``: integer values become floating point)."""
    values = tf.convert_to_tensor(slices.values)
    nm = (lambda s: None if name is None else f"{name}.{s}")  # noqa: E731
    gathered = _allgather_diff([values], nm("values"), ps)[0]
    indices = _allgather_raw([tf.convert_to_tensor(slices.indices)], nm("indices"), ps)[0]
    if op == Average:
        gathered = gathered / tf.cast(_ps(ps).size(), gathered.dtype)
    return tf.IndexedSlices(gathered, indices, dense_shape=slices.dense_shape)


def _check_sparse(op: int, pre: float, post: float) -> None:
    """What Horovod refuses for a ``tf.IndexedSlices``, refused the same way."""
    if op == Adasum:
        raise NotImplementedError(
            "The Adasum reduction does not currently support sparse tensors; "
            "pass sparse_as_dense=True"
        )
    if op not in (Average, Sum):
        raise NotImplementedError(
            "a tf.IndexedSlices is reduced by gathering it: only op=hvd.Sum and op=hvd.Average "
            "are supported (pass sparse_as_dense=True for other ops)"
        )
    if pre != 1.0 or post != 1.0:
        raise NotImplementedError(
            "prescale_factor and postscale_factor are not supported with tf.IndexedSlices"
        )


def allreduce(
    tensor: Any,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
) -> Any:
    """Reduce ``tensor`` over the set (default Average); a ``tf.IndexedSlices`` is gathered."""
    op = reduce_op(average, op)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(op, prescale_factor, postscale_factor)
        return _sparse_allreduce(tensor, name, op, process_set)
    t = as_tensor(tensor)
    if op == Adasum and not t.dtype.is_floating:
        raise TypeError(f"Adasum needs a floating-point tensor, got {t.dtype.name}")
    compression = ops.compression_for(compression, Compression.none)
    compressed, ctx = compression.compress(t)
    out = _allreduce_diff(
        [compressed], name, op, prescale_factor, postscale_factor, process_set
    )[0]
    return compression.decompress(out, ctx)


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    name: str | None = None,
) -> list[Any]:
    """Reduce a list of tensors as one unit (one negotiation, fused on the wire)."""
    op = reduce_op(average, op)
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_allreduce needs at least one tensor")
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        return [
            allreduce(t, None, "", "", compression, op, prescale_factor, postscale_factor,
                      None if name is None else f"{name}.{i}", process_set)
            for i, t in enumerate(tensors)
        ]  # fmt: skip
    ts = [as_tensor(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    compression = ops.compression_for(compression, Compression.none)
    packed = [compression.compress(t) for t in ts]
    outs = _allreduce_diff(
        [c for c, _ in packed], name, op, prescale_factor, postscale_factor, process_set
    )
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed)]


def allgather(
    tensor: Any,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (dim 0 may differ per rank)."""
    return _allgather_diff([as_tensor(tensor)], name, process_set)[0]


def grouped_allgather(
    tensors: Sequence[Any],
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor]:
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_allgather needs at least one tensor")
    ts = [as_tensor(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    return _allgather_diff(ts, name, process_set)


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """``root_rank``'s (a global rank) tensor on every rank of the set."""
    return _broadcast_diff(as_tensor(tensor), int(root_rank), name, process_set)


def broadcast_(
    variables: Any,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Overwrite each variable (one, or a list) with ``root_rank``'s value, in place.

    All variables travel in one bridge call. Eager and inside tf.function the assignment is
    done when this returns, and the variables are returned; in a TensorFlow 1 graph the
    broadcast values are returned (one tensor per variable), and evaluating them broadcasts
    and assigns, as Horovod's in-place op does.
    """
    single = hasattr(variables, "assign")  # tf.Variable, or a Keras 3 Variable
    vs = [variables] if single else list(variables)
    if not vs:
        return vs
    for i, v in enumerate(vs):
        if not hasattr(v, "assign"):
            raise TypeError(f"broadcast_ needs variables; item {i} is a {type(v).__name__}")
    values = _broadcast_group(
        [as_tensor(v, f"variables[{i}] ({getattr(v, 'name', '?')})") for i, v in enumerate(vs)],
        int(root_rank), name, process_set,
    )  # fmt: skip
    if tf.executing_eagerly() or tf.inside_function():
        for v, val in zip(vs, values):
            v.assign(val)
        return variables
    outs = []
    for v, val in zip(vs, values):  # TF1: nothing runs an assignment nobody fetches
        with tf.control_dependencies([v.assign(val, read_value=False)]):
            outs.append(tf.identity(val))
    return outs[0] if single else outs


def _broadcast_group(
    ts: list[tf.Tensor], root: int, name: str | None, ps: ProcessSet
) -> list[tf.Tensor]:
    """Broadcast several tensors in one bridge call (their ops submitted together)."""
    def fn(nm: str | None, *arrays: np.ndarray) -> list[np.ndarray]:
        base = nm or "broadcast_group"
        handles = [
            ops.broadcast_async(a, root, name=f"{base}.{i}", process_set=ps)
            for i, a in enumerate(arrays)
        ]
        return [ops.synchronize(h) for h in handles]

    return bridge(fn, ts, [t.dtype for t in ts], [t.shape for t in ts], "BroadcastGroup", name)


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Send ``splits[i]`` rows to rank i; returns ``output``, or ``(output, received_splits)``
    when ``splits`` was given."""
    t = as_tensor(tensor)
    sp = None if splits is None else tf.cast(tf.reshape(tf.convert_to_tensor(splits), [-1]),
                                             tf.int32)  # fmt: skip
    out, received = _alltoall_diff(t, sp, name, process_set)
    return out if splits is None else (out, received)


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: Any = Compression.none,
    op: int = Average,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reduce ``tensor`` and keep this rank's block of dim 0 (the first ``N % size`` ranks get
    one row more)."""
    t = as_tensor(tensor)
    compression = ops.compression_for(compression, Compression.none)
    compressed, ctx = compression.compress(t)
    out = _reducescatter_diff(
        [compressed], name, int(op), prescale_factor, postscale_factor, process_set
    )[0]
    return compression.decompress(out, ctx)


def grouped_reducescatter(
    tensors: Sequence[Any],
    device_dense: str = "",
    compression: Any = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    *,
    name: str | None = None,
) -> list[tf.Tensor]:
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_reducescatter needs at least one tensor")
    ts = [as_tensor(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    compression = ops.compression_for(compression, Compression.none)
    packed = [compression.compress(t) for t in ts]
    outs = _reducescatter_diff(
        [c for c, _ in packed], name, int(op), prescale_factor, postscale_factor, process_set
    )
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed)]


# -- control --------------------------------------------------------------------------------
def join(process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Say this rank has no more data; an int32 scalar: the rank that joined last."""

    def fn(nm: str | None) -> list[np.ndarray]:
        return [np.asarray(ops.join(process_set), dtype=np.int32)]

    return bridge(fn, [], [tf.int32], [tf.TensorShape([])], "Join")[0]


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the set has reached the barrier."""
    if tf.executing_eagerly():
        ops.barrier(process_set)
        return

    def fn(nm: str | None) -> list[np.ndarray]:
        ops.barrier(process_set)
        return [np.zeros((), np.int32)]

    bridge(fn, [], [tf.int32], [tf.TensorShape([])], "Barrier")


def _scalar_op(value: Any, what: str, name: str | None) -> tf.Tensor:
    def fn(nm: str | None) -> list[np.ndarray]:
        return [np.asarray(value(), dtype=np.int32)]

    return bridge(fn, [], [tf.int32], [tf.TensorShape([])], what, name, local=True)[0]


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of ranks (of the set), read when the op runs."""
    from hora.core import runtime as _rt

    return _scalar_op(lambda: _rt.runtime().sets[process_set_id].size(), "Size", name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    from hora import local_size

    return _scalar_op(local_size, "LocalSize", name)


def rank_op(name: str | None = None) -> tf.Tensor:
    from hora import rank

    return _scalar_op(rank, "Rank", name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    from hora import local_rank

    return _scalar_op(local_rank, "LocalRank", name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this rank belongs to the set, 0 if not."""
    from hora.core import runtime as _rt

    def included() -> int:
        ps = _rt.runtime().sets.get(process_set_id)
        if ps is None:
            raise ValueError(f"unknown process set id {process_set_id}")
        return int(ps.included())

    return _scalar_op(included, "ProcessSetIncluded", name)


__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "Sum", "allgather", "allreduce", "alltoall",
    "barrier", "broadcast", "broadcast_", "grouped_allgather", "grouped_allreduce",
    "grouped_reducescatter", "join", "local_rank_op", "local_size_op",
    "process_set_included_op", "rank_op", "reduce_op", "reducescatter", "size_op",
]  # fmt: skip
