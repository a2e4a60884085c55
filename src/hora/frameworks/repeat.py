"""A blocking allreduce called again as before: the op surface's side of the express lane
(:mod:`hora.core.express`).

A loop calls ``hvd.allreduce(x, name=..., op=..., output=x)`` with the same keywords step after
step (or, in :mod:`hora.torch`, ``hvd.allreduce_(t, ...)``; or ``dist.all_reduce(t)``, which the
group names alike for alike tensors), on the same arrays or on new ones of the same kind (a
metric made anew each step). Once such a call has gone the usual way and the engine's lane
took it as the express lane takes it (:meth:`~hora.core.express.ExpressLane.expresses`), this
thread remembers the call by its name (:func:`remember`): the type, shape and dtype of what it
reduced, each keyword, and the request made; never the array or tensor itself. A next call of
that name on an array or tensor of that type, shape and dtype, laid out as one block, with the
same keywords (the same objects; equal values for names, ops and factors) is that request
again, as the op surface would find it (it reuses a named request by the same things):
:func:`again` claims its name and asks the engine to run it at once, with nothing to validate,
name or build. Any other call goes the usual way, as does this one wherever the engine says no.

A tensor is reduced through a view of its memory that its framework makes each call (``view``:
None where it has none to give, and the call goes the usual way): in place, or, ``fresh``, into
a new array the framework wraps (a result apart from its input).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from hora.core import runtime as _rt
from hora.core.handles import Handle, Key, in_flight
from hora.core.messages import Request
from hora.frameworks.submit import _held, last_plain

MISSED = object()  # what :func:`again` gives for a call it did not run
_BY_VALUE = {str, int, float, bool}  # keywords of these types are the same when equal (a name
# made anew each call, f"grad.{i}"); any other only when the same object (a process set)
CALLS_KEPT = 256  # the calls a thread remembers (then anew)
_local = threading.local()  # .calls: this thread's calls to run again, by name


View = Callable[[Any], "np.ndarray | None"]  # a tensor's memory as NumPy (None: it has none)


@dataclass(frozen=True)
class _Call:
    kind: Any  # the array's type, or the tensor's
    kw: dict[str, Any]  # every keyword but output
    shape: tuple[int, ...]
    dtype: Any  # the array's (NumPy) or the tensor's
    in_place: bool  # output=array, or a tensor reduced in place (else none: a new array)
    req: Request
    ps_id: int
    key: Key
    rt: weakref.ref[Any]  # the runtime it ran in (hora.core.runtime.Runtime), weakly


def again(obj: Any, kw: dict[str, Any], view: View | None = None, fresh: bool = False) -> Any:
    """The result of this thread's blocking allreduce of ``obj`` with keywords ``kw``, run in
    the express lane where it is a call remembered; :data:`MISSED` where it was not run
    (nothing done: it goes the usual way). ``obj`` is an array, or a tensor reduced through
    ``view``: in place, or, ``fresh``, into a new array (the result)."""
    calls: dict[str, _Call] | None = getattr(_local, "calls", None)
    name = kw.get("name")
    call = calls.get(name) if calls and type(name) is str else None
    if call is None or type(obj) is not call.kind:
        return MISSED
    if len(kw) - ("output" in kw) != len(call.kw):
        return MISSED
    for k, v in kw.items():
        was = call.kw.get(k, MISSED)
        if v is not was and k != "output" and (
                type(v) not in _BY_VALUE or type(was) is not type(v) or v != was):
            return MISSED
    if obj.shape != call.shape or obj.dtype != call.dtype:
        return MISSED
    if view is None:
        array, out = obj, kw.get("output")
        if out is not (obj if call.in_place else None) or not obj.flags.c_contiguous:
            return MISSED
    else:
        if call.in_place == fresh:
            return MISSED
        array = view(obj)
        if array is None:
            return MISSED
        out = None if fresh else array
    rt = _rt.current()
    if rt is None:
        return MISSED
    engine = rt.engine
    if call.rt() is not rt:  # shut down and initialized again since
        return MISSED
    in_flight.claim_one(call.key, call.req.op)
    try:
        got = engine.express(call.ps_id, call.req, array, out,
                                partial(_left, call, array, out))  # fmt: skip
    except BaseException:
        in_flight.release(call.key)
        raise
    if isinstance(got, Handle):  # left the express lane: its entry's completion frees the name
        return got.wait()
    in_flight.release(call.key)
    return MISSED if got is None else got


def _left(call: _Call, x: np.ndarray, out: np.ndarray | None) -> tuple[Handle, Any]:
    """The handle and entry of ``call`` of ``x`` where it leaves the express lane."""
    return _held([call.key], [call.req], [x], [out], None, False)


def remember(obj: Any, kw: dict[str, Any], view: View | None = None,
             fresh: bool = False) -> None:  # fmt: skip
    """After this thread's blocking allreduce of ``obj`` with ``kw`` went the usual way:
    remember it for :func:`again` where its request came from the named array as it is
    (:func:`submit.last_plain`: ``obj`` itself, or the memory ``view`` gives of it), with no
    output but the array itself and nothing to finalize, and the engine took it as the
    express lane does; else forget it. ``fresh``: as :func:`again`'s."""
    plain = last_plain()
    calls: dict[str, _Call] | None = getattr(_local, "calls", None)
    name = kw.get("name")
    if type(name) is not str:  # an unnamed call is named anew each time (never the same)
        return
    if calls:
        calls.pop(name, None)
    if plain is None or kw.get("finalize") is not None:
        return
    x, req, ps_id = plain
    out = kw.get("output")
    if view is None:
        if x is not obj or (out is not None and out is not obj):
            return
    elif out is not None or not _same_memory(x, view(obj)):
        return
    rt = _rt.runtime()
    if not rt.engine.expresses(req):
        return
    if calls is None or len(calls) >= CALLS_KEPT:
        calls = _local.calls = {}
    in_place = out is obj if view is None else not fresh
    calls[name] = _Call(type(obj), {k: v for k, v in kw.items() if k != "output"}, obj.shape,
                        obj.dtype, in_place, req, ps_id, (ps_id, req.match),
                        weakref.ref(rt))  # fmt: skip


def _same_memory(a: np.ndarray, b: np.ndarray | None) -> bool:
    """Whether ``b`` is ``a``'s memory as ``a`` lays it out (both views of one tensor)."""
    return (b is not None and a.shape == b.shape and a.dtype == b.dtype
            and a.__array_interface__["data"] == b.__array_interface__["data"])  # fmt: skip
