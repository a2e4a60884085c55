"""The hardware and software environment of a benchmark, collected from the machine itself.

:func:`collect` describes the host it runs on (CPU, memory and one core's copy speed, GPUs and
how they are connected, NICs with their speed, RDMA devices, OS, kernel, GPU driver, Python,
torch, CUDA, NCCL, MPI, hora) as a flat ``key -> text`` dict, JSON-ready;
:mod:`hora.lab.scaling` runs it on every server of a run through the launcher.
:func:`environment_table` turns one such dict per server into the table the scaling lab asks
for. Sources: ``/proc``, ``/sys/class/net``, ``/sys/class/infiniband``, ``/etc/os-release``,
``nvidia-smi`` (GPUs, ``topo -m``), ``lspci`` and ``mpirun --version`` when present (each
command with a timeout), package metadata, and timed 64 MiB copies.
Anything unreadable reads "unknown" or "none", never an error.

Pure functions apart from reading the system; thread-safe.
"""

from __future__ import annotations

import os
import platform
import re
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import numpy as np

# (section, label, key); "servers" is filled in by environment_table
ROWS: list[tuple[str, str, str]] = [
    ("hardware", "servers", "servers"),
    ("hardware", "host name", "host"),
    ("hardware", "CPU model", "cpu"),
    ("hardware", "CPU cores", "cores"),
    ("hardware", "memory", "memory"),
    ("hardware", "memory copy, one core", "copy_speed"),
    ("hardware", "GPU model and count", "gpu"),
    ("hardware", "GPU interconnect", "gpu_interconnect"),
    ("hardware", "NICs (model, speed)", "nics"),
    ("hardware", "RDMA devices", "rdma"),
    ("software", "OS", "os"),
    ("software", "kernel", "kernel"),
    ("software", "GPU driver", "gpu_driver"),
    ("software", "Python", "python"),
    ("software", "framework", "framework"),
    ("software", "CUDA", "cuda"),
    ("software", "NCCL", "nccl"),
    ("software", "MPI", "mpi"),
    ("software", "hora", "hora"),
]

# nvidia-smi topo -m link codes
_LINKS = {
    "PIX": "PCIe, one switch",
    "PXB": "PCIe, several switches",
    "PHB": "PCIe host bridge",
    "NODE": "PCIe and the links inside one NUMA node",
    "SYS": "PCIe and the inter-socket link",
}


def _command(argv: Sequence[str], timeout: float = 10.0) -> str | None:
    """stdout of ``argv``, or None when it is missing, fails or takes too long."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text(errors="replace").strip()
    except OSError:
        return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _core_id(block: str) -> str | None:
    """``"socket/core"`` of one /proc/cpuinfo processor block, None without a core id."""
    core = re.search(r"^core id\s*:\s*(\d+)", block, re.M)
    socket_id = re.search(r"^physical id\s*:\s*(\d+)", block, re.M)
    if core is None:
        return None
    return f"{socket_id.group(1) if socket_id else 0}/{core.group(1)}"


def cpu() -> tuple[str, str]:
    """(model name, "N logical / M physical cores[, K usable]")."""
    info = _read("/proc/cpuinfo") or ""
    models = re.findall(r"^model name\s*:\s*(.+)$", info, re.M)
    cores = {_core_id(block) for block in info.split("\n\n")} - {None}
    logical = os.cpu_count() or len(models)
    text = f"{logical} logical"
    if cores:
        text += f" / {len(cores)} physical"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    if usable != logical:
        text += f", {usable} usable here"
    return (models[0] if models else platform.processor() or "unknown"), text


def memory() -> str:
    found = re.search(r"^MemTotal:\s*(\d+) kB", _read("/proc/meminfo") or "", re.M)
    return f"{int(found.group(1)) / 2**20:.1f} GiB" if found else "unknown"


def copy_speed(nbytes: int = 64 << 20, rounds: int = 5) -> str:
    """One core's memory copy speed at this moment, e.g. ``"10.4 GB/s"``: the best of ``rounds``
    copies of ``nbytes``. Shared virtual machines can be half as fast one hour as the next; this
    says which kind of hour a run had, so figures from two runs can be told apart."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault in both buffers' pages before timing
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return f"{nbytes / best / 1e9:.1f} GB/s"


def gpus() -> tuple[str, str, str]:
    """(models and count, driver version, interconnect summary) from nvidia-smi."""
    out = _command(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    )
    rows = [[c.strip() for c in line.split(",")] for line in (out or "").splitlines() if line]
    if not rows:
        return "none", "none (no NVIDIA GPU)", "none"
    names = Counter(f"{r[0]} ({r[2]})" if len(r) > 2 else r[0] for r in rows)
    model = ", ".join(f"{n} x {name}" for name, n in names.items())
    driver = rows[0][1] if len(rows[0]) > 1 else "unknown"
    return model, driver, interconnect(_command(["nvidia-smi", "topo", "-m"]) or "")


def _link_name(code: str) -> str:
    return f"NVLink, {code[2:]} links" if code.startswith("NV") else _LINKS.get(code, code)


def interconnect(topo: str) -> str:
    """Summarise ``nvidia-smi topo -m``: each GPU-to-GPU link type and how many pairs use it."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in topo.splitlines()]
    header = next((ln.split() for ln in lines if ln[:1].isspace() and "GPU0" in ln.split()), None)
    if header is None:
        return "unknown (nvidia-smi topo -m gave no matrix)"
    count = sum(1 for name in header if re.fullmatch(r"GPU\d+", name))
    pairs: Counter[str] = Counter()
    for line in lines:
        cells = line.split()
        row = re.fullmatch(r"GPU(\d+)", cells[0]) if cells and not line[:1].isspace() else None
        if row is None:
            continue
        for col in range(int(row.group(1)) + 1, min(count, len(cells) - 1)):
            pairs[cells[col + 1]] += 1
    if not pairs:
        return "one GPU (no GPU-to-GPU link)"
    return ", ".join(
        f"{code} ({_link_name(code)}): {n} pair{'s' if n > 1 else ''}"
        for code, n in pairs.most_common()
    )


def _nic(name: str) -> str:
    base = Path("/sys/class/net") / name
    driver = os.path.basename(os.path.realpath(base / "device" / "driver"))
    device = Path(os.path.realpath(base / "device"))
    pci = next((p.name for p in (device, device.parent) if re.fullmatch(r"[\da-f:.]+", p.name)), "")
    model = None
    if pci:
        listed = _command(["lspci", "-s", pci])
        model = listed.split(": ", 1)[1].strip() if listed and ": " in listed else None
    if model is None:
        ids = [_read(device / f) for f in ("vendor", "device")]
        model = f"{driver} {ids[0]}:{ids[1]}" if all(ids) else driver
    rate = _speed(base) or "speed unknown"
    return f"{name}: {model}, {rate}, {_read(base / 'operstate') or 'state unknown'}"


def _speed(base: Path) -> str | None:
    """``"10 Gb/s"`` from ``base/speed``; None when unknown (-1, unreadable)."""
    speed = _read(base / "speed")
    mbits = int(speed) if speed and speed.lstrip("-").isdigit() else -1
    return f"{mbits / 1000:g} Gb/s" if mbits > 0 else None


def _virtual(base: Path) -> str:
    speed = _speed(base)
    return f"{base.name} {speed}" if speed else base.name


def nics() -> str:
    """Interfaces backed by a device, with model and speed; virtual ones only counted."""
    root = Path("/sys/class/net")
    names = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    real = [n for n in names if (root / n / "device").exists()]
    virtual = [n for n in names if n not in real and n != "lo"]
    parts = [_nic(n) for n in real] or ["none with a device"]
    if virtual:
        parts.append(f"{len(virtual)} virtual ({', '.join(_virtual(root / n) for n in virtual)})")
    return "; ".join(parts)


def rdma() -> str:
    root = Path("/sys/class/infiniband")
    if not root.is_dir():
        return "none"
    found = []
    for dev in sorted(root.iterdir()):
        rate = _read(dev / "ports" / "1" / "rate")
        found.append(f"{dev.name} ({rate})" if rate else dev.name)
    return ", ".join(found) or "none"


def os_name() -> str:
    found = re.search(r'^PRETTY_NAME="?([^"\n]+)"?', _read("/etc/os-release") or "", re.M)
    return found.group(1) if found else platform.platform()


def torch_stack() -> tuple[str, str, str]:
    """(framework, CUDA, NCCL) as torch sees them."""
    try:
        import torch
    except ImportError:
        return "none (torch is not installed)", "unknown", "unknown"
    cuda = torch.version.cuda
    if cuda is None:
        return f"torch {torch.__version__}", "none (CPU build of torch)", "none (no CUDA)"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__}", cuda, "not loaded (no usable GPU)"
    nccl = torch.cuda.nccl.version()
    text = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return f"torch {torch.__version__}", cuda, text


def mpi() -> str:
    out = _command(["mpirun", "--version"])
    first = out.strip().splitlines()[0] if out and out.strip() else None
    mpi4py = _version("mpi4py")
    text = first or "none (no mpirun on PATH)"
    return f"{text}, mpi4py {mpi4py}" if mpi4py else text


def hora_version() -> str:
    text = _version("hora") or "unknown"
    commit = _command(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"], 5)
    return f"{text} (commit {commit.strip()})" if commit else text


def collect() -> dict[str, str]:
    """This host's environment, keyed as in :data:`ROWS` (no ``servers``)."""
    cpu_model, cores = cpu()
    gpu, driver, links = gpus()
    framework, cuda, nccl = torch_stack()
    return {
        "host": socket.gethostname(),
        "cpu": cpu_model,
        "cores": cores,
        "memory": memory(),
        "copy_speed": copy_speed(),
        "gpu": gpu,
        "gpu_interconnect": links,
        "nics": nics(),
        "rdma": rdma(),
        "os": os_name(),
        "kernel": f"Linux {platform.release()}"
        if platform.system() == "Linux"
        else platform.release(),
        "gpu_driver": driver,
        "python": platform.python_version(),
        "framework": framework,
        "cuda": cuda,
        "nccl": nccl,
        "mpi": mpi(),
        "hora": hora_version(),
    }


def environment_table(hosts: Sequence[dict[str, str]]) -> tuple[list[str], list[list[str]]]:
    """(headers, body): one row per item of :data:`ROWS`, one value column per server (named
    by its ``server`` entry, the name the run was given, else its host name)."""
    if not hosts:
        raise ValueError("no environment to show: give at least one host's collect() result")
    names = [h.get("server", h.get("host", "?")) for h in hosts]
    headers = ["", "item", *(["value"] if len(hosts) == 1 else names)]
    body = []
    for i, (section, label, key) in enumerate(ROWS):
        first = i == 0 or ROWS[i - 1][0] != section
        values = [str(len(hosts))] if key == "servers" else [h.get(key, "unknown") for h in hosts]
        if key == "servers" and len(hosts) > 1:
            values += [""] * (len(hosts) - 1)
        body.append([section if first else "", label, *values])
    return headers, body
