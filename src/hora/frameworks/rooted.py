"""The rooted collectives: reduce to one rank, gather to one rank, scatter from one rank.

Each is submitted as the engine op that moves the same data (an allreduce, an allgather, an
alltoall) with its root in the request, so it is negotiated, fused and cached like any other
op, and the coordinator's checks cover it: ranks that name different roots, dtypes or shapes
all raise the same error naming two of them. The cost against a dedicated rooted algorithm is
small: a ring allreduce moves what a ring reduce plus a gather to the root move, an allgather
leaves the root as long as a gather does (the other ranks receive too), and a scatter is an
alltoall in which only the root sends. A gather's tensors and a scatter's pieces must have
the same shape on every rank (each travels as one row), as torch asks.

Called from user threads; results come back through the handle as the op surface's do.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hora.collectives.reduce_ops import ADASUM
from hora.core import runtime as _rt
from hora.core.handles import Handle
from hora.core.messages import OpType, Request
from hora.core.process_sets import ProcessSet, resolve
from hora.errors import NotSupportedError
from hora.frameworks.submit import Finalize, _prepare, _reduce_op, _set_id, _submit


def _root(what: str, root_rank: int, process_set: ProcessSet | None) -> tuple[int, int, bool]:
    """The set's id, the checked global root, and whether this rank is it."""
    ps_id = _set_id(process_set)
    ranks = resolve(process_set).ranks
    root = int(root_rank)
    if root not in ranks:
        raise ValueError(
            f"{what} received invalid root rank {root}: the root must be a global rank in the "
            f"process set {ranks}"
        )
    return ps_id, root, _rt.runtime().identity.rank == root


def reduce_async(
    array: Any,
    root_rank: int,
    *,
    name: str | None = None,
    op: int | None = None,
    process_set: ProcessSet | None = None,
    dtype: str | None = None,
    finalize: Finalize = None,
) -> Handle:
    """Reduce ``array`` over the set into the root's ``array`` (in place); the other ranks'
    arrays are left as they were. The handle's result is the reduced array on every rank."""
    ps_id, root, is_root = _root("reduce", root_rank, process_set)
    op = _reduce_op(op)
    if op == ADASUM:
        raise NotSupportedError("reduce does not support Adasum: use op=hvd.Sum or hvd.Average")

    def make(arr: np.ndarray, dt: str, n: str) -> Request:
        return Request(OpType.ALLREDUCE, n, dt, tuple(arr.shape), root=root, reduce_op=op)

    reqs, arrs, handle = _prepare(OpType.ALLREDUCE, [array], name, dtype, False, finalize,
                                  make, ps_id)  # fmt: skip
    return _submit(ps_id, reqs, arrs, [arrs[0] if is_root else None], handle, False)


def gather_async(
    array: Any,
    root_rank: int,
    *,
    name: str | None = None,
    process_set: ProcessSet | None = None,
    dtype: str | None = None,
    finalize: Finalize = None,
) -> Handle:
    """Gather every rank's ``array`` (one shape on every rank) to the root: the handle's
    result is an array of shape ``(set size, *array.shape)``, rows in set-rank order."""
    ps_id, root, _ = _root("gather", root_rank, process_set)

    def make(arr: np.ndarray, dt: str, n: str) -> Request:
        return Request(OpType.ALLGATHER, n, dt, (1, *arr.shape), root=root)

    reqs, arrs, handle = _prepare(OpType.ALLGATHER, [array], name, dtype, False, finalize,
                                  make, ps_id)  # fmt: skip
    return _submit(ps_id, reqs, [arrs[0].reshape(1, *arrs[0].shape)], [None], handle, False)


def scatter_async(
    array: Any,
    root_rank: int,
    *,
    like: Any,
    name: str | None = None,
    process_set: ProcessSet | None = None,
    dtype: str | None = None,
    finalize: Finalize = None,
) -> Handle:
    """Scatter the root's ``array`` of shape ``(set size, *like.shape)``: row ``i`` goes to
    set rank ``i``. Other ranks pass ``array=None``; ``like`` is the array each rank
    receives into (its shape and dtype). The handle's result is this rank's row.

    A root whose ``array`` is missing or of another shape raises ValueError, but first joins
    the op with a request that no rank's matches: the other ranks, already waiting in the
    scatter, then fail at once with the coordinator's mismatch error naming the root, instead
    of waiting for a root that never comes."""
    ps_id, root, is_root = _root("scatter", root_rank, process_set)
    n = len(resolve(process_set).ranks)
    like = np.asarray(like)
    problem = ""
    if is_root:
        rows = None if array is None else np.asarray(array)
        if rows is None or rows.shape != (n, *like.shape):
            got = ("no pieces" if rows is None else
                   f"pieces of shape {list(rows.shape[1:])} x {rows.shape[0] if rows.ndim else 0}")
            problem = (f"scatter: the root has {got}, the output is {list(like.shape)}; give one "
                       f"piece per rank ({n}) of the output's shape")  # fmt: skip
            rows = np.empty((0, *like.shape, 0), dtype=like.dtype)  # no rank's shape
        splits = (0,) * n if problem else (1,) * n
    else:
        rows = np.empty((0, *like.shape), dtype=like.dtype)
        splits = (0,) * n

    def make(arr: np.ndarray, dt: str, nm: str) -> Request:
        return Request(OpType.ALLTOALL, nm, dt, tuple(arr.shape), root=root, splits=splits)

    def row(res: Any) -> Any:
        out = res[0]
        return finalize(out) if finalize is not None else out

    reqs, arrs, handle = _prepare(OpType.ALLTOALL, [rows], name, dtype, False, row, make, ps_id)
    submitted = _submit(ps_id, reqs, arrs, [None], handle, False)
    if problem:  # the op fails on every rank; its handle is not the caller's to wait on
        raise ValueError(problem)
    return submitted
