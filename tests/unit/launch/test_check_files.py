"""`hora check` answers from files: it imports no framework into the checking process, and
what it reads (PyTorch's build, the NVIDIA driver's GPU list) gives the same report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from hora.launch import check, check_files

SRC = str(Path(__file__).parents[3] / "src")
HEAVY = ("torch", "tensorflow", "ray", "pyspark", "keras", "tf_keras", "mpi4py.MPI")


def test_check_imports_no_framework_into_the_checking_process() -> None:
    code = (
        "import json, sys\n"
        "from hora.launch import check\n"
        "text = check.report(check.findings())\n"
        f"heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
        "print(json.dumps({'text': text, 'heavy': heavy}))\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["heavy"] == []
    text = out["text"]
    for group in ("frameworks:", "backends:", "transports:", "devices:"):
        assert group in text
    # the versions it reports without importing are those the installed packages carry
    for dist, label in (("torch", "PyTorch"), ("tensorflow", "TensorFlow")):
        line = next(ln for ln in text.splitlines() if f"{label}:" in ln)
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            assert "[ ]" in line
            continue
        assert "[X]" in line and f"{dist} {version}" in line


def _fake_torch(root: Path, cuda: str | None) -> Path:
    folder = root / "torch"
    (folder / "distributed").mkdir(parents=True)
    (folder / "__init__.py").write_text("raise ImportError('the check must not import me')\n")
    (folder / "distributed" / "__init__.py").write_text("")
    (folder / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    cuda_text = repr(cuda) if cuda else "None"
    (folder / "version.py").write_text(
        "from typing import Optional\n"
        "__version__ = '9.8.7+fake'\n"
        f"cuda: Optional[str] = {cuda_text}\n"
    )
    return folder


def test_torch_build_is_read_from_version_py(tmp_path) -> None:
    assert check_files.torch_build(_fake_torch(tmp_path / "a", "12.8")) == {
        "__version__": "9.8.7+fake",
        "cuda": "12.8",
    }
    assert check_files.torch_build(_fake_torch(tmp_path / "b", None))["cuda"] is None


def test_gpus_are_read_from_the_driver(tmp_path) -> None:
    proc = tmp_path / "gpus"
    for bus, model in (("0000:17:00.0", "NVIDIA H100 80GB HBM3"), ("0000:65:00.0", "NVIDIA L4")):
        (proc / bus).mkdir(parents=True)
        (proc / bus / "information").write_text(f"Model: \t\t {model}\nIRQ:   42\n")
    assert check_files.nvidia_gpus(proc) == ["NVIDIA H100 80GB HBM3", "NVIDIA L4"]


@pytest.mark.parametrize("cuda", [None, "12.8"])
def test_a_cuda_build_with_gpus_reports_nccl_and_the_gpus(tmp_path, monkeypatch, cuda) -> None:
    _fake_torch(tmp_path, cuda)  # its __init__ raises: the findings below prove it unimported
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # found on sys.path, not here
    monkeypatch.setattr(check, "nvidia_gpus", lambda: ["NVIDIA L4", "NVIDIA L4"])
    monkeypatch.setattr(check, "dist_version", lambda *names: "2.27.5" if names else None)
    items = {i.name: i for i in check.findings()}
    assert items["PyTorch"].detail == "torch 9.8.7+fake"
    assert items["Gloo"].available
    if cuda is None:  # a CPU-only build cannot use the GPUs, whatever the driver sees
        assert not items["NCCL"].available and "CPU-only build" in items["NCCL"].detail
        assert not items["GPUs"].available
    else:
        assert items["NCCL"].available and items["NCCL"].detail == "NCCL 2.27.5"
        assert items["GPUs"].detail == "2: NVIDIA L4, NVIDIA L4"
