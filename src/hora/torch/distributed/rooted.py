"""``gather``, ``scatter`` and ``reduce`` of hora's process group: torch's rooted calls on
hora's rooted ops (:mod:`hora.frameworks.rooted`), negotiated by the engine with the root in
the request, so ranks that disagree on the root, the dtype or the size all raise naming two
of them.

Tensors travel flat (one row per rank), as torch's rooted calls ask for equal sizes on every
rank, from host memory (a CUDA tensor through a host copy). Results are copied into torch's
output tensors when the op completes (the engine thread). Called from
:class:`~hora.torch.distributed.group.HoraProcessGroup` in the caller's thread.
"""

from __future__ import annotations

from typing import Any

import torch

from hora.frameworks import rooted
from hora.torch.adapter import to_tensor
from hora.torch.distributed.p2p import HostBuffer
from hora.torch.distributed.work import HoraWork


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1)


def _one(tensors: list[torch.Tensor], call: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"hora backend: {call} takes one tensor per rank, got {len(tensors)}")
    return tensors[0]


def _root(group: Any, opts: Any, call: str) -> int:
    """The root's global rank, from torch's group rank in ``opts``."""
    root = int(opts.rootRank)
    if not 0 <= root < group.size():
        raise ValueError(f"hora backend: {call}: root {root} is not a rank of a group of "
                         f"{group.size()}")  # fmt: skip
    return int(group._ranks[root])


def reduce(group: Any, tensors: list[torch.Tensor], opts: Any, op: int) -> HoraWork:
    """``dist.reduce``: the root's tensor gets the reduction; the others' stay as they were."""
    call = "reduce"
    tensor = _one(tensors, call)
    root = _root(group, opts, call)
    s = HostBuffer(tensor)
    name = group._name(call, [tensor], op, root)

    def start() -> list[Any]:
        return [rooted.reduce_async(s.array, root, name=name, op=op, process_set=group._set,
                                    dtype=s.dtype)]  # fmt: skip

    def finish(results: list[Any]) -> None:
        if group.rank() == opts.rootRank:
            s.write_back()

    return group._work(call, [tensor], start, finish, [name])  # type: ignore[no-any-return]


def gather(group: Any, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
           opts: Any) -> HoraWork:  # fmt: skip
    """``dist.gather``: every rank's tensor into the root's ``gather_list``."""
    call = "gather"
    tensor = _one(inputs, call)
    root = _root(group, opts, call)
    s = HostBuffer(_flat(tensor))
    name = group._name(call, [tensor], root)
    targets = list(outputs[0]) if outputs else []

    def start() -> list[Any]:
        return [rooted.gather_async(s.array, root, name=name, process_set=group._set,
                                    dtype=s.dtype)]  # fmt: skip

    def finish(results: list[Any]) -> None:
        if group.rank() != opts.rootRank:
            return
        rows = results[0]
        if len(targets) != len(rows) or any(t.numel() != rows.shape[1] for t in targets):
            raise ValueError(
                f"the root's gather_list holds {[t.numel() for t in targets]} elements, the "
                f"group sent {len(rows)} tensors of {rows.shape[1]}"
            )
        for t, row in zip(targets, rows):
            t.copy_(to_tensor(row, t).view(t.shape))

    return group._work(call, targets, start, finish, [name])  # type: ignore[no-any-return]


def scatter(group: Any, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
            opts: Any) -> HoraWork:  # fmt: skip
    """``dist.scatter``: piece ``i`` of the root's ``scatter_list`` into rank ``i``'s
    tensor."""
    call = "scatter"
    out = _one(outputs, call)
    root = _root(group, opts, call)
    target = HostBuffer(_flat(out))
    rows: Any = None
    problem = ""
    if group.rank() == opts.rootRank:
        pieces = list(inputs[0]) if inputs else []
        if len(pieces) != group.size() or any(p.numel() != out.numel() for p in pieces):
            problem = (f"the root's scatter_list holds {[p.numel() for p in pieces]} elements; "
                       f"it needs {group.size()} tensors of {out.numel()} (the output's size)")
        else:
            rows = HostBuffer(torch.stack([_flat(p) for p in pieces])).array
    name = group._name(call, [out], root)

    def start() -> list[Any]:
        try:
            return [rooted.scatter_async(rows, root, like=target.array, name=name,
                                         process_set=group._set, dtype=target.dtype)]
        except ValueError:
            if not problem:
                raise
            # the root joined the op so that the other ranks fail too (hora.frameworks.rooted);
            # they forget the names' period on that failure, so does the root
            group._names.reset()
            raise ValueError(problem) from None  # fmt: skip

    def finish(results: list[Any]) -> None:
        out.data.copy_(to_tensor(results[0].reshape(-1), out).view(out.shape))

    return group._work(call, [out], start, finish, [name])  # type: ignore[no-any-return]
