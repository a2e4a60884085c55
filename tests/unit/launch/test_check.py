"""hora check reports every group and says how to get what is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hora.launch import check


def test_findings_cover_every_group() -> None:
    items = check.findings()
    names = {i.name for i in items}
    assert {"PyTorch", "native", "MPI", "Gloo", "NCCL", "TCP", "shared memory", "GPUs"} <= names
    native = next(i for i in items if i.name == "native")
    assert native.available


def test_missing_things_name_an_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)  # makes the import fail
    item = check._mpi()
    assert not item.available and "hora[mpi]" in item.detail
    assert "\x00" not in check.report(check.findings())


def test_report_text() -> None:
    text = check.report(check.findings())
    for group in ("frameworks:", "backends:", "transports:", "devices:"):
        assert group in text


def _run_check(argv: list[str], extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    src = str(Path(__file__).parents[3] / "src")
    path = os.pathsep.join(p for p in (extra_env.pop("PREPEND", ""), src) if p)
    env = {**os.environ, **extra_env, "PYTHONPATH": path}
    code = "import sys; from hora.launch.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.parametrize("argv", [["check"], ["run", "-cb"]])
def test_an_mpi_library_that_cannot_be_loaded_is_a_finding_not_a_crash(argv) -> None:
    done = _run_check(argv, {"MPI4PY_LIBMPI": "libmpi_missing_here.so.40"})
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    line = next(ln for ln in done.stdout.splitlines() if "MPI:" in ln)
    assert "[!]" in line and "installed but not loadable" in line
    assert "libmpi_missing_here.so.40" in line


def test_a_framework_that_cannot_be_loaded_is_reported_in_one_line(tmp_path) -> None:
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise OSError('libtorch_cpu.so: cannot open shared object file: No such file')\n"
    )
    # the plain check reads files: a torch package without its compiled core is not loadable
    done = _run_check(["check"], {"PREPEND": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    line = next(ln for ln in done.stdout.splitlines() if "PyTorch:" in ln)
    assert "[!]" in line and "torch/_C" in line and str(fake) in line
    # --load imports it in a child process and reports the import's own error
    (fake / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    done = _run_check(["check", "--load"], {"PREPEND": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    line = next(ln for ln in done.stdout.splitlines() if "PyTorch:" in ln)
    assert "[!]" in line and "libtorch_cpu.so" in line


def test_every_finding_has_one_of_three_states() -> None:
    for item in check.findings():
        assert item.state in (check.AVAILABLE, check.MISSING, check.BROKEN)
        assert item.available == (item.state == check.AVAILABLE)
        assert "\n" not in item.detail
