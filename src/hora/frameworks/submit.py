"""Validation and submission for the op surface: the machinery every collective shares.

Turns arrays into validated storage views and Requests, names them as Horovod does, enqueues
them with the engine under one handle, and tracks names in flight so that a duplicate raises at
once. Called from user threads; thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from hora.collectives.reduce_ops import ADASUM, AVERAGE, MAX, MIN, PRODUCT, SUM
from hora.core import runtime as _rt
from hora.core import solo
from hora.core.buffers import DeviceArray
from hora.core.executor import TensorEntry
from hora.core.handles import Handle, HandleTable, Key, in_flight
from hora.core.messages import OpType, Request
from hora.core.process_sets import ProcessSet, resolve
from hora.dtypes import name_of, storage_dtype

_OPS = {AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT}
_KINDS = {kind: kind.name.lower() for kind in OpType}  # the names' prefixes

_handles = HandleTable()
# ``waits``: set while a blocking form submits (caller_waits); ``ready``: the next submission's
# wait for data still arriving (engine_waits)
_caller = threading.local()

Finalize = Callable[[Any], Any] | None

# requests made for named ops, by everything they are made from (_prepare's ``reuse``): a
# training loop submits the same tensors step after step
_requests: dict[tuple[Any, ...], Request] = {}
_REQUESTS_KEPT = 4096
# the same, for one named NumPy array in its own dtype (a blocking loop's call): by the name
# as given and the array's dtype, so that such a call finds its request before it names,
# validates or views anything
_plain: dict[tuple[Any, ...], Request] = {}


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
    if isinstance(x, np.ndarray):
        arr = x
    elif isinstance(x, DeviceArray):  # a device buffer for a backend that takes it as it is
        return x.data, x.dtype, x.data.dtype
    else:
        arr = np.asarray(x)
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

    ``n`` counts this process set's unnamed ops of every kind together, as Horovod's handles
    do, so unnamed ops of different kinds in flight at once never share a name (ops are matched
    without their op prefix). Counting per set rather than per process keeps ranks that also
    run ops on other sets agreeing on the name.
    """
    if name:
        base = f"{kind}.{name}"
    else:
        counters = _rt.runtime().auto_names
        n = counters.get(ps_id, 0)
        counters[ps_id] = n + 1
        base = f"{kind}.noname.{n}"
    return [base] if count is None else [f"{base}_{i}of{count}" for i in range(count)]


def _restore(arr: np.ndarray, user_dtype: np.dtype) -> np.ndarray:
    return arr if arr.dtype == user_dtype else arr.view(user_dtype)


# -- submission -----------------------------------------------------------------------------
def _submit(
    ps_id: int,
    requests: list[Request],
    arrays: Sequence[np.ndarray | None],
    outputs: list[np.ndarray | None],
    handle: Handle,
    grouped: bool,
    inputs: Sequence[Any] = (),
) -> Handle:
    """Enqueue one request per tensor; the handle completes when all of them have. A set of
    one runs them here and now instead (``hora.core.solo``; ``inputs``: the caller's arrays,
    whose ``DeviceArray`` names the ops of its device)."""
    rt = _rt.runtime()
    waits = getattr(_caller, "waits", False)
    if solo.runs(rt, ps_id):
        ready = getattr(_caller, "ready", None)
        _caller.ready = None
        solo.run(rt, requests, arrays, outputs, inputs, ready, handle, grouped)
        if not waits:
            _handles.add(handle)
        return handle
    keys = [(ps_id, r.match) for r in requests]
    in_flight.claim(keys, [r.op for r in requests])
    ready = getattr(_caller, "ready", None)
    one = arrays[0] if len(requests) == 1 else None
    if waits and ready is None and one is not None and rt.engine.expresses(requests[0]):
        # the caller waits for one allreduce the lane took before: the express lane
        got = rt.engine.express(ps_id, requests[0], one, outputs[0],
                                partial(_held, keys, requests, arrays, outputs, handle, grouped))
        if got is handle:  # left the express lane: its entry completes the handle
            return handle
        if got is not None:
            in_flight.release(keys[0])
            handle.set_result([got] if grouped else got)
            return handle
    entries = _entries(keys, requests, arrays, outputs, handle, grouped)
    if ready is not None:
        _caller.ready = None
        for entry, wait in zip(entries, ready):
            entry.ready = wait
    if not waits:  # a blocking form's handle never reaches the user: no int for it
        _handles.add(handle)
    # a device copy still landing is the engine thread's to wait for, blocking form or not
    rt.engine.enqueue(ps_id, entries, waits and ready is None)
    return handle


class caller_waits:  # noqa: N801 - used as a statement: ``with caller_waits(): ...``
    """Around the submission of a blocking form: the caller waits for the op anyway, so the
    engine may let this thread run it (``Engine.enqueue``'s ``inline``)."""

    def __enter__(self) -> None:
        _caller.waits = True

    def __exit__(self, *exc: object) -> None:
        _caller.waits = False


class engine_waits:  # noqa: N801 - used as a statement: ``with engine_waits(...): ...``
    """Around the submission of arrays a device is still filling (a CUDA tensor's copy into
    pinned memory in flight): ``ready[i]`` waits until array ``i`` holds its data. The engine
    calls it just before it first reads that array, in the thread that runs the op, so the
    caller does not wait."""

    def __init__(self, ready: Sequence[Callable[[], None] | None]) -> None:
        self.ready = list(ready)

    def __enter__(self) -> None:
        _caller.ready = self.ready

    def __exit__(self, *exc: object) -> None:
        _caller.ready = None


def _held(keys: list[Key], requests: list[Request], arrays: Sequence[np.ndarray | None],
          outputs: list[np.ndarray | None], handle: Handle | None,
          grouped: bool) -> tuple[Handle, TensorEntry]:  # fmt: skip
    """The handle (``handle``, or a new one) and the one entry of a call that leaves the
    express lane (hora.core.express)."""
    if handle is None:
        handle = Handle()
    (entry,) = _entries(keys, requests, arrays, outputs, handle, grouped)
    return handle, entry


def _entries(
    keys: list[Key],
    requests: list[Request],
    arrays: Sequence[np.ndarray | None],
    outputs: list[np.ndarray | None],
    handle: Handle,
    grouped: bool,
) -> list[TensorEntry]:
    """One entry per tensor; the handle completes when the last of them does."""
    if len(requests) == 1:  # the common case: the one entry completes the handle directly
        key = keys[0]

        def done(value: Any) -> None:
            in_flight.release(key)
            handle.set_result([value] if grouped else value)

        def failed(error: BaseException) -> None:
            in_flight.release(key)
            handle.set_error(error)

        return [TensorEntry(requests[0], arrays[0], outputs[0], done, failed)]
    results: list[Any] = [None] * len(requests)
    left = [len(requests)]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def settle(i: int, value: Any, error: BaseException | None = None) -> None:
        with lock:
            results[i] = value
            if error is not None:
                errors.append(error)
            left[0] -= 1
            if left[0]:
                return
        in_flight.release(*keys)  # the names are free again once the handle is done
        if errors:
            handle.set_error(errors[0])
        else:
            handle.set_result(results if grouped else results[0])

    def settle_error(i: int, error: BaseException) -> None:
        settle(i, None, error)

    return [
        TensorEntry(req, arr, out, partial(settle, i), partial(settle_error, i))
        for i, (req, arr, out) in enumerate(zip(requests, arrays, outputs))
    ]


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
    reuse: tuple[Any, ...] | None = None,
) -> tuple[list[Request], list[np.ndarray], Handle]:
    """Validate arrays, build their requests, and a handle whose result is in user dtypes.

    ``dtype`` is one name for every array, or (grouped ops) a sequence with one per array.
    ``reuse``: every argument of ``make`` besides the array's shape, dtype and name; when
    given, a named op submitted again as before reuses the request made then (requests are not
    changed once submitted), instead of validating and building it again.
    """
    handle = Handle()
    _caller.plain = None  # this submission's, below, or none (hora.frameworks.repeat)
    plain = None  # the key of _plain, for one named array that may be in it
    if reuse is not None and name and not grouped and dtype is None and convert is None \
            and len(arrays) == 1:
        x = arrays[0]
        if type(x) is np.ndarray and x.flags.c_contiguous:
            plain = (kind, ps_id, reuse, name, x.dtype, x.shape)
            req = _plain.get(plain)
            if req is not None:
                handle._finalize = finalize
                _caller.plain = (x, req, ps_id)
                return [req], [x], handle
    names = _names(_KINDS[kind], name, len(arrays) if grouped else None, ps_id)
    dtypes = _per_array(dtype, len(arrays))
    reqs, arrs, udts = [], [], []
    same = True  # every result comes back in the user's dtype as it is
    for n, x, d in zip(names, arrays, dtypes):
        arr, dt, udt = _array(x, d)
        key = None if reuse is None or not name else (kind, ps_id, reuse, n, dt, arr.shape)
        req = _requests.get(key) if key is not None else None
        if req is None:
            req = make(arr, dt, n)
            if grouped:
                req.group, req.group_size = names[0], len(names)
            if key is not None:
                if len(_requests) >= _REQUESTS_KEPT:
                    _requests.clear()
                    _plain.clear()
                _requests[key] = req
        if plain is not None and arr is x:  # in its own dtype, as it came
            _plain[plain] = req
            _caller.plain = (x, req, ps_id)
        reqs.append(req)
        arrs.append(arr)
        udts.append(udt)
        same = same and arr.dtype == udt
    if convert is None and same:  # the results are in the user's dtypes as they come
        handle._finalize = finalize
        return reqs, arrs, handle
    conv = convert or _restore

    def post(res: Any) -> Any:
        vals = [conv(r, u) for r, u in zip(res if grouped else [res], udts)]
        out = vals if grouped else vals[0]
        return finalize(out) if finalize is not None else out

    handle._finalize = post
    return reqs, arrs, handle


def last_plain() -> tuple[np.ndarray, Request, int] | None:
    """The array, its request and its set, that this thread's last submission made or found
    in ``_plain`` (None: it did not); taken once."""
    plain = getattr(_caller, "plain", None)
    _caller.plain = None
    return plain  # type: ignore[no-any-return]


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
    inputs: Sequence[Any],
) -> list[np.ndarray | None]:
    """The validated output views; an output that is its own input (in place, the common
    case) is the input's view, checked once."""
    if outputs is None:
        return [None] * len(arrs)
    outs: list[np.ndarray | None] = []
    for o, a, d, x in zip(outputs, arrs, _per_array(dtype, len(arrs)), inputs):
        if o is None or o is x:
            outs.append(None if o is None else a)
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
