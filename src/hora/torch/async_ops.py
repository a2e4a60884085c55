"""The primitive layer of hora.torch's collectives: async, in-place, grouped, sparse, control.

Each function is a thin adapter over ``hora.frameworks.ops``: it stages the tensors
(``hora.torch.adapter``: a NumPy view of CPU memory, a pinned host copy for CUDA whose wait the
engine does, or the CUDA tensor itself when the job's backend takes device buffers), calls the
op with ``dtype=`` for bfloat16 and a ``finalize=`` that turns the result into a tensor, and
returns the op's handle, which ``poll``/``synchronize`` accept (as does its ``int``). The blocking,
differentiable forms (``allreduce``, ``allgather``, ...) live in ``hora.torch.autograd``, built on
this module; ``hora.torch.mpi_ops`` (Horovod's module name) gathers both layers for scripts.

Submission runs in the caller's thread and validates eagerly; finalizers run in the engine thread.
Thread-safe as the op surface is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from hora import global_process_set
from hora.core.process_sets import ProcessSet
from hora.core.solo import alone
from hora.errors import HoraInternalError
from hora.frameworks import ops, repeat
from hora.frameworks.ops import Adasum, Average, Handle, Max, Min, Product, Sum, reduce_op
from hora.frameworks.submit import caller_waits, engine_waits
from hora.torch.adapter import Staged, host_view, stage, to_tensor, write_back


def _waits(staged: Sequence[Staged]) -> Any:
    """Around a submission of ``staged`` tensors staged with ``defer=True``: the engine waits
    for their copies to pinned memory (CUDA tensors) just before it reads them, not the
    caller; nothing to wait for with CPU tensors."""
    if len(staged) == 1 and staged[0].event is None:  # the common case: a CPU tensor
        return _NOTHING
    ready = [s.ready if s.event is not None else None for s in staged]
    return engine_waits(ready) if any(r is not None for r in ready) else _NOTHING


_NOTHING = nullcontext()  # reusable


def _new(like: torch.Tensor) -> Callable[[np.ndarray], torch.Tensor]:
    return lambda out: to_tensor(out, like)


def _new_each(staged: Sequence[Staged]) -> Callable[[list[np.ndarray]], list[torch.Tensor]]:
    """A group's results as new tensors, each like its staged tensor."""
    likes = [s.tensor for s in staged]
    return lambda outs: [to_tensor(o, t) for o, t in zip(outs, likes)]


def _stage_group(
    tensors: Sequence[torch.Tensor], process_set: ProcessSet, defer: bool = False
) -> tuple[list[Staged], list[np.ndarray], Any]:
    """Stage a group for ``process_set``; the arrays and the one ``dtype=`` override to pass
    for all of them (``defer``: as :func:`stage`'s, the submission then goes under
    :func:`_waits`)."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped operations need at least one tensor")
    devices = {t.device for t in tensors if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise ValueError(f"all tensors of a group must be on the same device, got {devices}")
    one = alone(process_set)
    staged = [stage(t, f"tensors[{i}]", defer=defer, alone=one) for i, t in enumerate(tensors)]
    overrides = {s.dtype for s in staged}
    if len(overrides) == 1:
        return staged, [s.array for s in staged], overrides.pop()
    # bfloat16 mixed with other dtypes: one dtype= cannot describe the group, so give bfloat16
    # its own NumPy dtype (ml_dtypes) that the op surface recognises.
    try:
        import ml_dtypes
    except ImportError as e:
        raise TypeError(
            "a group mixing bfloat16 with other dtypes needs the ml_dtypes package "
            "(pip install 'hora[bf16]'), or group the bfloat16 tensors separately"
        ) from e
    arrays = [s.array.view(ml_dtypes.bfloat16) if s.dtype else s.array for s in staged]
    return staged, arrays, None


# -- allreduce ------------------------------------------------------------------------------
def _allreduce(
    staged: Sequence[Staged],
    arrays: list[np.ndarray],
    dtype: str | None,
    grouped: bool,
    in_place: bool,
    finalize: Callable[[Any], Any],
    name: str | None,
    op: int,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    priority: int,
) -> Handle:
    """The four async allreduces' submission: one tensor or a group, into new tensors or in
    place; the engine waits for any device copy still landing (:func:`_waits`)."""
    kw: dict[str, Any] = {
        "name": name,
        "op": op,
        "prescale_factor": prescale_factor,
        "postscale_factor": postscale_factor,
        "process_set": process_set,
        "dtype": dtype,
        "finalize": finalize,
        "priority": priority,
    }
    with _waits(staged):
        if grouped:
            return ops.grouped_allreduce_async(arrays, outputs=arrays if in_place else None, **kw)
        return ops.allreduce_async(arrays[0], output=arrays[0] if in_place else None, **kw)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    *,
    priority: int = 0,
) -> Handle:
    """Start reducing ``tensor`` over the set; the handle's result is a new tensor."""
    op = reduce_op(average, op)
    s = stage(tensor, defer=True, alone=alone(process_set))
    return _allreduce([s], [s.array], s.dtype, False, False, _new(tensor), name,
                      op, prescale_factor, postscale_factor, process_set,
                      priority)  # fmt: skip


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    *,
    priority: int = 0,
) -> Handle:
    """Start reducing ``tensor`` in place; the handle's result is ``tensor`` itself."""
    op = reduce_op(average, op)
    s = stage(tensor, defer=True, alone=alone(process_set))
    return _allreduce([s], [s.array], s.dtype, False, True, lambda out: write_back(s, out),
                      name, op, prescale_factor, postscale_factor,
                      process_set, priority)  # fmt: skip


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    *,
    priority: int = 0,
) -> torch.Tensor:
    """Reduce ``tensor`` in place and return it (not differentiable)."""
    return reduced(tensor, False, name, reduce_op(average, op), prescale_factor,
                   postscale_factor, process_set, priority)  # fmt: skip


def reduced(tensor: torch.Tensor, fresh: bool, name: str | None, op: int, prescale_factor: float,
            postscale_factor: float, process_set: ProcessSet,
            priority: int) -> torch.Tensor:  # fmt: skip
    """A blocking allreduce of ``tensor``: in place (:func:`allreduce_`), or, ``fresh``, into a
    new tensor (``hvd.allreduce`` where nothing is differentiated). A call made again as before
    (the same name and keywords, a tensor of the same kind) takes the express lane
    (:mod:`hora.frameworks.repeat`)."""
    kw = {"name": name, "op": op, "prescale_factor": prescale_factor,
          "postscale_factor": postscale_factor, "process_set": process_set,
          "priority": priority}  # fmt: skip
    with _AS_HOROVODS:
        got = repeat.again(tensor, kw, host_view, fresh)
    if got is not repeat.MISSED:
        return to_tensor(got, tensor) if fresh else tensor
    start = allreduce_async if fresh else allreduce_async_
    out = blocking(start, tensor, None, name, op, prescale_factor, postscale_factor, process_set,
                   priority=priority)  # fmt: skip
    repeat.remember(tensor, kw, host_view, fresh)
    return out  # type: ignore[no-any-return]


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    *,
    priority: int = 0,
) -> Handle:
    """Start reducing a list of tensors as one unit; the result is a list of new tensors."""
    op = reduce_op(average, op)
    staged, arrays, dtype = _stage_group(tensors, process_set, defer=True)
    return _allreduce(staged, arrays, dtype, True, False,
                      _new_each(staged), name,
                      op, prescale_factor, postscale_factor, process_set,
                      priority)  # fmt: skip


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    *,
    priority: int = 0,
) -> Handle:
    """Start reducing a list of tensors in place; the result is the same list of tensors."""
    op = reduce_op(average, op)
    staged, arrays, dtype = _stage_group(tensors, process_set, defer=True)
    return _allreduce(staged, arrays, dtype, True, True,
                      lambda outs: [write_back(s, o) for s, o in zip(staged, outs)], name,
                      op, prescale_factor, postscale_factor, process_set,
                      priority)  # fmt: skip


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    *,
    priority: int = 0,
) -> list[torch.Tensor]:
    """Reduce a list of tensors in place and return them (not differentiable)."""
    op = reduce_op(average, op)
    return blocking(grouped_allreduce_async_, tensors, None, name, op, prescale_factor,
                    postscale_factor, process_set, priority=priority)  # fmt: skip


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str | None, op: int, process_set: ProcessSet = global_process_set
) -> Callable[[], torch.Tensor]:
    """Reduce a sparse COO tensor by gathering every rank's indices and values.

    Returns a callable that waits and gives the reduced sparse tensor (uncoalesced: entries
    several ranks share are summed when it is coalesced or used). With Average the values are
    divided by the set's size. Names: ``<name>.indices`` and ``<name>.values``.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError("sparse_allreduce_async needs a sparse COO tensor")
    if op not in (Average, Sum):
        raise ValueError("sparse_allreduce_async supports op=Average or op=Sum only")
    t = tensor.coalesce()
    size = (process_set or global_process_set).size()
    # Allgather concatenates along dim 0, so indices travel as (nnz, ndim) rows.
    idx_handle = allgather_async(
        t.indices().t().contiguous(), _suffix(name, "indices"), process_set
    )
    val_handle = allgather_async(t.values().contiguous(), _suffix(name, "values"), process_set)

    def result() -> torch.Tensor:
        values = synchronize(val_handle)
        indices = synchronize(idx_handle)
        if op == Average:
            values = (values / size).to(values.dtype)
        return torch.sparse_coo_tensor(indices.t(), values, t.shape)

    return result


def _suffix(name: str | None, suffix: str) -> str | None:
    return None if name is None else f"{name}.{suffix}"


# -- allgather, broadcast, alltoall, reducescatter -----------------------------------------
def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Handle:
    """Start concatenating every rank's ``tensor`` along dim 0 (dim 0 may differ per rank)."""
    s = stage(tensor, defer=True, alone=alone(process_set))
    with _waits([s]):
        return ops.allgather_async(
            s.array, name=name, process_set=process_set, dtype=s.dtype, finalize=_new(tensor)
        )


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    staged, arrays, dtype = _stage_group(tensors, process_set, defer=True)
    with _waits(staged):
        return ops.grouped_allgather_async(
            arrays,
            name=name,
            process_set=process_set,
            dtype=dtype,
            finalize=_new_each(staged),
        )


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start sending ``root_rank``'s (a global rank) tensor to every rank; result: new tensor."""
    return _broadcast(tensor, root_rank, name, process_set, in_place=False)


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start overwriting ``tensor`` with ``root_rank``'s; the result is ``tensor`` itself."""
    return _broadcast(tensor, root_rank, name, process_set, in_place=True)


def _broadcast(tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet,
               in_place: bool) -> Handle:  # fmt: skip
    s = stage(tensor, defer=True, alone=alone(process_set))
    with _waits([s]):
        return ops.broadcast_async(
            s.array,
            root_rank,
            name=name,
            process_set=process_set,
            output=s.array if in_place else None,
            dtype=s.dtype,
            finalize=(lambda out: write_back(s, out)) if in_place else _new(tensor),
        )


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s and return it (not differentiable)."""
    return blocking(broadcast_async_, tensor, root_rank, name, process_set)


def alltoall_async(
    tensor: torch.Tensor,
    splits: torch.Tensor | Sequence[int] | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start sending ``splits[i]`` rows to rank i; result: ``(output, received_splits)``."""
    if isinstance(splits, torch.Tensor):
        splits = splits.detach().cpu().numpy()
    s = stage(tensor, defer=True, alone=alone(process_set))

    def finalize(res: tuple[np.ndarray, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        received = torch.as_tensor(np.asarray(res[1], dtype=np.int32))
        return to_tensor(res[0], tensor), received

    with _waits([s]):
        return ops.alltoall_async(
            s.array, splits, name=name, process_set=process_set, dtype=s.dtype,
            finalize=finalize,
        )  # fmt: skip


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start reducing ``tensor`` and keeping this rank's block of dim 0 (the first
    ``N % size`` ranks get one row more)."""
    s = stage(tensor, defer=True, alone=alone(process_set))
    with _waits([s]):
        return ops.reducescatter_async(
            s.array,
            name=name,
            op=op,
            process_set=process_set,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            dtype=s.dtype,
            finalize=_new(tensor),
        )


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    staged, arrays, dtype = _stage_group(tensors, process_set, defer=True)
    with _waits(staged):
        return ops.grouped_reducescatter_async(
            arrays,
            name=name,
            op=op,
            process_set=process_set,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            dtype=dtype,
            finalize=_new_each(staged),
        )


# -- control --------------------------------------------------------------------------------
def poll(handle: Handle | int) -> bool:
    """True once the operation behind ``handle`` has finished (successfully or not)."""
    return ops.poll(handle)


def blocking(start: Callable[..., Handle], tensors: Any, *args: Any, **kw: Any) -> Any:
    """A blocking form: submit ``tensors`` (one or a list) through ``start`` and wait for the
    result. The caller waits anyway, so for tensors in host memory the engine may run the op
    in this thread (no hand-off to its thread and back); the handle stays here. Tensors on a
    device go through the engine thread, which owns their streams."""
    many = tensors if isinstance(tensors, (list, tuple)) else (tensors,)
    if all(t.device.type == "cpu" for t in many):
        with caller_waits():
            handle = start(tensors, *args, **kw)
    else:
        handle = start(tensors, *args, **kw)
    return synchronize(handle)


def synchronize(handle: Handle | int) -> Any:
    """Wait for ``handle`` and return its result; a failure raises ``HorovodInternalError``.

    An unknown (or already synchronized) handle returns None.
    """
    with _AS_HOROVODS:
        return ops.synchronize(handle)


class _HorovodErrors:
    """Around a wait for an op: its failure (a ``RuntimeError``) raises as Horovod's torch ops
    raise one, ``HorovodInternalError``. One instance serves every wait."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, e: BaseException | None, tb: Any) -> bool:
        if isinstance(e, RuntimeError) and not isinstance(e, HoraInternalError):
            raise HoraInternalError(str(e)) from e
        return False


_AS_HOROVODS = _HorovodErrors()


def join(device: int = -1, *, process_set: ProcessSet = global_process_set) -> int:
    """Say this rank has no more data; returns the rank that joined last. ``device`` is
    accepted for compatibility (hora joins on the host); ``process_set`` (keyword-only) is
    hora's addition."""
    return ops.join(process_set)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the set has reached the barrier."""
    ops.barrier(process_set)


__all__ = [
    "Adasum",
    "Average",
    "Max",
    "Min",
    "Product",
    "Sum",
    "allreduce_async",
    "allreduce_async_",
    "allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_allreduce_",
    "sparse_allreduce_async",
    "allgather_async",
    "grouped_allgather_async",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_",
    "alltoall_async",
    "reducescatter_async",
    "grouped_reducescatter_async",
    "poll",
    "synchronize",
    "join",
    "barrier",
    "reduce_op",
]
