"""A process set of one: its collectives run at once, in the caller's thread, with no engine round.

In a world of one, or a process set of one in a larger world, allreduce (Adasum included),
allgather, broadcast, alltoall and reducescatter have nobody to talk to: each result is the
input, scaled where the op scales. The op surface (``hora.frameworks.submit``) runs them here
instead of handing them to the engine: no negotiation, no queue, no hand-off to the engine
thread, and no copy beyond what the result needs: none in place, one into a new output or one
the caller gave. Prescale and postscale are applied as the executor applies them (the prescale,
then the postscale; an Average divides by a size of one), with the same functions, so the
results are the engine path's bit for bit. Adasum of one is the identity, scaled.

Buffers stay where they lie: host arrays through :class:`~hora.core.buffers.HostBufferOps`, a
device buffer through the ``BufferOps`` of its device (``DeviceArray.ops``, else the backend's
``buffer_ops``), whose work goes on the caller's current stream: nothing waits on the host and
nothing crosses to host memory.

Horovod's semantics are kept: arguments are validated as before (bad ones raise in the caller's
thread), ops are named as before (unnamed ones still count), the handle is an ordinary one,
already done when the call returns (``poll`` is True, ``synchronize`` gives the result, also by
its int), and the timeline shows each op (``B``/``E`` of the op; there is no negotiation to
show). A stopped engine fails them as it fails every op (the submission goes to it).
``HORA_LOCAL_SETS=0`` sends sets of one through the engine, as a larger set's ops.

Caller's thread; thread-safe (it touches only the caller's buffers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hora.core import runtime as _rt
from hora.core.buffers import BufferOps, DeviceArray, HostBufferOps
from hora.core.handles import Handle
from hora.core.messages import OpType, Request
from hora.core.process_sets import ProcessSet, resolve
from hora.errors import HoraInternalError

_HOST = HostBufferOps()
_SCALED = (OpType.ALLREDUCE, OpType.ADASUM, OpType.REDUCESCATTER)


def alone(process_set: ProcessSet | None) -> bool:
    """Whether ops on ``process_set`` run here: it has one member and local sets are on. A
    framework binding asks before it prepares a device tensor (it then stays on its device);
    False before ``init`` (the op then says what is wrong)."""
    if not _rt.is_initialized():
        return False
    rt = _rt.runtime()
    return rt.settings.local_sets and len(resolve(process_set).ranks) == 1


def runs(rt: Any, ps_id: int) -> bool:
    """Whether the ops of registered set ``ps_id`` run here rather than in the engine."""
    return bool(rt.settings.local_sets and len(rt.sets[ps_id].ranks) == 1
                and rt.engine.running)  # fmt: skip


def run(
    rt: Any,
    requests: Sequence[Request],
    arrays: Sequence[Any],
    outputs: Sequence[Any],
    inputs: Sequence[Any],
    ready: Sequence[Callable[[], None] | None] | None,
    handle: Handle,
    grouped: bool,
) -> None:
    """Run one submission's ops and complete ``handle`` (its error, if one fails). ``inputs``:
    what the caller handed the op surface (a ``DeviceArray`` names its buffers' ops); ``ready``:
    a wait per array for data still arriving (``frameworks.submit.engine_waits``)."""
    tl = rt.engine.timeline
    results = []
    try:
        for i, (req, arr, out) in enumerate(zip(requests, arrays, outputs)):
            wait = ready[i] if ready is not None else None
            if wait is not None:
                wait()
            if tl is not None:
                tl.start(req.name, req.op.name)
            given = inputs[i] if i < len(inputs) else None
            results.append(result(req, arr, out, ops_of(rt, given, arr)))
            if tl is not None:
                tl.end(req.name, req.dtype, req.shape)
    except Exception as e:  # the handle carries it, as the engine's failures
        handle.set_error(e)
        return
    handle.set_result(results if grouped else results[0])


def ops_of(rt: Any, given: Any, arr: Any) -> BufferOps:
    """The ``BufferOps`` of ``arr``: the host's, its ``DeviceArray``'s, or the backend's."""
    if isinstance(arr, np.ndarray):
        return _HOST
    if isinstance(given, DeviceArray) and given.ops is not None:
        return given.ops
    dev = rt.engine.executor.device_ops
    if dev is not None and dev.owns(arr):
        return dev  # type: ignore[no-any-return]
    raise HoraInternalError(f"no buffer operations for a {type(arr).__name__} in a set of one")


def result(req: Request, arr: Any, out: Any, ops: BufferOps) -> Any:
    """The result of one op of a set of one on ``arr`` (storage dtype), into ``out`` where
    given (``arr`` itself: in place), else a new buffer."""
    flat = arr.reshape(-1)
    if out is None:
        res = ops.clone(flat)
    elif out is arr:
        res = flat
    else:
        res = out.reshape(-1)
        if ops.ptr(res) != ops.ptr(flat):
            ops.copy(res, flat)
    if req.op in _SCALED:
        ops.scale(res, req.dtype, req.prescale)
        # the executor's postscale, divided by the set's size (one) for an Average
        ops.scale(res, req.dtype, req.postscale)
    res = res.reshape(req.shape)
    if req.op == OpType.ALLTOALL:
        return res, np.asarray(req.shape[:1], dtype=np.int32)  # every row came from this rank
    return res
