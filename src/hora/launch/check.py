"""``hora check``: what this installation can use, and for each thing missing why and how to
get it (which pip extra installs it).

Every probe is a small function returning :class:`Finding`; :func:`findings` runs them all and
:func:`command` prints the report. Optional packages are imported lazily inside the probes.
Runs in the caller's thread; thread-safe (no shared state).
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    group: str  # frameworks, backends, transports or devices
    name: str
    available: bool
    detail: str  # the version found, or why it is missing and how to install it


def _torch() -> Finding:
    try:
        torch = importlib.import_module("torch")
    except ImportError as e:
        return Finding(
            "frameworks",
            "PyTorch",
            False,
            f"not importable ({e}); install with: pip install 'hora[torch]'",
        )
    return Finding("frameworks", "PyTorch", True, f"torch {torch.__version__}")


def _numpy() -> Finding:
    import numpy

    return Finding("frameworks", "NumPy", True, f"numpy {numpy.__version__} (always available)")


def _native() -> Finding:
    return Finding(
        "backends", "native", True, "hora's own collectives over its transports (always available)"
    )


def _mpi() -> Finding:
    try:
        mpi = importlib.import_module("mpi4py.MPI")
    except ImportError as e:
        return Finding(
            "backends",
            "MPI",
            False,
            f"mpi4py is not importable ({e}); install an MPI library (e.g. "
            "apt-get install libopenmpi-dev openmpi-bin) and pip install 'hora[mpi]'",
        )
    library = mpi.Get_library_version().replace("\x00", "").strip().splitlines()[0]
    major, minor = mpi.Get_version()
    return Finding("backends", "MPI", True, f"{library.rstrip(', ')} (MPI {major}.{minor})")


def _gloo() -> Finding:
    try:
        dist = importlib.import_module("torch.distributed")
    except ImportError:
        return Finding(
            "backends",
            "Gloo",
            False,
            "needs PyTorch's torch.distributed; install with: pip install 'hora[torch]'",
        )
    if not dist.is_available() or not dist.is_gloo_available():
        return Finding(
            "backends",
            "Gloo",
            False,
            "this PyTorch build has no Gloo; install the official wheel: pip install 'hora[torch]'",
        )
    return Finding("backends", "Gloo", True, "through torch.distributed")


def _cuda() -> tuple[object | None, int]:
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return None, 0
    return torch, torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nccl() -> Finding:
    torch, gpus = _cuda()
    if torch is None:
        return Finding(
            "backends",
            "NCCL",
            False,
            "needs PyTorch built with CUDA; install with: pip install 'hora[torch]' (a CUDA build)",
        )
    if gpus == 0:
        return Finding(
            "backends",
            "NCCL",
            False,
            "no CUDA GPU visible to PyTorch (a CPU-only build, or no GPU/driver)",
        )
    try:
        version = torch.cuda.nccl.version()  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError) as e:
        return Finding("backends", "NCCL", False, f"PyTorch has no NCCL ({e})")
    text = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return Finding("backends", "NCCL", True, f"NCCL {text}")


def _tcp() -> Finding:
    return Finding("transports", "TCP", True, "native sockets (always available)")


def _shm() -> Finding:
    from hora.transport.shm.transport import available

    if not available():
        return Finding(
            "transports",
            "shared memory",
            False,
            "needs Linux (memfd_create, abstract Unix sockets); ranks on one host use TCP",
        )
    return Finding(
        "transports",
        "shared memory",
        True,
        "same-host ranks use anonymous shared memory (HORA_SHM_DISABLE=1 turns it off)",
    )


def _gpus() -> Finding:
    torch, gpus = _cuda()
    if torch is None:
        return Finding(
            "devices",
            "GPUs",
            False,
            "none seen: PyTorch is not installed (pip install 'hora[torch]')",
        )
    if gpus == 0:
        return Finding("devices", "GPUs", False, "none seen by PyTorch; CPU only")
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]  # type: ignore[attr-defined]
    return Finding("devices", "GPUs", True, f"{gpus}: " + ", ".join(names))


PROBES = (_numpy, _torch, _native, _mpi, _gloo, _nccl, _tcp, _shm, _gpus)


def findings() -> list[Finding]:
    """Run every probe."""
    return [probe() for probe in PROBES]


def report(items: list[Finding]) -> str:
    from importlib.metadata import version

    lines = [
        f"hora {version('hora')} on Python {platform.python_version()} "
        f"({sys.executable}), {platform.system()} {platform.machine()}"
    ]
    group = None
    for item in items:
        if item.group != group:
            group = item.group
            lines += ["", f"{group}:"]
        mark = "[X]" if item.available else "[ ]"
        lines.append(f"    {mark} {item.name}: {item.detail}")
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    """``hora check`` takes no arguments."""


def command(args: argparse.Namespace) -> int:
    print(report(findings()))
    return 0
