"""Horovod scripts unchanged: `hora run --as-horovod` and HORA_AS_HOROVOD=1 make horovod.* names
resolve to hora's modules; without them nothing named horovod comes from hora, and a real
Horovod installation is never hidden."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SRC = str(ROOT / "src")
HORA = [sys.executable, "-c", "import sys; from hora.launch.cli import main; sys.exit(main())"]


def _env(**extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    return {**clean, "PYTHONPATH": SRC, **extra}


def _python(code: str, env: dict[str, str], python: str = sys.executable, cwd: Path | None = None):
    return subprocess.run(
        [python, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
        timeout=120, cwd=cwd,
    )  # fmt: skip


def _fake_horovod(tmp_path: Path) -> str:
    """A stand-in for a real Horovod installation: a `horovod` package of its own."""
    pkg = tmp_path / "site" / "horovod"
    (pkg / "torch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("REAL = True\n")
    (pkg / "torch" / "__init__.py").write_text("REAL = True\n")
    return str(tmp_path / "site")


def test_without_it_nothing_named_horovod_comes_from_hora() -> None:
    done = _python(
        """
        import hora, hora.torch, hora.common.util
        try:
            import horovod
        except ModuleNotFoundError as e:
            print("missing:", e.name)
        """,
        _env(),
    )
    assert done.stdout.strip() == "missing: horovod", done.stdout + done.stderr


def test_without_it_a_real_horovod_is_never_hidden(tmp_path) -> None:
    real = _fake_horovod(tmp_path)
    done = _python(
        """
        import hora, hora.torch
        import horovod, horovod.torch
        print(horovod.REAL, horovod.torch.REAL)
        """,
        _env(PYTHONPATH=os.pathsep.join([SRC, real])),
    )
    assert done.stdout.strip() == "True True", done.stdout + done.stderr


SCRIPT = """
import numpy as np
import horovod
import horovod.torch as hvd
import horovod.torch.mpi_ops as mpi_ops
from horovod.common.exceptions import HorovodInternalError
from horovod.common.process_sets import global_process_set
from horovod.common.util import gpu_available
from horovod.runner import run
import hora, hora.torch, hora.errors, hora.runner, hora.torch.mpi_ops
import torch

assert horovod is hora and hvd is hora.torch and mpi_ops is hora.torch.mpi_ops
assert HorovodInternalError is hora.errors.HorovodInternalError and run is hora.runner.run
hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
print("as-horovod", hvd.rank(), hvd.size(), float(total[0]), gpu_available("torch") in (0, 1))
"""


@pytest.mark.timeout(120)
def test_hora_run_as_horovod_runs_a_horovod_script_unchanged(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    real = _fake_horovod(tmp_path)  # asked for: hora's modules even where Horovod is installed
    env = _env(PYTHONPATH=os.pathsep.join([SRC, real]))
    done = subprocess.run(
        [*HORA, "run", "-np", "2", "--as-horovod", sys.executable, str(script)],
        capture_output=True, text=True, env=env, timeout=110, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(ln for ln in done.stdout.splitlines() if "as-horovod" in ln)
    assert [ln.split(":", 1)[1] for ln in lines] == [
        "as-horovod 0 2 3.0 True",
        "as-horovod 1 2 3.0 True",
    ]
    plain = subprocess.run(
        [*HORA, "run", "-np", "1", sys.executable, str(script)],
        capture_output=True, text=True, env=_env(), timeout=110, cwd=tmp_path,
    )  # fmt: skip
    assert plain.returncode != 0 and "No module named 'horovod'" in plain.stdout + plain.stderr


def test_every_horovod_name_hora_has_resolves_and_others_do_not() -> None:
    done = _python(
        """
        import importlib, importlib.util
        from hora import as_horovod
        as_horovod.install()
        for name in ("tensorflow", "keras", "spark", "ray", "mxnet", "torch.elastic"):
            has = importlib.util.find_spec("hora." + name) is not None
            try:
                module = importlib.import_module("horovod." + name)
                got = module is importlib.import_module("hora." + name)
            except ModuleNotFoundError:
                got = False
            print(name, has == got)
        as_horovod.uninstall()
        try:
            import horovod
            print("still there")
        except ModuleNotFoundError:
            print("off again")
        """,
        _env(),
    )
    lines = done.stdout.split()
    assert done.returncode == 0, done.stderr
    assert lines[-2:] == ["off", "again"] and lines.count("True") == 6, done.stdout


@pytest.mark.timeout(300)
def test_environment_variable_in_processes_hora_run_does_not_start(tmp_path) -> None:
    """An installed hora reads HORA_AS_HOROVOD at interpreter start (hora-as-horovod.pth), so a
    Spark or Ray worker's `import horovod.torch` gives hora's; without it nothing changes."""
    target = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(target)
    python = str(target / "bin" / "python")
    # torch and numpy from this interpreter's environment, after the venv's own packages (a
    # plain path: the .pth files there, such as the checkout's editable hora, are not read)
    own = sysconfig.get_path("purelib", vars={"base": str(target), "platbase": str(target)})
    (Path(own) / "deps-of-the-test.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    copy = tmp_path / "hora-src"  # what a source distribution holds, without the checkout
    copy.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "src"):
        subprocess.run(["cp", "-r", str(ROOT / name), str(copy / name)], check=True)
    # Built as a user's `pip install` builds it: in an isolated environment holding what
    # pyproject.toml's [build-system] asks for. The base interpreter's own setuptools (old, and
    # without `wheel`, on a stock pyenv Python 3.11) must play no part.
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
         str(copy)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    if done.returncode != 0 and "no such option: --python" in done.stderr:
        pytest.skip("this pip cannot install into another interpreter")
    assert done.returncode == 0, done.stderr
    env = {k: v for k, v in _env().items() if k != "PYTHONPATH"}
    code = "import horovod.torch as hvd, hora.torch; print(hvd is hora.torch)"
    on = _python(code, {**env, "HORA_AS_HOROVOD": "1"}, python, cwd=tmp_path)
    assert on.stdout.strip() == "True", on.stdout + on.stderr
    off = _python(code, env, python, cwd=tmp_path)
    assert "No module named 'horovod'" in off.stderr
