"""What ``hora check`` learns without importing a framework: package folders, versions from
the installed metadata, PyTorch's build (its ``version.py``, read as text), NVIDIA GPUs from the
driver (``/proc/driver/nvidia``, else ``nvidia-smi -L``), and the child-process scripts that
``hora check --load`` runs to import PyTorch and TensorFlow for real.

Runs in the process that calls it, reads files only, and imports neither torch, TensorFlow, Ray
nor PySpark: importing them takes seconds, which is why the plain check answers from files.
Thread-safe (no shared state).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

# Distribution names that install the `tensorflow` package, in the order they are tried.
TF_DISTRIBUTIONS = (
    "tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel", "tensorflow-macos",
    "tf-nightly", "tf-nightly-cpu",
)  # fmt: skip
NCCL_DISTRIBUTIONS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")


def package_dir(name: str) -> Path | None:
    """The folder of top-level package ``name`` as the import system would find it (nothing
    is imported), or None when it is not installed."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    places = list(spec.submodule_search_locations or [])
    if places:
        return Path(places[0])
    return Path(spec.origin).parent if spec.origin else None


def dist_version(*names: str) -> str | None:
    """The version of the first of ``names`` whose metadata is installed."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def has_extension(folder: Path, stem: str) -> bool:
    """Whether ``folder`` holds the compiled module ``stem`` (``_C.cpython-311-...so``)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(n.startswith(stem + ".") and n.endswith((".so", ".pyd")) for n in names)


def torch_build(folder: Path) -> dict[str, str | None]:
    """``__version__`` and ``cuda`` from PyTorch's ``version.py``, read as text (``cuda`` is
    None for a CPU-only build); empty when the file cannot be read."""
    try:
        text = (folder / "version.py").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    out: dict[str, str | None] = {}
    for key in ("__version__", "cuda"):
        found = re.search(rf"^{key}\b[^=\n]*=\s*(?:'([^']*)'|\"([^\"]*)\"|None)", text, re.M)
        if found:
            out[key] = found.group(1) or found.group(2)  # None for `= None`
    return out


def nvidia_gpus(proc: Path = Path("/proc/driver/nvidia/gpus")) -> list[str]:
    """The NVIDIA GPUs the driver knows, by model name: from ``/proc/driver/nvidia/gpus``, or
    from ``nvidia-smi -L`` where that folder is absent. Empty without a driver."""
    if proc.is_dir():
        names = []
        for entry in sorted(proc.iterdir()):
            try:
                info = (entry / "information").read_text(errors="replace")
            except OSError:
                continue
            model = re.search(r"^Model:\s*(.+)$", info, re.M)
            names.append(model.group(1).strip() if model else entry.name)
        return names
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = re.findall(r"^GPU \d+:\s*(.+?)(?:\s+\(UUID:.*)?$", done.stdout, re.M)
    return [name.strip() for name in found] if done.returncode == 0 else []


# `hora check --load`: each runs in a child process and prints one JSON object on its last
# line; a child that cannot import its framework exits non-zero with the error on stderr.
TORCH_LOAD = """
import json, torch
out = {"version": torch.__version__, "gloo": False, "gpus": [], "nccl": None}
try:
    import torch.distributed as dist
    out["gloo"] = bool(dist.is_available() and dist.is_gloo_available())
except Exception:
    pass
if torch.cuda.is_available():
    n = torch.cuda.device_count()
    out["gpus"] = [torch.cuda.get_device_name(i) for i in range(n)]
    try:
        v = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:
        out["nccl_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""

TENSORFLOW_LOAD = """
import json, os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf, hora.tensorflow
print(json.dumps({"version": tf.__version__}))
"""
