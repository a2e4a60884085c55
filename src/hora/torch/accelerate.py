"""Hugging Face Accelerate on hora: :func:`accelerator`, an ``Accelerator`` whose group is hora's.

Accelerate's CPU path picks the backend itself, Gloo (or MPI where torch has it), and refuses any
other name: ``Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="hora")])``
raises "Your assigned backend hora is not available, please use gloo". It starts a process group
only when none exists, though, and then adopts the one it finds. So the recipe is to make the
group first::

    dist.init_process_group(backend="hora")      # before the Accelerator
    accelerator = Accelerator(cpu=True)

:func:`accelerator` is that recipe in one call, taking ``Accelerator``'s own arguments (an
``InitProcessGroupKwargs(backend="hora", timeout=...)`` among them is used for the group and
not passed on, so the line a user first writes works). It also checks that Accelerate took every
rank of the group, and names the backend ``hora`` in Accelerate's state, which would otherwise
report the Gloo it did not start (Accelerate then gathers with ``all_gather_into_tensor``, as on
any backend but Gloo). Under torchrun and ``hora run`` alike. Needs ``accelerate`` (the
``accelerate`` extra). Runs in the thread that calls it.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

import hora.torch.distributed  # noqa: F401 - registers backend="hora", fills torch's env

__all__ = ["accelerator"]


def _group_kwargs(handlers: list[Any]) -> tuple[dict[str, Any], list[Any]]:
    """``init_process_group``'s keywords from an ``InitProcessGroupKwargs`` among ``handlers``,
    and the handlers Accelerate is to get (that one left out)."""
    from accelerate.utils import InitProcessGroupKwargs

    group: dict[str, Any] = {}
    rest = []
    for h in handlers:
        if not isinstance(h, InitProcessGroupKwargs):
            rest.append(h)
            continue
        group = h.to_kwargs()
        backend = group.pop("backend", "hora")
        if backend != "hora":
            raise ValueError(
                f"hora.torch.accelerate.accelerator: InitProcessGroupKwargs(backend={backend!r}) "
                "asks for another backend; leave it out or give backend='hora'"
            )
    return group, rest


def accelerator(*args: Any, cpu: bool = True, **kwargs: Any) -> Any:
    """``accelerate.Accelerator(*args, cpu=cpu, **kwargs)`` on torch's default group made with
    ``backend="hora"`` (made here unless the script made one; a group of another backend
    raises)."""
    from accelerate import Accelerator, PartialState

    group, handlers = _group_kwargs(list(kwargs.pop("kwargs_handlers", None) or []))
    if not dist.is_initialized():
        dist.init_process_group(backend="hora", **group)
    elif dist.get_backend() != "hora":
        raise ValueError(
            f"hora.torch.accelerate.accelerator: torch's default group runs "
            f"{dist.get_backend()!r}, not hora; make the Accelerator before any "
            "init_process_group, or make that group with backend='hora'"
        )
    acc = Accelerator(*args, cpu=cpu, kwargs_handlers=handlers, **kwargs)
    if acc.num_processes != dist.get_world_size():
        raise ValueError(
            f"hora.torch.accelerate.accelerator: Accelerate counts {acc.num_processes} "
            f"process(es) but hora's group has {dist.get_world_size()} "
            f"({acc.distributed_type}); on CPUs pass cpu=True"
        )
    # the name Accelerate reports and branches on; its partial state holds a copy
    acc.state.backend = PartialState().backend = "hora"
    return acc
