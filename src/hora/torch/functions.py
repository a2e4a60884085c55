"""Bringing every rank to rank 0's model: parameters, optimizer state and arbitrary objects.

``broadcast_parameters`` overwrites tensors in place (a ``state_dict()`` or
``named_parameters()``). ``broadcast_optimizer_state`` makes every rank's optimizer equal to the
root's: first the root's layout (parameter-group options such as ``lr``, scalar state, and the
shape and dtype of each state tensor) travels as one object; every rank then creates whatever
state tensors it lacks and receives their values in place. No optimizer step is taken to
initialise state, so parameters are never touched; as in Horovod, a new optimizer's parameters
that require grad are left with zero gradients where they had none.
``broadcast_object``/``allgather_object`` pickle any object.

Collective: every rank must call these in the same order. Run in the training thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

import hora
from hora import global_process_set
from hora.frameworks import ops
from hora.torch.mpi_ops import ProcessSet, broadcast_async_, synchronize
from hora.torch.wrapper import unwrap

Params = Mapping[str, torch.Tensor] | Iterable[torch.Tensor | tuple[str, torch.Tensor]]


def broadcast_parameters(
    params: Params, root_rank: int, *, process_set: ProcessSet = global_process_set
) -> None:
    """Overwrite each tensor in ``params`` with the root's, in place.

    ``params`` is a dict such as ``model.state_dict()`` (taken in sorted-name order) or an
    iterable of tensors or ``(name, tensor)`` pairs such as ``model.named_parameters()``.
    """
    if isinstance(params, Mapping):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(
            f"invalid params of type {type(params).__name__}: pass a dict such as "
            "model.state_dict() or an iterable such as model.named_parameters()"
        )
    handles = []
    for i, (name, tensor) in enumerate(items):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"parameter {name or i!r} is a {type(tensor).__name__}, not a tensor")
        # Unnamed tensors are named by position so that every rank uses the same names.
        label = str(name) if name is not None else f"broadcast_parameters.{i}"
        handles.append(broadcast_async_(tensor, root_rank, label, process_set))
    for h in handles:
        synchronize(h)


def _layout(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The root's optimizer, described: options per group, and per parameter its state with
    tensors as (shape, dtype, lives-on-the-parameter's-device) and everything else by value."""
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            entry: dict[Any, tuple[str, Any]] = {}
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    entry[key] = (
                        "tensor",
                        (tuple(value.shape), value.dtype, value.device == p.device),
                    )
                else:
                    entry[key] = ("value", value)
            params.append(entry)
        options = {k: v for k, v in group.items() if k != "params"}
        groups.append({"options": options, "params": params})
    return groups


def _zero_grads(optimizer: torch.optim.Optimizer) -> None:
    """As Horovod leaves them after a new optimizer's state is broadcast: every parameter that
    requires grad and has none gets a zero gradient (sparse for SparseAdam). No step is taken,
    so the parameters themselves do not move."""
    sparse = isinstance(unwrap(optimizer), torch.optim.SparseAdam)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                zero = torch.zeros_like(p)
                p.grad = zero.to_sparse() if sparse else zero


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int,
    model: torch.nn.Module | None = None,
    *,
    process_set: ProcessSet = global_process_set,
) -> None:
    """Make ``optimizer`` (plain or wrapped, e.g. a ``DistributedOptimizer``) equal to the root's:
    parameter-group options (``lr``, ``momentum``, ...), per-parameter state (momentum
    buffers, Adam moments and step counts, ...) and a stateful compressor's shared state
    (PowerSGD's factors; each rank keeps its error memory). ``model`` is accepted for
    compatibility with Horovod's signature; the optimizer alone identifies the parameters.
    """
    if isinstance(unwrap(optimizer), torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state:
        _zero_grads(optimizer)
    counts = [len(g["params"]) for g in optimizer.param_groups]
    everyone = ops.allgather_object(counts, name="optimizer_state.counts", process_set=process_set)
    if any(c != counts for c in everyone):
        raise ValueError(
            f"optimizers differ across ranks (parameters per group, by rank: {everyone}); "
            "every rank must build the same optimizer before broadcasting its state"
        )
    is_root = hora.rank() == root_rank
    layout = ops.broadcast_object(
        _layout(optimizer) if is_root else None, root_rank, "optimizer_state.layout", process_set
    )
    tensors: list[tuple[str, torch.Tensor]] = []
    for g, (group, described) in enumerate(zip(optimizer.param_groups, layout)):
        if not is_root:
            group.update(described["options"])
        for i, (p, entry) in enumerate(zip(group["params"], described["params"])):
            if not entry:
                optimizer.state.pop(p, None)
                continue
            state = optimizer.state[p]
            for key in [k for k in state if k not in entry]:
                del state[key]
            for key in sorted(entry, key=str):
                kind, value = entry[key]
                if kind == "value":
                    if not is_root:
                        state[key] = value
                    continue
                shape, dtype, on_param_device = value
                current = state.get(key)
                if not (
                    isinstance(current, torch.Tensor)
                    and tuple(current.shape) == shape
                    and current.dtype == dtype
                ):
                    device = p.device if on_param_device else torch.device("cpu")
                    state[key] = current = torch.zeros(shape, dtype=dtype, device=device)
                tensors.append((f"optimizer_state.{g}.{i}.{key}", current))
    broadcast_parameters(tensors, root_rank, process_set=process_set)
    compressor = getattr(optimizer, "_compressor", None)
    if compressor is not None:  # PowerSGD's factors and the step count; error memory stays
        shared = compressor.shared_state() if is_root else None
        compressor.load_shared_state(
            ops.broadcast_object(shared, root_rank, "optimizer_state.compression", process_set)
        )


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """The root's ``obj`` on every rank (pickled with cloudpickle; tensors included)."""
    return ops.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(
    obj: Any, name: str | None = None, *, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Every rank's ``obj``, as a list in rank order."""
    return ops.allgather_object(obj, name, process_set)
