"""The lab's GPU side, as the benchmarks' parent process sees it: devices, backends, reasons.

``hora bench allreduce --device cuda`` compares three ways of reducing CUDA tensors
(:data:`CUDA_BACKENDS`): hora with ``HOROVOD_GPU_OPERATIONS=NCCL`` (``hora-nccl``), hora with its
CPU backend, the tensors staged through pinned host memory (``hora-staged``), and
torch.distributed's NCCL called directly (``nccl``). :func:`unavailable` says why one cannot run
here (no CUDA build of torch, no GPU, no NCCL), :func:`short_of_devices` why a rank count does
not fit the GPUs (NCCL wants one GPU per rank), :func:`describe` names the GPUs for titles, and
:func:`without_backend_choice` clears the caller's backend variables from a worker's environment
so that each hora variant runs on the backend its name promises. ``hora bench scaling`` resolves
its ``--device`` with :func:`resolve_device`. The measuring side is :mod:`hora.lab.gpu_workers`.

torch is imported only inside the functions that need it, so importing this module is cheap.
Pure functions apart from asking torch about the devices; thread-safe.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from collections import Counter
from collections.abc import Mapping

DEVICES = ("cpu", "cuda")
CUDA_BACKENDS = ("hora-nccl", "hora-staged", "nccl")
# hora's CUDA variants: what chooses each one's backend in its workers' environment ...
HORA_CUDA_VARIANTS: dict[str, dict[str, str]] = {
    "hora-nccl": {"HOROVOD_GPU_OPERATIONS": "NCCL"},
    "hora-staged": {"HOROVOD_CPU_OPERATIONS": "native"},
}
# ... and the backend hora must then report (a worker on another backend fails, saying so)
EXPECTED_BACKEND = {"hora-nccl": "nccl", "hora-staged": "native"}
# the variables that choose hora's backend (hora.settings): the caller's must not leak through
_BACKEND_CHOICE = re.compile(
    r"^(HORA|HOROVOD)_(CPU_OPERATIONS|CONTROLLER|GPU_OPERATIONS|"
    r"GPU_(ALLREDUCE|ALLGATHER|BROADCAST|ALLTOALL|REDUCESCATTER))$"
)
NO_GPU = "needs an NVIDIA GPU and a CUDA build of torch"


def without_backend_choice(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the variables that choose hora's backend (``HOROVOD_CPU_OPERATIONS``,
    ``HOROVOD_CONTROLLER``, ``HOROVOD_GPU_OPERATIONS``, ``HOROVOD_GPU_<OP>``, their ``HORA_``
    spellings)."""
    return {k: v for k, v in env.items() if not _BACKEND_CHOICE.match(k)}


def no_gpu_reason() -> str | None:
    """Why CUDA tensors cannot be used here, or None when torch sees a GPU."""
    if importlib.util.find_spec("torch") is None:
        return f"{NO_GPU}; torch is not installed"
    import torch

    if torch.version.cuda is None:
        return f"{NO_GPU}; torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return f"{NO_GPU}; there is none here (torch.cuda.is_available() is False)"
    return None


def device_count() -> int:
    """CUDA devices torch sees (0 without torch or a GPU)."""
    if no_gpu_reason() is not None:
        return 0
    import torch

    return int(torch.cuda.device_count())


def unavailable(backend: str) -> str | None:
    """Why the CUDA ``backend`` cannot run here, or None when it can."""
    if backend not in CUDA_BACKENDS:
        raise ValueError(f"{backend!r} is not a CUDA backend: choose from {CUDA_BACKENDS}")
    reason = no_gpu_reason()
    if reason is not None:
        return reason
    if backend in ("nccl", "hora-nccl"):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_nccl_available()):
            return "this torch has no NCCL (torch.distributed.is_nccl_available() is False)"
    return None


# the CUDA backends whose ranks may share a GPU (rank r on cuda:<local rank % GPUs>): hora's
# staged path reduces in host memory, which any number of ranks on one GPU can; NCCL cannot
SHARE_GPUS = ("hora-staged",)


def short_of_devices(nranks: int, backend: str = "nccl") -> str | None:
    """Why ``nranks`` ranks of ``backend`` do not fit this machine's GPUs (one each, but for
    :data:`SHARE_GPUS`), or None when they do."""
    count = device_count()
    if nranks <= count or (backend in SHARE_GPUS and count):
        return None
    return (
        f"--np {nranks} needs {nranks} GPUs, one per rank (NCCL refuses two ranks on one GPU); "
        f"this machine has {count}: give --np {max(count, 1)}"
    )


def _smi_names() -> list[str]:
    """GPU names by nvidia-smi index; empty when nvidia-smi is missing or fails."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return (
        [ln.strip() for ln in done.stdout.splitlines() if ln.strip()] if not done.returncode else []
    )


def describe() -> str:
    """The GPUs torch sees, e.g. ``"2 x NVIDIA H100 80GB HBM3"``; ``"no GPU"`` without one.

    Names come from nvidia-smi where it can tell which GPUs these are, so that the benchmark's
    parent process does not open a CUDA context of its own (torch's names need one)."""
    count = device_count()
    if not count:
        return "no GPU"
    names, indices = _smi_names(), visible_indices(count)
    if indices is not None and len(indices) == count and all(i < len(names) for i in indices):
        chosen = [names[i] for i in indices]
    else:
        import torch

        chosen = [torch.cuda.get_device_name(i) for i in range(count)]
    return ", ".join(f"{n} x {name}" for name, n in Counter(chosen).items())


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda`` without a GPU ->
    ValueError saying why; ``cpu`` as it is."""
    if device not in ("auto", *DEVICES):
        raise ValueError(f"--device {device!r}: choose from auto, {', '.join(DEVICES)}")
    if device == "cpu":
        return device
    reason = no_gpu_reason()
    if device == "auto":
        return "cpu" if reason else "cuda"
    if reason:
        raise ValueError(f"--device cuda {reason}; leave it out (or give --device cpu)")
    return device


def visible_indices(count: int) -> list[int] | None:
    """nvidia-smi's indices of the first ``count`` GPUs a process here sees as ``cuda:0``,
    ``cuda:1``, ...: through ``CUDA_VISIBLE_DEVICES`` when it lists indices; None (every GPU)
    when it names GPUs by UUID."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return list(range(count))
    parts = [p.strip() for p in listed.split(",") if p.strip()]
    if not all(p.isdigit() for p in parts):
        return None
    return [int(p) for p in parts[:count]]
