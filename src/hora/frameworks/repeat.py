"""A blocking allreduce called again as before: the op surface's side of the express lane
(:mod:`hora.core.express`).

A loop calls ``hvd.allreduce(x, name=..., op=..., output=x)`` with the same arrays and the
same keywords step after step. Once such a call has gone the usual way and the engine's lane
took it as the express lane takes it (:meth:`~hora.core.express.ExpressLane.expresses`), this
thread remembers the call (:func:`remember`): the array (weakly: a call never keeps an array
alive), each keyword, and the request made. A next call of that array, its shape, dtype and
layout unchanged, with the same keywords (the same objects; equal values for names, ops and
factors) is that request again: :func:`again` claims its name and asks the engine to run it
at once, with nothing to validate, name or build. Any other call goes the usual way, as does
this one wherever the engine says no.
"""

from __future__ import annotations

import threading
import weakref
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
_local = threading.local()  # .calls: this thread's calls to run again, by id(array)


@dataclass(frozen=True)
class _Call:
    array: weakref.ref[np.ndarray]
    kw: dict[str, Any]  # every keyword but output
    shape: tuple[int, ...]
    dtype: np.dtype
    in_place: bool  # output=array (else none: a new array)
    req: Request
    ps_id: int
    key: Key
    rt: weakref.ref[Any]  # the runtime it ran in (hora.core.runtime.Runtime), weakly


def again(array: Any, kw: dict[str, Any]) -> Any:
    """The result of this thread's blocking allreduce of ``array`` with keywords ``kw``,
    run in the express lane where it is a call remembered; :data:`MISSED` where it was not
    run (nothing done: it goes the usual way)."""
    calls: dict[int, _Call] | None = getattr(_local, "calls", None)
    call = calls.get(id(array)) if calls else None
    if call is None:
        return MISSED
    x = call.array()
    if x is None or x is not array:
        return MISSED
    out = kw.get("output")
    if out is not (x if call.in_place else None) or len(kw) - ("output" in kw) != len(call.kw):
        return MISSED
    for k, v in kw.items():
        was = call.kw.get(k, MISSED)
        if v is not was and k != "output" and (
                type(v) not in _BY_VALUE or type(was) is not type(v) or v != was):
            return MISSED
    if x.shape != call.shape or x.dtype != call.dtype or not x.flags.c_contiguous:
        return MISSED  # changed in place since (x.shape = ..., x.resize(...))
    if not _rt.is_initialized():
        return MISSED
    rt = _rt.runtime()
    if call.rt() is not rt:  # shut down and initialized again since
        return MISSED
    in_flight.claim_one(call.key, call.req.op)
    try:
        got = rt.engine.express(call.ps_id, call.req, x, out, partial(_left, call, x, out))
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


def remember(array: Any, kw: dict[str, Any]) -> None:
    """After this thread's blocking allreduce of ``array`` with ``kw`` went the usual way:
    remember it for :func:`again` where its request came from the named array as it is
    (:func:`submit.last_plain`), with no output but the array itself and nothing to
    finalize, and the engine took it as the express lane does; else forget it."""
    calls: dict[int, _Call] | None = getattr(_local, "calls", None)
    if calls:
        calls.pop(id(array), None)
    plain = last_plain(array)
    if plain is None or kw.get("finalize") is not None:
        return
    out = kw.get("output")
    if out is not None and out is not array:
        return
    req, ps_id = plain
    rt = _rt.runtime()
    if not rt.engine.expresses(req):
        return
    if calls is None or len(calls) >= CALLS_KEPT:
        calls = _local.calls = {}
    calls[id(array)] = _Call(weakref.ref(array), {k: v for k, v in kw.items() if k != "output"},
                             array.shape, array.dtype, out is array, req, ps_id,
                             (ps_id, req.match), weakref.ref(rt))
