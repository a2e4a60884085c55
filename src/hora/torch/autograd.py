"""The blocking collectives on torch tensors, differentiable with Horovod's backward rules.

- allreduce: the gradient is allreduced with the same op and scale factors.
- allgather: the gradient is Average-allreduced, then this rank's rows are kept.
- broadcast: the gradient is Average-allreduced on the root and zero elsewhere.
- alltoall: the gradient's rows go back where they came from (alltoall with the received splits).
- reducescatter: the gradient is allgathered (and multiplied by the set's size for Sum).
Grouped forms follow the same rules per tensor. Backward ops are named ``<name>.grad`` when the
forward op was named, so ranks agree on them. The ``torch.autograd.Function`` classes carry
Horovod's names (``HorovodAllreduce``, ...) and ``apply`` argument orders. Built on
``hora.torch.async_ops``; ``hora.torch.mpi_ops`` re-exports this module.

Runs in the caller's thread (forward) and in autograd's backward thread; blocking.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd import Function

import hora
from hora import global_process_set
from hora.frameworks.ops import Average, Sum, compression_for
from hora.torch.async_ops import (
    ProcessSet,
    allgather_async,
    allreduce_async,
    alltoall_async,
    blocking,
    broadcast_async,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_reducescatter_async,
    reduce_op,
    reduced,
    reducescatter_async,
)
from hora.torch.compression import Compression, Compressor


def _grad_name(name: str | None) -> str | None:
    return None if name is None else f"{name}.grad"


def _set(process_set: ProcessSet) -> Any:
    return global_process_set if process_set is None else process_set


def _my_offsets(rows: list[int], name: str | None, process_set: ProcessSet) -> list[int]:
    """For each of this rank's row counts, the number of rows the lower ranks contributed."""
    mine = torch.tensor([rows], dtype=torch.int64)
    rows_name = None if name is None else f"{name}.grad_rows"
    everyone = blocking(allgather_async, mine, rows_name, process_set)
    below = everyone[: _set(process_set).rank()]
    return below.sum(dim=0).tolist()


def _rows(t: torch.Tensor) -> int:
    return int(t.shape[0]) if t.ndim else 1


def _allreduce_forward(
    ctx: Any, tensor, average, name, op, prescale_factor, postscale_factor, process_set, priority
):
    op = reduce_op(average, op)
    pre, post = prescale_factor, postscale_factor
    ctx.args = (name, op, pre, post, process_set, priority)
    return blocking(allreduce_async, tensor, None, name, op, pre, post, process_set,
                     priority=priority)  # fmt: skip


def _allreduce_apply(tensor, average, name, op, pre, post, process_set, priority=0):
    """HorovodAllreduce.apply, with hora's scheduling ``priority`` when it is not 0; the op
    alone where nothing is differentiated (autograd's ``Function.apply`` costs 3 us a call
    when it records nothing)."""
    if not (tensor.requires_grad and torch.is_grad_enabled()):  # as allreduce_, into a new one
        return reduced(tensor, True, name, reduce_op(average, op), pre, post, process_set,
                       priority)  # fmt: skip
    if priority:
        return _PrioritizedAllreduce.apply(
            tensor, average, name, op, pre, post, process_set, priority
        )
    return HorovodAllreduce.apply(tensor, average, name, op, pre, post, process_set)


def _allreduce_grad(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
    name, op, prescale, postscale, ps, priority = ctx.args
    return _allreduce_apply(grad_output, None, _grad_name(name), op, prescale, postscale, ps,
                            priority)  # fmt: skip


class HorovodAllreduce(Function):
    """``apply(tensor, average, name, op, prescale, postscale, process_set)``."""

    @staticmethod
    def forward(
        ctx: Any, tensor, average, name, op, prescale_factor, postscale_factor, process_set
    ):  # type: ignore[override]
        pre, post = prescale_factor, postscale_factor
        return _allreduce_forward(ctx, tensor, average, name, op, pre, post, process_set, 0)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[override]
        return _allreduce_grad(ctx, grad_output), None, None, None, None, None, None


class _PrioritizedAllreduce(Function):
    """HorovodAllreduce with hora's scheduling priority last:
    ``apply(tensor, average, name, op, prescale, postscale, process_set, priority)``."""

    @staticmethod
    def forward(
        ctx: Any, tensor, average, name, op, prescale_factor, postscale_factor, process_set,
        priority,
    ):  # type: ignore[override]
        pre, post = prescale_factor, postscale_factor
        return _allreduce_forward(ctx, tensor, average, name, op, pre, post, process_set, priority)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[override]
        return _allreduce_grad(ctx, grad_output), None, None, None, None, None, None, None


class HorovodGroupedAllreduce(Function):
    """``apply(average, name, op, prescale, postscale, process_set, *tensors)``."""

    @staticmethod
    def forward(
        ctx: Any, average, name, op, prescale_factor, postscale_factor, process_set, *tensors
    ):  # type: ignore[override]
        op = reduce_op(average, op)
        pre, post = prescale_factor, postscale_factor
        ctx.args = (name, op, pre, post, process_set)
        return tuple(blocking(grouped_allreduce_async, tensors, None, name, op, pre, post,
                               process_set))  # fmt: skip

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):  # type: ignore[override]
        name, op, prescale, postscale, ps = ctx.args
        reduced = HorovodGroupedAllreduce.apply(
            None, _grad_name(name), op, prescale, postscale, ps, *grads
        )
        return (None, None, None, None, None, None, *reduced)


class HorovodAllgather(Function):
    @staticmethod
    def forward(ctx: Any, tensor, name, process_set):  # type: ignore[override]
        ctx.shape, ctx.rows, ctx.args = tensor.shape, _rows(tensor), (name, process_set)
        return blocking(allgather_async, tensor, name, process_set)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[override]
        grad = grad_output
        name, ps = ctx.args
        reduced = HorovodAllreduce.apply(grad, None, _grad_name(name), Average, 1.0, 1.0, ps)
        (offset,) = _my_offsets([ctx.rows], name, ps)
        return reduced.narrow(0, offset, ctx.rows).reshape(ctx.shape), None, None


class HorovodGroupedAllgather(Function):
    @staticmethod
    def forward(ctx: Any, name, process_set, *tensors):  # type: ignore[override]
        ctx.shapes = [t.shape for t in tensors]
        ctx.rows = [_rows(t) for t in tensors]
        ctx.args = (name, process_set)
        return tuple(blocking(grouped_allgather_async, tensors, name, process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):  # type: ignore[override]
        name, ps = ctx.args
        grad_name = _grad_name(name)
        reduced = HorovodGroupedAllreduce.apply(None, grad_name, Average, 1.0, 1.0, ps, *grads)
        offsets = _my_offsets(ctx.rows, name, ps)
        return (None, None) + tuple(
            r.narrow(0, off, rows).reshape(shape)
            for r, off, rows, shape in zip(reduced, offsets, ctx.rows, ctx.shapes)
        )


class HorovodBroadcast(Function):
    @staticmethod
    def forward(ctx: Any, tensor, root_rank, name, process_set):  # type: ignore[override]
        ctx.args = (root_rank, name, process_set)
        return blocking(broadcast_async, tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[override]
        grad = grad_output
        root_rank, name, ps = ctx.args
        reduced = HorovodAllreduce.apply(grad, None, _grad_name(name), Average, 1.0, 1.0, ps)
        if hora.rank() != root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


class HorovodAlltoall(Function):
    @staticmethod
    def forward(ctx: Any, tensor, splits, name, process_set):  # type: ignore[override]
        output, received = blocking(alltoall_async, tensor, splits, name, process_set)
        ctx.received, ctx.args = received, (name, process_set)
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, *_dead: Any):  # type: ignore[override]
        grad = grad_output
        name, ps = ctx.args
        back, _ = HorovodAlltoall.apply(grad, ctx.received, _grad_name(name), ps)
        return back, None, None, None


class HorovodReducescatter(Function):
    @staticmethod
    def forward(ctx: Any, tensor, name, op, process_set, prescale_factor, postscale_factor):  # type: ignore[override]
        ctx.args = (name, op, process_set)
        return blocking(reducescatter_async, tensor, name, op, process_set, prescale_factor,
                         postscale_factor)  # fmt: skip

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[override]
        grad = grad_output
        name, op, ps = ctx.args
        if op == Sum:
            grad = grad * _set(ps).size()
        return HorovodAllgather.apply(grad, _grad_name(name), ps), None, None, None, None, None


class HorovodGroupedReducescatter(Function):
    @staticmethod
    def forward(ctx: Any, name, op, process_set, prescale_factor, postscale_factor, *tensors):  # type: ignore[override]
        ctx.args = (name, op, process_set)
        pre, post = prescale_factor, postscale_factor
        return tuple(blocking(grouped_reducescatter_async, tensors, name, op, process_set, pre,
                               post))  # fmt: skip

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):  # type: ignore[override]
        name, op, ps = ctx.args
        if op == Sum:
            grads = tuple(g * _set(ps).size() for g in grads)
        gathered = HorovodGroupedAllgather.apply(_grad_name(name), ps, *grads)
        return (None, None, None, None, None, *gathered)


# -- the user-facing blocking forms ---------------------------------------------------------
def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    *,
    priority: int = 0,
) -> torch.Tensor:
    """Reduce ``tensor`` over the set (default op Average); a new tensor, differentiable."""
    op = reduce_op(average, op)
    compression = compression_for(compression, Compression.none)
    sent, ctx = compression.compress(tensor)
    out = _allreduce_apply(
        sent, None, name, op, prescale_factor, postscale_factor, process_set, priority
    )
    return compression.decompress(out, ctx)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce a list of tensors as one unit; new tensors, differentiable."""
    op = reduce_op(average, op)
    compression = compression_for(compression, Compression.none)
    sent, ctxs = zip(*(compression.compress(t) for t in tensors)) if tensors else ((), ())
    outs = HorovodGroupedAllreduce.apply(
        None, name, op, prescale_factor, postscale_factor, process_set, *sent
    )
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0; differentiable."""
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """``root_rank``'s tensor (``root_rank`` is a global rank), as a new tensor; differentiable."""
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


def alltoall(
    tensor: torch.Tensor,
    splits: torch.Tensor | Sequence[int] | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Send ``splits[i]`` rows to rank i (equal blocks when None). Returns the received rows,
    or ``(output, received_splits)`` when ``splits`` was given; differentiable."""
    output, received = HorovodAlltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce ``tensor`` and keep this rank's block of dim 0; differentiable."""
    compression = compression_for(compression, Compression.none)
    sent, ctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(sent, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    compression = compression_for(compression, Compression.none)
    sent, ctxs = zip(*(compression.compress(t) for t in tensors)) if tensors else ((), ())
    outs = HorovodGroupedReducescatter.apply(
        name, op, process_set, prescale_factor, postscale_factor, *sent
    )
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]


__all__ = [
    "HorovodAllgather",
    "HorovodAllreduce",
    "HorovodAlltoall",
    "HorovodBroadcast",
    "HorovodGroupedAllgather",
    "HorovodGroupedAllreduce",
    "HorovodGroupedReducescatter",
    "HorovodReducescatter",
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "grouped_allgather",
    "broadcast",
    "alltoall",
    "reducescatter",
    "grouped_reducescatter",
]
