"""``hora check``: what this installation can use, and for each thing missing why and how to
get it (which pip extra installs it).

Every probe is a small function returning :class:`Finding` in one of three states: available,
not installed, or installed but not loadable (with the reason in one line). :func:`findings`
runs them all and never raises: a probe that fails in a way nobody foresaw is reported as not
loadable with its error. The MPI probe runs in a child process, because loading a broken MPI
library can abort the process that loads it. :func:`command` prints the report and returns 0.
Runs in the caller's thread; thread-safe (no shared state).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

AVAILABLE, MISSING, BROKEN = "available", "not installed", "installed but not loadable"


@dataclass(frozen=True)
class Finding:
    group: str  # frameworks, backends, transports or devices
    name: str
    available: bool
    detail: str  # the version found, or why it is missing and how to install it
    state: str = ""  # AVAILABLE, MISSING or BROKEN; derived from `available` when not given

    def __post_init__(self) -> None:
        if not self.state:
            object.__setattr__(self, "state", AVAILABLE if self.available else MISSING)


def _one_line(error: BaseException | str) -> str:
    """An error as one line: its type and the first non-empty line of its message, plus the
    line that names a missing shared object when there is one."""
    text = str(error) if isinstance(error, str) else f"{type(error).__name__}: {error}"
    lines = [ln.strip() for ln in text.replace("\x00", "").splitlines() if ln.strip()]
    if not lines:
        return type(error).__name__ if isinstance(error, BaseException) else "unknown error"
    so = [ln for ln in lines[1:] if ".so" in ln or "cannot open" in ln]
    return "; ".join([lines[0], *so[:1]])[:300]


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _broken(group: str, name: str, error: BaseException | str, hint: str = "") -> Finding:
    detail = f"{BROKEN}: {_one_line(error)}" + (f" ({hint})" if hint else "")
    return Finding(group, name, False, detail, BROKEN)


def _torch() -> Finding:
    if not _installed("torch"):
        return Finding(
            "frameworks", "PyTorch", False, f"{MISSING}; install with: pip install 'hora[torch]'"
        )
    try:
        torch = importlib.import_module("torch")
    except Exception as e:
        return _broken("frameworks", "PyTorch", e, "reinstall: pip install 'hora[torch]'")
    return Finding("frameworks", "PyTorch", True, f"torch {torch.__version__}")


def _tensorflow() -> Finding:
    if not _installed("tensorflow"):
        return Finding("frameworks", "TensorFlow", False, f"{MISSING} (hora does not need it)")
    if not _installed("hora.tensorflow"):
        return Finding(
            "frameworks", "TensorFlow", False, "installed, but this hora has no hora.tensorflow"
        )
    # in a child process: importing TensorFlow is slow, and a broken one can end the process
    code = "import tensorflow as tf, hora.tensorflow; print(tf.__version__)"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return _broken("frameworks", "TensorFlow", e)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exited with {done.returncode}"]
        return _broken("frameworks", "TensorFlow", lines[-1])
    return Finding("frameworks", "TensorFlow", True, f"tensorflow {done.stdout.strip()}")


def _numpy() -> Finding:
    import numpy

    return Finding("frameworks", "NumPy", True, f"numpy {numpy.__version__} (always available)")


def _native() -> Finding:
    return Finding(
        "backends", "native", True, "hora's own collectives over its transports (always available)"
    )


# Run in a child process: prints one JSON object. mpi4py.rc.initialize=False: the library is
# loaded and asked for its version, but MPI_Init is never called.
_MPI_PROBE = """
import json, sys
try:
    import mpi4py
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI
    lib = MPI.Get_library_version().replace("\\x00", "").strip().splitlines()[0]
    out = {"ok": True, "library": lib.rstrip(", "), "version": list(MPI.Get_version())}
except BaseException as e:
    out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
print(json.dumps(out))
"""


def _mpi() -> Finding:
    if not _installed("mpi4py"):
        return Finding(
            "backends",
            "MPI",
            False,
            f"{MISSING}: mpi4py is not importable; install an MPI library (e.g. "
            "apt-get install libopenmpi-dev openmpi-bin) and pip install 'hora[mpi]'",
        )
    if sys.modules.get("mpi4py.MPI", False) is None:  # imports of it are blocked here
        return _broken(
            "backends", "MPI", "mpi4py.MPI cannot be imported", "pip install 'hora[mpi]'"
        )
    hint = "check the MPI library mpi4py was built for (MPI4PY_LIBMPI, LD_LIBRARY_PATH)"
    try:
        done = subprocess.run(
            [sys.executable, "-c", _MPI_PROBE],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return _broken("backends", "MPI", e, hint)
    lines = done.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except ValueError:
        result = None
    if not isinstance(result, dict):
        why = done.stderr.strip().splitlines()[-1:] or [f"the probe exited with {done.returncode}"]
        return _broken("backends", "MPI", f"loading it ended the process: {why[0]}", hint)
    if not result.get("ok"):
        return _broken("backends", "MPI", str(result.get("error")), hint)
    major, minor = result["version"]
    return Finding("backends", "MPI", True, f"{result['library']} (MPI {major}.{minor})")


def _gloo() -> Finding:
    if not _installed("torch"):
        return Finding(
            "backends",
            "Gloo",
            False,
            f"{MISSING}: needs PyTorch's torch.distributed; "
            "install with: pip install 'hora[torch]'",
        )
    try:
        dist = importlib.import_module("torch.distributed")
        usable = dist.is_available() and dist.is_gloo_available()
    except Exception as e:
        return _broken("backends", "Gloo", e)
    if not usable:
        return Finding(
            "backends",
            "Gloo",
            False,
            "this PyTorch build has no Gloo; install the official wheel: pip install 'hora[torch]'",
        )
    return Finding("backends", "Gloo", True, "through torch.distributed")


def _cuda() -> tuple[object | None, int]:
    if not _installed("torch"):
        return None, 0
    torch = importlib.import_module("torch")
    return torch, torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nccl() -> Finding:
    torch, gpus = _cuda()
    if torch is None:
        return Finding(
            "backends",
            "NCCL",
            False,
            f"{MISSING}: needs PyTorch built with CUDA; install with: pip install 'hora[torch]' "
            "(a CUDA build)",
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
        return _broken("backends", "NCCL", e, "PyTorch has no usable NCCL")
    text = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return Finding("backends", "NCCL", True, f"NCCL {text}")


def _ccl() -> Finding:
    return Finding(
        "backends", "CCL", False, "not built into hora (HOROVOD_CPU_OPERATIONS=ccl is refused)"
    )


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


PROBES: tuple[Callable[[], Finding], ...] = (
    _numpy, _torch, _tensorflow, _native, _mpi, _gloo, _nccl, _ccl, _tcp, _shm, _gpus,
)  # fmt: skip
_GROUPS = {
    "_numpy": ("frameworks", "NumPy"), "_torch": ("frameworks", "PyTorch"),
    "_tensorflow": ("frameworks", "TensorFlow"), "_native": ("backends", "native"),
    "_mpi": ("backends", "MPI"), "_gloo": ("backends", "Gloo"), "_nccl": ("backends", "NCCL"),
    "_ccl": ("backends", "CCL"), "_tcp": ("transports", "TCP"),
    "_shm": ("transports", "shared memory"), "_gpus": ("devices", "GPUs"),
}  # fmt: skip


def _safe(probe: Callable[[], Finding]) -> Finding:
    """Run one probe; any error it raises becomes a not-loadable finding."""
    try:
        return probe()
    except Exception as e:
        group, name = _GROUPS.get(probe.__name__, ("other", probe.__name__.strip("_")))
        return _broken(group, name, e)


def findings() -> list[Finding]:
    """Run every probe; never raises."""
    return [_safe(probe) for probe in PROBES]


def report(items: list[Finding]) -> str:
    try:
        from importlib.metadata import version

        own = version("hora")
    except Exception:
        own = "(version unknown)"
    lines = [
        f"hora {own} on Python {platform.python_version()} "
        f"({sys.executable}), {platform.system()} {platform.machine()}"
    ]
    group = None
    for item in items:
        if item.group != group:
            group = item.group
            lines += ["", f"{group}:"]
        mark = {AVAILABLE: "[X]", BROKEN: "[!]"}.get(item.state, "[ ]")
        lines.append(f"    {mark} {item.name}: {item.detail}")
    lines += ["", "[X] available, [ ] not installed or not built, [!] installed but not loadable"]
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    """``hora check`` takes no arguments."""


def command(args: argparse.Namespace) -> int:
    """Print the report; always 0 (a missing or broken part is a finding, not an error)."""
    print(report(findings()))
    return 0
