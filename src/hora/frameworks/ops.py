"""The op surface, written once: every collective hora offers, on NumPy arrays.

Framework bindings (``hora.torch``) are adapters over these functions: they turn their tensors
into NumPy views, pass ``dtype=`` where the storage dtype is not the real one (bfloat16) and a
``finalize=`` that turns the NumPy result back into a tensor. Arguments are validated here, in
the caller's thread, so bad input raises at once; everything else happens in the engine thread.
Thread-safe: any user thread may call these.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import numpy as np

from hora.collectives.reduce_ops import ADASUM, AVERAGE, MAX, MIN, PRODUCT, SUM
from hora.core import runtime as _rt
from hora.core.executor import TensorEntry
from hora.core.handles import Handle, HandleTable
from hora.core.messages import OpType, Request
from hora.core.process_sets import ProcessSet, resolve
from hora.dtypes import FLOATING, name_of, storage_dtype
from hora.errors import DUPLICATE_NAME_MESSAGE

Average, Sum, Adasum, Min, Max, Product = AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT
_OPS = {AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT}

_handles = HandleTable()
_pending_lock = threading.Lock()
_pending: dict[tuple[int, str], int] = {}  # (set id, name) -> 1 while in flight

Finalize = Callable[[Any], Any] | None


# -- validation -----------------------------------------------------------------------------
def _set_id(process_set: ProcessSet | None) -> int:
    rt = _rt.runtime()
    ps = resolve(process_set)
    if ps.process_set_id is None or ps.process_set_id not in rt.sets:
        raise ValueError("Process set provided does not exist, or has not been registered.")
    if rt.identity.rank not in ps.ranks:
        raise ValueError(
            f"rank {rt.identity.rank} is not a member of {ps!r}: only its ranks "
            f"{ps.ranks} may run collectives on it"
        )
    return ps.process_set_id


def _array(x: Any, dtype: str | None) -> tuple[np.ndarray, str, np.dtype]:
    arr = x if isinstance(x, np.ndarray) else np.asarray(x)
    if not arr.flags.c_contiguous:
        raise ValueError("Tensor is required to be contiguous.")
    name = dtype if dtype is not None else name_of(arr.dtype)
    if name == "bfloat16" and arr.dtype.itemsize != 2:
        raise TypeError(f"dtype='bfloat16' needs 2-byte storage, got {arr.dtype}")
    st = storage_dtype(name)
    return (arr if arr.dtype == st else arr.view(st)), name, arr.dtype


def _reduce_op(op: int | None, average: bool | None = None) -> int:
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        op = SUM if average is False else AVERAGE
    if op not in _OPS:
        raise ValueError(
            f"unknown reduction op {op!r}: use hvd.Average, hvd.Sum, hvd.Adasum, "
            "hvd.Min, hvd.Max or hvd.Product"
        )
    return int(op)


def _names(kind: str, name: str | None, count: int | None, ps_id: int) -> list[str]:
    """Horovod's names: ``<op>.<name>``, or ``<op>.noname.<n>`` when none was given.

    ``n`` counts the unnamed ops of this kind on this process set, not handles (as Horovod
    does), so ranks that also run ops on other sets still agree on the name.
    """
    if name:
        base = f"{kind}.{name}"
    else:
        counters = _rt.runtime().auto_names
        n = counters.get((ps_id, kind), 0)
        counters[(ps_id, kind)] = n + 1
        base = f"{kind}.noname.{n}"
    return [base] if count is None else [f"{base}_{i}of{count}" for i in range(count)]


def _restore(arr: np.ndarray, user_dtype: np.dtype) -> np.ndarray:
    return arr if arr.dtype == user_dtype else arr.view(user_dtype)


# -- submission -----------------------------------------------------------------------------
def _submit(
    ps_id: int,
    requests: list[Request],
    arrays: list[np.ndarray | None],
    outputs: list[np.ndarray | None],
    handle: Handle,
    grouped: bool,
) -> Handle:
    """Enqueue one request per tensor; the handle completes when all of them have."""
    rt = _rt.runtime()
    keys = [(ps_id, r.match) for r in requests]
    with _pending_lock:
        for (_, name), req in zip(keys, requests):
            if (ps_id, name) in _pending:
                raise ValueError(DUPLICATE_NAME_MESSAGE.format(op=req.op.name.lower(), name=name))
        for k in keys:
            _pending[k] = 1
    results: list[Any] = [None] * len(requests)
    left = [len(requests)]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def settle(i: int, value: Any, error: BaseException | None) -> None:
        with _pending_lock:
            _pending.pop(keys[i], None)
        with lock:
            results[i] = value
            if error is not None:
                errors.append(error)
            left[0] -= 1
            if left[0]:
                return
        if errors:
            handle.set_error(errors[0])
        else:
            handle.set_result(results if grouped else results[0])

    entries = [
        TensorEntry(
            req, arr, out, (lambda v, i=i: settle(i, v, None)), (lambda e, i=i: settle(i, None, e))
        )
        for i, (req, arr, out) in enumerate(zip(requests, arrays, outputs))
    ]
    _handles.add(handle)
    rt.engine.enqueue(ps_id, entries)
    return handle


def _prepare(
    kind: OpType,
    arrays: Sequence[Any],
    name: str | None,
    dtype: str | Sequence[str | None] | None,
    grouped: bool,
    finalize: Finalize,
    make: Callable[[np.ndarray, str, str], Request],
    ps_id: int,
    convert: Callable[[Any, np.dtype], Any] | None = None,
) -> tuple[list[Request], list[np.ndarray], Handle]:
    """Validate arrays, build their requests, and a handle whose result is in user dtypes.

    ``dtype`` is one name for every array, or (grouped ops) a sequence with one per array.
    """
    handle = Handle()
    names = _names(kind.name.lower(), name, len(arrays) if grouped else None, ps_id)
    dtypes = _per_array(dtype, len(arrays))
    reqs, arrs, udts = [], [], []
    for n, x, d in zip(names, arrays, dtypes):
        arr, dt, udt = _array(x, d)
        req = make(arr, dt, n)
        if grouped:
            req.group, req.group_size = names[0], len(names)
        reqs.append(req)
        arrs.append(arr)
        udts.append(udt)
    conv = convert or _restore

    def post(res: Any) -> Any:
        vals = [conv(r, u) for r, u in zip(res if grouped else [res], udts)]
        out = vals if grouped else vals[0]
        return finalize(out) if finalize is not None else out

    handle._finalize = post
    return reqs, arrs, handle


def _per_array(dtype: Any, n: int) -> list[str | None]:
    if dtype is None or isinstance(dtype, str):
        return [dtype] * n
    dts = list(dtype)
    if len(dts) != n:
        raise ValueError(f"dtype= gives {len(dts)} dtypes for {n} tensors")
    return dts


def _outputs(
    outputs: Sequence[Any] | None,
    arrs: list[np.ndarray],
    dtype: str | Sequence[str | None] | None,
) -> list[np.ndarray | None]:
    if outputs is None:
        return [None] * len(arrs)
    outs: list[np.ndarray | None] = []
    for o, a, d in zip(outputs, arrs, _per_array(dtype, len(arrs))):
        if o is None:
            outs.append(None)
            continue
        if not isinstance(o, np.ndarray):
            raise TypeError("output must be a NumPy array")
        ov = _array(o, d)[0]
        if ov.shape != a.shape or ov.dtype != a.dtype:
            raise ValueError(
                f"output {ov.shape} {ov.dtype} does not match input {a.shape} {a.dtype}"
            )
        outs.append(ov)
    return outs


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
) -> Handle:
    ps_id = _set_id(process_set)
    if op == ADASUM and kind == OpType.ALLREDUCE:
        kind = OpType.ADASUM

    def make(arr: np.ndarray, dt: str, n: str) -> Request:
        if op == ADASUM and dt not in FLOATING:
            raise TypeError(f"Adasum needs a floating-point tensor, got {dt}")
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
        )

    label = OpType.ALLREDUCE if kind == OpType.ADASUM else kind
    reqs, arrs, handle = _prepare(label, arrays, name, dtype, grouped, finalize, make, ps_id)
    for r in reqs:
        r.op = kind
    return _submit(ps_id, reqs, list(arrs), _outputs(outputs, arrs, dtype), handle, grouped)


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
        raise ValueError("reducescatter does not support Adasum")
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
        raise ValueError("reducescatter does not support Adasum")
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
    return _submit(ps_id, reqs, list(arrs), [None] * len(arrs), handle, grouped)


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
    outs = _outputs(None if output is None else [output], arrs, dtype)
    return _submit(ps_id, reqs, list(arrs), outs, handle, False)


def alltoall_async(
    array: Any,
    splits: Any = None,
    *,
    name: str | None = None,
    process_set: ProcessSet | None = None,
    dtype: str | None = None,
    finalize: Finalize = None,
) -> Handle:
    """Result: ``(output, received_splits)``; ``splits`` are rows per destination rank."""
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
    return _submit(ps_id, reqs, list(arrs), [None], handle, False)


def _nonempty(arrays: Sequence[Any], what: str) -> None:
    if len(arrays) == 0:
        raise ValueError(f"{what} needs at least one tensor")


# -- control ops ----------------------------------------------------------------------------
def _control(
    kind: OpType, name: str, process_set: ProcessSet | None, ranks: tuple[int, ...] | None = None
) -> Handle:
    ps_id = _set_id(process_set)
    handle = Handle()
    req = Request(kind, name, ranks=ranks)
    return _submit(ps_id, [req], [None], [None], handle, False)


def barrier(process_set: ProcessSet | None = None) -> None:
    _control(OpType.BARRIER, "barrier", process_set).wait()


def join(process_set: ProcessSet | None = None) -> int:
    """Wait until every rank has joined; meanwhile contribute zeros to others' allreduces."""
    return int(_control(OpType.JOIN, "join.noname", process_set).wait())


def _next_set_op(rt: Any) -> int:
    rt.dynamic_counter += 1
    return int(rt.dynamic_counter)


def register_process_set(ps: ProcessSet) -> ProcessSet:
    """Negotiate ``ps`` with every rank (all must register the same sets in the same order)."""
    rt = _rt.runtime()
    if any(r >= rt.identity.size for r in ps.ranks) or not ps.ranks:
        raise ValueError(
            f"process set ranks {ps.ranks} must be a non-empty subset of 0..{rt.identity.size - 1}"
        )
    name = f"process_set.add.{_next_set_op(rt)}"
    ps_id = int(_control(OpType.ADD_PROCESS_SET, name, None, tuple(ps.ranks)).wait())
    ps._bind(ps_id, rt.identity.rank)
    rt.sets[ps_id] = ps
    return ps


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
    return register_process_set(ps)


def remove_process_set(process_set: ProcessSet) -> bool:
    rt = _rt.runtime()
    if not rt.settings.dynamic_process_sets:
        raise ValueError("remove_process_set needs dynamic process sets (see add_process_set)")
    ps_id = process_set.process_set_id
    if ps_id is None or ps_id == 0 or ps_id not in rt.sets:
        return False
    name = f"process_set.remove.{_next_set_op(rt)}"
    _control(OpType.REMOVE_PROCESS_SET, name, None, tuple(process_set.ranks)).wait()
    del rt.sets[ps_id]
    process_set._unbind()
    return True


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
def allreduce(array: Any, **kw: Any) -> Any:
    return synchronize(allreduce_async(array, **kw))


def grouped_allreduce(arrays: Sequence[Any], **kw: Any) -> Any:
    return synchronize(grouped_allreduce_async(arrays, **kw))


def allgather(array: Any, **kw: Any) -> Any:
    return synchronize(allgather_async(array, **kw))


def grouped_allgather(arrays: Sequence[Any], **kw: Any) -> Any:
    return synchronize(grouped_allgather_async(arrays, **kw))


def broadcast(array: Any, root_rank: int, **kw: Any) -> Any:
    return synchronize(broadcast_async(array, root_rank, **kw))


def alltoall(array: Any, splits: Any = None, **kw: Any) -> Any:
    return synchronize(alltoall_async(array, splits, **kw))


def reducescatter(array: Any, **kw: Any) -> Any:
    return synchronize(reducescatter_async(array, **kw))


def grouped_reducescatter(arrays: Sequence[Any], **kw: Any) -> Any:
    return synchronize(grouped_reducescatter_async(arrays, **kw))
