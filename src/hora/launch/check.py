"""``hora check``: what this installation can use, and for each thing missing why and how to
get it (which pip extra installs it).

Every probe is a small function returning :class:`Finding` in one of three states: available,
not installed, or installed but not loadable (with the reason in one line). :func:`findings`
runs them all and never raises: a probe that fails in a way nobody foresaw is reported as not
loadable with its error. :func:`command` prints the report and returns 0.

It answers in well under a second because the checking process imports no framework: PyTorch
and TensorFlow are judged from their files (found, compiled core present, version, CUDA build;
see :mod:`hora.launch.check_files`) and the GPUs from the NVIDIA driver. The MPI probe loads the
library in a child process, because loading a broken MPI library can abort the process that
loads it. ``hora check --load`` also imports PyTorch and TensorFlow, each in its own child
process, all children running side by side. Runs in the caller's thread; thread-safe (no
shared state).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from hora.launch.check_files import (
    NCCL_DISTRIBUTIONS,
    TENSORFLOW_LOAD,
    TF_DISTRIBUTIONS,
    TORCH_LOAD,
    dist_version,
    has_extension,
    nvidia_gpus,
    package_dir,
    torch_build,
)

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


def _torch(run: _Run | None = None) -> Finding:
    folder = package_dir("torch")
    if folder is None:
        return Finding(
            "frameworks", "PyTorch", False, f"{MISSING}; install with: pip install 'hora[torch]'"
        )
    reinstall = "reinstall: pip install 'hora[torch]'"
    if run is not None and run.load:
        result, error = run.result("torch")
        if result is None:
            return _broken("frameworks", "PyTorch", error, reinstall)
        return Finding("frameworks", "PyTorch", True, f"torch {result['version']}")
    if not has_extension(folder, "_C"):
        why = f"its compiled core (torch/_C) is missing from {folder}"
        return _broken("frameworks", "PyTorch", why, reinstall)
    version = torch_build(folder).get("__version__") or dist_version("torch") or "(unknown)"
    return Finding("frameworks", "PyTorch", True, f"torch {version}")


def _tensorflow(run: _Run | None = None) -> Finding:
    folder = package_dir("tensorflow")
    if folder is None:
        return Finding("frameworks", "TensorFlow", False, f"{MISSING} (hora does not need it)")
    if not _installed("hora.tensorflow"):
        return Finding(
            "frameworks", "TensorFlow", False, "installed, but this hora has no hora.tensorflow"
        )
    if run is not None and run.load:
        result, error = run.result("tensorflow")
        if result is None:
            return _broken("frameworks", "TensorFlow", error)
        return Finding("frameworks", "TensorFlow", True, f"tensorflow {result['version']}")
    if not has_extension(folder / "python", "_pywrap_tensorflow_internal"):
        why = f"its compiled core (python/_pywrap_tensorflow_internal) is missing from {folder}"
        return _broken("frameworks", "TensorFlow", why, "reinstall: pip install 'hora[tensorflow]'")
    version = dist_version(*TF_DISTRIBUTIONS) or "(version unknown)"
    return Finding("frameworks", "TensorFlow", True, f"tensorflow {version}")


def _numpy(run: _Run | None = None) -> Finding:
    import numpy

    return Finding("frameworks", "NumPy", True, f"numpy {numpy.__version__} (always available)")


def _native(run: _Run | None = None) -> Finding:
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


def _mpi_blocked() -> bool:
    return sys.modules.get("mpi4py.MPI", False) is None  # imports of it are blocked here


def _mpi(run: _Run | None = None) -> Finding:
    if not _installed("mpi4py"):
        return Finding(
            "backends",
            "MPI",
            False,
            f"{MISSING}: mpi4py is not importable; install an MPI library (e.g. "
            "apt-get install openmpi-bin) and pip install 'hora[mpi]' (mpi4py's wheel "
            "loads that library: nothing to compile)",
        )
    if _mpi_blocked():
        return _broken(
            "backends", "MPI", "mpi4py.MPI cannot be imported", "pip install 'hora[mpi]'"
        )
    hint = "check the MPI library mpi4py was built for (MPI4PY_LIBMPI, LD_LIBRARY_PATH)"
    result, error = (run or _Run(load=False)).result("mpi")
    if result is None:
        return _broken("backends", "MPI", f"loading it ended the process: {error}", hint)
    if not result.get("ok"):
        return _broken("backends", "MPI", str(result.get("error")), hint)
    major, minor = result["version"]
    return Finding("backends", "MPI", True, f"{result['library']} (MPI {major}.{minor})")


def _gloo(run: _Run | None = None) -> Finding:
    folder = package_dir("torch")
    if folder is None:
        return Finding(
            "backends",
            "Gloo",
            False,
            f"{MISSING}: needs PyTorch's torch.distributed; "
            "install with: pip install 'hora[torch]'",
        )
    if run is not None and run.load:
        result, error = run.result("torch")
        if result is None:
            return _broken("backends", "Gloo", error)
        usable = bool(result.get("gloo"))
    else:  # PyTorch's Linux, macOS and Windows wheels build torch.distributed with Gloo
        usable = (folder / "distributed" / "__init__.py").is_file()
    if not usable:
        return Finding(
            "backends",
            "Gloo",
            False,
            "this PyTorch build has no Gloo; install the official wheel: pip install 'hora[torch]'",
        )
    return Finding("backends", "Gloo", True, "through torch.distributed")


def _cuda(run: _Run | None = None) -> tuple[dict[str, object] | None, list[str]]:
    """PyTorch's build ({"cuda": version or None, "nccl": ...}) and the GPUs it can use; from
    files and the driver, or from PyTorch itself under ``--load``. (None, []) without torch."""
    folder = package_dir("torch")
    if folder is None:
        return None, []
    if run is not None and run.load:
        result, error = run.result("torch")
        if result is None:
            raise RuntimeError(error)
        gpus = [str(g) for g in result.get("gpus", [])]  # type: ignore[attr-defined]
        return {"cuda": "yes" if gpus else None, **result}, gpus
    build: dict[str, object] = dict(torch_build(folder))
    if not build.get("cuda"):
        return build, []
    build["nccl"] = dist_version(*NCCL_DISTRIBUTIONS)
    return build, nvidia_gpus()


def _nccl(run: _Run | None = None) -> Finding:
    build, gpus = _cuda(run)
    if build is None:
        return Finding(
            "backends",
            "NCCL",
            False,
            f"{MISSING}: needs PyTorch built with CUDA; install with: pip install 'hora[torch]' "
            "(a CUDA build)",
        )
    if not gpus:
        return Finding(
            "backends",
            "NCCL",
            False,
            "no CUDA GPU visible to PyTorch (a CPU-only build, or no GPU/driver)",
        )
    if build.get("nccl_error"):
        return _broken("backends", "NCCL", str(build["nccl_error"]), "PyTorch has no usable NCCL")
    version = build.get("nccl")
    text = f"NCCL {version}" if version else f"NCCL (PyTorch's, built for CUDA {build['cuda']})"
    return Finding("backends", "NCCL", True, text)


def _ccl(run: _Run | None = None) -> Finding:
    return Finding(
        "backends", "CCL", False, "not built into hora (HOROVOD_CPU_OPERATIONS=ccl is refused)"
    )


def _tcp(run: _Run | None = None) -> Finding:
    return Finding("transports", "TCP", True, "native sockets (always available)")


def _shm(run: _Run | None = None) -> Finding:
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


def _gpus(run: _Run | None = None) -> Finding:
    build, gpus = _cuda(run)
    if build is None:
        return Finding(
            "devices",
            "GPUs",
            False,
            "none seen: PyTorch is not installed (pip install 'hora[torch]')",
        )
    if not gpus:
        return Finding("devices", "GPUs", False, "none seen by PyTorch; CPU only")
    return Finding("devices", "GPUs", True, f"{len(gpus)}: " + ", ".join(gpus))


PROBES: tuple[Callable[..., Finding], ...] = (
    _numpy, _torch, _tensorflow, _native, _mpi, _gloo, _nccl, _ccl, _tcp, _shm, _gpus,
)  # fmt: skip
_GROUPS = {
    "_numpy": ("frameworks", "NumPy"), "_torch": ("frameworks", "PyTorch"),
    "_tensorflow": ("frameworks", "TensorFlow"), "_native": ("backends", "native"),
    "_mpi": ("backends", "MPI"), "_gloo": ("backends", "Gloo"), "_nccl": ("backends", "NCCL"),
    "_ccl": ("backends", "CCL"), "_tcp": ("transports", "TCP"),
    "_shm": ("transports", "shared memory"), "_gpus": ("devices", "GPUs"),
}  # fmt: skip
_CHILD_CODE = {"mpi": (_MPI_PROBE, 60), "torch": (TORCH_LOAD, 120),
               "tensorflow": (TENSORFLOW_LOAD, 120)}  # fmt: skip


class _Run:
    """The child processes of one check: started together (so they overlap), each read once.
    ``load``: also import PyTorch and TensorFlow in children (``hora check --load``)."""

    def __init__(self, load: bool) -> None:
        self.load = load
        self._children: dict[str, subprocess.Popen[str] | BaseException] = {}
        self._results: dict[str, tuple[dict | None, str]] = {}

    def start_all(self) -> None:
        if _installed("mpi4py") and not _mpi_blocked():
            self._start("mpi")
        if self.load:
            for name in ("torch", "tensorflow"):
                if package_dir(name) is not None:
                    self._start(name)

    def _start(self, name: str) -> None:
        if name in self._children:
            return
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            self._children[name] = subprocess.Popen(
                [sys.executable, "-c", _CHILD_CODE[name][0]],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
                env=env,
            )
        except OSError as e:
            self._children[name] = e

    def result(self, name: str) -> tuple[dict | None, str]:
        """The child's JSON object, or (None, why there is none in one line)."""
        if name not in self._results:
            self._start(name)
            self._results[name] = self._read(name)
        return self._results[name]

    def _read(self, name: str) -> tuple[dict | None, str]:
        child = self._children[name]
        if isinstance(child, BaseException):
            return None, _one_line(child)
        try:
            out, err = child.communicate(timeout=_CHILD_CODE[name][1])
        except subprocess.TimeoutExpired as e:
            child.kill()
            child.communicate()
            return None, _one_line(e)
        lines = out.strip().splitlines()
        try:
            result = json.loads(lines[-1]) if lines else None
        except ValueError:
            result = None
        if isinstance(result, dict):
            return result, ""
        why = err.strip().splitlines()[-1:] or [f"the probe exited with {child.returncode}"]
        return None, why[0]

    def close(self) -> None:
        for child in self._children.values():
            if isinstance(child, subprocess.Popen) and child.poll() is None:
                child.kill()
                child.communicate()


def _safe(probe: Callable[..., Finding], run: _Run | None = None) -> Finding:
    """Run one probe; any error it raises becomes a not-loadable finding."""
    try:
        return probe(run)
    except Exception as e:
        group, name = _GROUPS.get(probe.__name__, ("other", probe.__name__.strip("_")))
        return _broken(group, name, e)


def findings(load: bool = False) -> list[Finding]:
    """Run every probe; never raises. The child processes (the MPI probe, and under ``load``
    PyTorch's and TensorFlow's imports) start first and run side by side."""
    run = _Run(load)
    try:
        run.start_all()
        return [_safe(probe, run) for probe in PROBES]
    finally:
        run.close()


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
    parser.add_argument(
        "--load",
        action="store_true",
        help="also import PyTorch and TensorFlow (in child processes) to prove they load; "
        "slower: seconds instead of under one",
    )


def command(args: argparse.Namespace) -> int:
    """Print the report; always 0 (a missing or broken part is a finding, not an error)."""
    print(report(findings(load=bool(getattr(args, "load", False)))))
    return 0
