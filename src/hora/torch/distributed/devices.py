"""Which device types hora's process group serves: ``"hora"``, ``"cuda:hora"``,
``"cpu:hora,cuda:nccl"``.

torch's ``init_process_group`` takes one backend for every device type, or one per type. It
makes a group from the per-type form by making each type's backend in turn and registering it
with the group; but a backend that is itself a Python ``ProcessGroup`` (hora's) replaces the
whole group once made, so torch 2.13 would drop the types made before hora and never make
those after it. hora's creator therefore reads the map itself (torch's ``backend_config``, in
the frame that calls the creator) and builds a :class:`RoutedGroup`: hora's group, whose
calls on tensors of a type the map gives to another backend go to that backend, torch's own
(the one torch made already, else one made here with torch's store prefix for the type).

A GPU job whose CUDA tensors hora serves (``"hora"``, ``"cuda:hora"``) starts hora with its
NCCL backend, which takes CUDA tensors where they lie (``HOROVOD_GPU_OPERATIONS=NCCL``), unless
the script or launcher named hora's backend itself. Runs in the thread that calls
``init_process_group``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from hora.settings import env_lookup
from hora.torch.distributed import group as _group

HORA = "hora"
# torch's calls that carry tensors: routed by the device type of the first tensor
ROUTED = ("allreduce", "allreduce_coalesced", "reduce_scatter", "_reduce_scatter_base",
          "reduce_scatter_tensor_coalesced", "broadcast", "allgather", "allgather_coalesced",
          "_allgather_base", "allgather_into_tensor_coalesced", "alltoall", "alltoall_base",
          "reduce", "gather", "scatter", "send", "recv", "recv_anysource")  # fmt: skip
_CHOSEN = ("CPU_OPERATIONS", "CONTROLLER", "GPU_OPERATIONS", "GPU_ALLREDUCE", "GPU_ALLGATHER",
           "GPU_BROADCAST", "GPU_ALLTOALL", "GPU_REDUCESCATTER")  # fmt: skip


def _torch_locals() -> dict[str, Any]:
    """The locals of torch's ``_new_process_group_helper`` above this call, or {}."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_new_process_group_helper":
            return frame.f_locals
        frame = frame.f_back  # type: ignore[assignment]
    return {}


def device_map(config: Any) -> dict[str, str]:
    """Device type -> backend name, from torch's ``BackendConfig`` (None: hora for all)."""
    if config is None:
        return {"cpu": HORA, "cuda": HORA}
    return {str(d): str(b).lower() for d, b in config.get_device_backend_map().items()}


def choose_gpu_backend(served: set[str], environ: Any = os.environ) -> bool:
    """Have hora start with NCCL when it serves CUDA tensors on a machine with a GPU and
    nothing names its backend; True when it did."""
    if "cuda" not in served or any(env_lookup(environ, k) for k in _CHOSEN):
        return False
    if not torch.cuda.is_available():
        return False
    environ["HOROVOD_GPU_OPERATIONS"] = "NCCL"
    return True


def _device_type(args: Any) -> str | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
        if isinstance(a, (list, tuple)):
            found = _device_type(a)
            if found is not None:
                return found
    return None


class RoutedGroup(_group.HoraProcessGroup):
    """hora's group, its calls on tensors of the types in ``others`` going to those backends."""

    others: dict[str, Any] = {}


def _routed(name: str) -> Any:
    own = getattr(_group.HoraProcessGroup, name)

    def call(self: RoutedGroup, *args: Any) -> Any:
        kind = _device_type(args)
        other = self.others.get(kind or "")
        if other is None:
            return own(self, *args)
        fn = getattr(other, name, None)
        if fn is None:
            raise NotImplementedError(
                f"hora backend: {name} on {kind} tensors goes to {other.name()}, which has no "
                f"{name}"
            )
        return fn(*args)

    call.__name__ = call.__qualname__ = name
    return call


for _name in ROUTED:
    if hasattr(_group.HoraProcessGroup, _name):
        setattr(RoutedGroup, _name, _routed(_name))


def _other_backend(device: str, name: str, torch_locals: dict[str, Any], options: Any) -> Any:
    """torch's backend ``name`` for ``device``: the one torch made already, else a new one
    under torch's store prefix for the device."""
    made = torch_locals.get("pg")
    if made is not None:
        try:
            return made._get_backend(torch.device(device))
        except RuntimeError:
            pass  # not made yet: torch stops making backends at hora's
    store = dist.PrefixStore(f"{device}/", torch_locals.get("prefix_store", options.store))
    rank, size = int(options.group_rank), int(options.group_size)
    if name == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, options.timeout)
    if name == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = options.timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"hora backend: {device}:{name} beside hora is not supported; give "
                     f"{device} to hora, gloo or nccl")  # fmt: skip


def create(options: Any, backend_options: Any = None) -> Any:
    """torch's creator for ``"hora"`` in any of its forms (see the module's docstring)."""
    found = _torch_locals()
    devices = device_map(found.get("backend_config"))
    served = {d for d, b in devices.items() if b == HORA}
    choose_gpu_backend(served)
    pg = _group.create(options, backend_options)
    others = {d: _other_backend(d, b, found, options) for d, b in devices.items() if b != HORA}
    if not others:
        return pg
    pg.__class__ = RoutedGroup
    pg.others = others
    return pg
