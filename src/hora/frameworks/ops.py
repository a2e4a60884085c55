"""The op surface, written once: every collective hora offers, on NumPy arrays.

Framework bindings (``hora.torch``) are adapters over these functions: they turn their tensors
into NumPy views, pass ``dtype=`` where the storage dtype is not the real one (bfloat16) and a
``finalize=`` that turns the NumPy result back into a tensor. Arguments are validated here, in
the caller's thread, so bad input raises at once; everything else happens in the engine thread.
Thread-safe: any user thread may call these.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import numpy as np

from hora.collectives.reduce_ops import ADASUM, AVERAGE, MAX, MIN, PRODUCT, SUM
from hora.core import runtime as _rt
from hora.core.handles import Handle
from hora.core.messages import OpType, Request
from hora.core.process_sets import ProcessSet, resolve
from hora.dtypes import FLOATING
from hora.errors import NotSupportedError, UnsupportedTypeError
from hora.frameworks import repeat
from hora.frameworks.submit import (
    Finalize,
    _handles,
    _outputs,
    _prepare,
    _reduce_op,
    _restore,
    _set_id,
    _submit,
    caller_waits,
)

Average, Sum, Adasum, Min, Max, Product = AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT


def reduce_op(average: bool | None, op: int | None) -> int:
    """Horovod's rule for the deprecated ``average=`` of the framework bindings' reductions:
    never with ``op``; neither means Average. Warns (DeprecationWarning) where it is given."""
    if average is not None:
        if op is not None:
            raise ValueError(
                "The op parameter supersedes average. Please provide only one of them."
            )
        warnings.warn(
            "the average= argument is deprecated: use op=hvd.Average or op=hvd.Sum",
            DeprecationWarning,
            stacklevel=3,
        )
        return Average if average else Sum
    return Average if op is None else int(op)


def compression_for(compression: Any, none: Any) -> Any:
    """The compressor a reduction uses: ``compression``, or ``none`` (the binding's
    ``Compression.none``) where casting cannot pay. A cast compressor (``on_one_host = False``:
    fp16, bf16) in a job whose ranks all share one host would move its bytes through shared
    memory, where the two casts cost more than the halved copies save (the MLP at np=2: 38.5
    ms a step with fp16 against 31.2 without); there nothing is cast, unless
    ``HORA_COMPRESS_ON_ONE_HOST`` says so. The results are those of the uncompressed
    reduction: rounded less than Horovod's, never more. Before ``hvd.init()``, as given."""
    if getattr(compression, "on_one_host", True) or not _rt.is_initialized():
        return compression
    rt = _rt.runtime()
    if rt.identity.local_size < rt.identity.size or rt.settings.compress_on_one_host:
        return compression
    return none


_INTS = (int, np.integer)

_NO_ADASUM_REDUCESCATTER = (
    "reducescatter does not support Adasum: use op=hvd.Sum or hvd.Average, or allreduce "
    "with op=hvd.Adasum"
)


def _reduction(
    kind: OpType,
    arrays: Sequence[Any],
    grouped: bool,
    name: str | None,
    op: int,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet | None,
    outputs: Sequence[Any] | None,
    dtype: str | Sequence[str | None] | None,
    finalize: Finalize,
    priority: int = 0,
) -> Handle:
    if isinstance(priority, bool) or not isinstance(priority, _INTS):
        raise TypeError(f"priority must be an int (higher goes first), got {priority!r}")
    ps_id = _set_id(process_set)
    if op == ADASUM and kind == OpType.ALLREDUCE:
        kind = OpType.ADASUM
        n = len(resolve(process_set).ranks)
        if n & (n - 1):
            raise NotSupportedError(
                f"Adasum needs a power-of-two number of ranks; this process set has {n} "
                "(Horovod: Running Adasum with non-power of 2 ranks is not supported yet.)"
            )

    def make(arr: np.ndarray, dt: str, n: str) -> Request:
        if op == ADASUM and dt not in FLOATING:
            raise UnsupportedTypeError(f"Adasum needs a floating-point tensor, got {dt}")
        if kind == OpType.REDUCESCATTER and arr.ndim == 0:
            raise ValueError("reducescatter needs a tensor of at least one dimension")
        return Request(
            kind,
            n,
            dt,
            tuple(arr.shape),
            reduce_op=op,
            prescale=float(prescale_factor),
            postscale=float(postscale_factor),
            priority=int(priority),
        )

    label = OpType.ALLREDUCE if kind == OpType.ADASUM else kind  # Adasum names as allreduce
    reqs, arrs, handle = _prepare(label, arrays, name, dtype, grouped, finalize, make, ps_id,
                                  reuse=(kind, op, prescale_factor, postscale_factor, priority))
    return _submit(ps_id, reqs, arrs, _outputs(outputs, arrs, dtype, arrays), handle, grouped,
                   arrays)


# -- the collectives ------------------------------------------------------------------------
def allreduce_async(
    array: Any,
    *,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
    output: Any = None,
    dtype: str | None = None,
    finalize: Finalize = None,
    average: bool | None = None,
    priority: int = 0,
) -> Handle:
    return _reduction(
        OpType.ALLREDUCE,
        [array],
        False,
        name,
        _reduce_op(op, average),
        prescale_factor,
        postscale_factor,
        process_set,
        None if output is None else [output],
        dtype,
        finalize,
        priority,
    )


def grouped_allreduce_async(
    arrays: Sequence[Any],
    *,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
    outputs: Sequence[Any] | None = None,
    dtype: str | Sequence[str | None] | None = None,
    finalize: Finalize = None,
    average: bool | None = None,
    priority: int = 0,
) -> Handle:
    _nonempty(arrays, "grouped_allreduce")
    return _reduction(
        OpType.ALLREDUCE,
        arrays,
        True,
        name,
        _reduce_op(op, average),
        prescale_factor,
        postscale_factor,
        process_set,
        outputs,
        dtype,
        finalize,
        priority,
    )


def reducescatter_async(
    array: Any,
    *,
    name: str | None = None,
    op: int | None = None,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    dtype: str | None = None,
    finalize: Finalize = None,
) -> Handle:
    op = _reduce_op(op)
    if op == ADASUM:
        raise NotSupportedError(_NO_ADASUM_REDUCESCATTER)
    return _reduction(
        OpType.REDUCESCATTER,
        [array],
        False,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
        None,
        dtype,
        finalize,
    )


def grouped_reducescatter_async(
    arrays: Sequence[Any],
    *,
    name: str | None = None,
    op: int | None = None,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    dtype: str | Sequence[str | None] | None = None,
    finalize: Finalize = None,
) -> Handle:
    _nonempty(arrays, "grouped_reducescatter")
    op = _reduce_op(op)
    if op == ADASUM:
        raise NotSupportedError(_NO_ADASUM_REDUCESCATTER)
    return _reduction(
        OpType.REDUCESCATTER,
        arrays,
        True,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
        None,
        dtype,
        finalize,
    )


def _gather(
    arrays: Sequence[Any],
    grouped: bool,
    name: str | None,
    process_set: ProcessSet | None,
    dtype: str | Sequence[str | None] | None,
    finalize: Finalize,
) -> Handle:
    ps_id = _set_id(process_set)

    def make(arr: np.ndarray, dt: str, n: str) -> Request:
        shape = tuple(arr.shape) if arr.ndim else (1,)
        return Request(OpType.ALLGATHER, n, dt, shape)

    reqs, arrs, handle = _prepare(
        OpType.ALLGATHER, arrays, name, dtype, grouped, finalize, make, ps_id
    )
    arrs = [a.reshape(1) if a.ndim == 0 else a for a in arrs]
    return _submit(ps_id, reqs, list(arrs), [None] * len(arrs), handle, grouped, arrays)


def allgather_async(
    array: Any,
    *,
    name: str | None = None,
    process_set: ProcessSet | None = None,
    dtype: str | None = None,
    finalize: Finalize = None,
) -> Handle:
    return _gather([array], False, name, process_set, dtype, finalize)


def grouped_allgather_async(
    arrays: Sequence[Any],
    *,
    name: str | None = None,
    process_set: ProcessSet | None = None,
    dtype: str | Sequence[str | None] | None = None,
    finalize: Finalize = None,
) -> Handle:
    _nonempty(arrays, "grouped_allgather")
    return _gather(arrays, True, name, process_set, dtype, finalize)


def broadcast_async(
    array: Any,
    root_rank: int,
    *,
    name: str | None = None,
    process_set: ProcessSet | None = None,
    output: Any = None,
    dtype: str | None = None,
    finalize: Finalize = None,
) -> Handle:
    ps_id = _set_id(process_set)
    ps = resolve(process_set)
    root = int(root_rank)
    if root not in ps.ranks:
        raise ValueError(
            f"broadcast received invalid root rank {root}: the root must be a "
            f"global rank in the process set {ps.ranks}"
        )

    def make(arr: np.ndarray, dt: str, n: str) -> Request:
        return Request(OpType.BROADCAST, n, dt, tuple(arr.shape), root=root)

    reqs, arrs, handle = _prepare(
        OpType.BROADCAST, [array], name, dtype, False, finalize, make, ps_id
    )
    outs = _outputs(None if output is None else [output], arrs, dtype, [array])
    return _submit(ps_id, reqs, list(arrs), outs, handle, False, [array])


def alltoall_async(
    array: Any,
    splits: Any = None,
    *,
    name: str | None = None,
    process_set: ProcessSet | None = None,
    dtype: str | None = None,
    finalize: Finalize = None,
) -> Handle:
    """Result (from ``synchronize``): ``(output, received_splits)``, with or without ``splits``;
    ``splits`` are rows per destination rank (equal blocks when None)."""
    ps_id = _set_id(process_set)
    n = len(resolve(process_set).ranks)

    def make(arr: np.ndarray, dt: str, nm: str) -> Request:
        if arr.ndim == 0:
            raise ValueError("alltoall needs a tensor of at least one dimension")
        rows = arr.shape[0]
        if splits is None:
            if rows % n:
                raise ValueError(
                    f"alltoall without splits needs dim 0 ({rows}) divisible by "
                    f"the number of ranks ({n}); pass splits="
                )
            sp = (rows // n,) * n
        else:
            sp = tuple(int(v) for v in np.asarray(splits).reshape(-1))
            if len(sp) != n or any(v < 0 for v in sp) or sum(sp) != rows:
                raise ValueError(
                    f"alltoall splits {list(sp)} must be {n} non-negative counts "
                    f"summing to dim 0 of the tensor ({rows})"
                )
        return Request(OpType.ALLTOALL, nm, dt, tuple(arr.shape), splits=sp)

    def convert(res: Any, udt: np.dtype) -> Any:
        return _restore(res[0], udt), res[1]

    reqs, arrs, handle = _prepare(
        OpType.ALLTOALL, [array], name, dtype, False, finalize, make, ps_id, convert
    )
    return _submit(ps_id, reqs, list(arrs), [None], handle, False, [array])


def _nonempty(arrays: Sequence[Any], what: str) -> None:
    if len(arrays) == 0:
        raise ValueError(f"{what} needs at least one tensor")


# -- control ops ----------------------------------------------------------------------------
def barrier(process_set: ProcessSet | None = None) -> None:
    _rt.control(OpType.BARRIER, "barrier", _set_id(process_set)).wait()


def join(process_set: ProcessSet | None = None) -> int:
    """Wait until every rank has joined; meanwhile contribute zeros to others' allreduces."""
    return int(_rt.control(OpType.JOIN, "join.noname", _set_id(process_set)).wait())


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    rt = _rt.runtime()
    if not rt.settings.dynamic_process_sets:
        raise ValueError(
            "add_process_set needs dynamic process sets: call "
            "hvd.init(process_sets='dynamic') or set HOROVOD_DYNAMIC_PROCESS_SETS=1"
        )
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError("Attempted to add a duplicate process set")
    return _rt.register_process_set(ps)


def remove_process_set(process_set: ProcessSet) -> bool:
    rt = _rt.runtime()
    if not rt.settings.dynamic_process_sets:
        raise ValueError("remove_process_set needs dynamic process sets (see add_process_set)")
    return _rt.remove_process_set(process_set)


# -- handles --------------------------------------------------------------------------------
def poll(handle: Handle | int) -> bool:
    h = _handles.resolve(handle)
    if h is None:
        raise ValueError(f"unknown handle {int(handle)}")
    return h.done()


def synchronize(handle: Handle | int) -> Any:
    h = _handles.resolve(handle)
    if h is None:
        return None
    try:
        return h.wait()
    finally:
        _handles.release(h)


# -- objects --------------------------------------------------------------------------------
def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: ProcessSet | None = None
) -> Any:
    rt = _rt.runtime()
    name = name or "broadcast_object"  # not the type's name: non-root ranks often pass None
    is_root = rt.identity.rank == root_rank
    payload = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8) if is_root else None
    size = np.array([payload.size if payload is not None else 0], dtype=np.int64)
    size = broadcast(size, root_rank, name=f"{name}.sz", process_set=process_set)
    buf = payload.copy() if payload is not None else np.empty(int(size[0]), dtype=np.uint8)
    buf = broadcast(buf, root_rank, name=f"{name}.t", process_set=process_set)
    return obj if is_root else cloudpickle.loads(buf.tobytes())


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet | None = None
) -> list[Any]:
    name = name or "allgather_object"
    data = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)
    sizes = allgather(
        np.array([data.size], dtype=np.int64), name=f"{name}.sz", process_set=process_set
    )
    blob = allgather(data, name=f"{name}.t", process_set=process_set)
    out, off = [], 0
    for s in sizes.tolist():
        out.append(cloudpickle.loads(blob[off : off + s].tobytes()))
        off += s
    return out


# -- blocking forms -------------------------------------------------------------------------
def _blocking(start: Callable[..., Handle], *args: Any, **kw: Any) -> Any:
    """Submit through ``start`` and wait: the engine may run the op in this thread. The
    handle stays here (it gets no int in the handle table)."""
    with caller_waits():
        handle = start(*args, **kw)
    return handle.wait()


def allreduce(array: Any, **kw: Any) -> Any:
    got = repeat.again(array, kw)  # the same call as this thread's last: the express lane
    if got is not repeat.MISSED:
        return got
    got = _blocking(allreduce_async, array, **kw)
    repeat.remember(array, kw)
    return got


def grouped_allreduce(arrays: Sequence[Any], **kw: Any) -> Any:
    return _blocking(grouped_allreduce_async, arrays, **kw)


def allgather(array: Any, **kw: Any) -> Any:
    return _blocking(allgather_async, array, **kw)


def grouped_allgather(arrays: Sequence[Any], **kw: Any) -> Any:
    return _blocking(grouped_allgather_async, arrays, **kw)


def broadcast(array: Any, root_rank: int, **kw: Any) -> Any:
    return _blocking(broadcast_async, array, root_rank, **kw)


def alltoall(array: Any, splits: Any = None, **kw: Any) -> Any:
    """Horovod's convention: the received rows alone when ``splits`` is None (equal blocks),
    ``(output, received_splits)`` when ``splits`` was given. ``synchronize`` on the handle of
    ``alltoall_async`` always gives the pair."""
    output, received = _blocking(alltoall_async, array, splits, **kw)
    return output if splits is None else (output, received)


def reducescatter(array: Any, **kw: Any) -> Any:
    return _blocking(reducescatter_async, array, **kw)


def grouped_reducescatter(arrays: Sequence[Any], **kw: Any) -> Any:
    return _blocking(grouped_reducescatter_async, arrays, **kw)
