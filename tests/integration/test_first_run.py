"""The README's two commands on a stock machine: scripts/install.sh (through scripts/venv.sh)
installs into a project virtual environment, never into a python3 that refuses pip installs.

A "stock" python3 is made here for real: this interpreter's binary copied into a folder whose
lib/ holds links to its standard library, no pip, and an EXTERNALLY-MANAGED marker (PEP 668),
as Debian 12 and Ubuntu 24.04 ship it; it goes first on PATH. The scripts run in bash child
processes with HORA_INSTALL_DRY_RUN=1 (they print the apt-get and pip commands instead of
running them, but make the virtual environment for real). One test runs a real install into
a virtual environment that sees this interpreter's packages, where nothing is downloaded; it
skips where that would download. Each script run takes seconds (a venv with pip: about 5 s).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = Path(sys.base_prefix)
STDLIB = Path(sysconfig.get_path("stdlib"))
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
ENV_CHOICES = ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHON", "HORA_NO_VENV", "HORA_VENV",
               "HORA_VENV_SYSTEM_SITE", "HORA_TORCH_INDEX_URL", "HORA_INSTALL_DRY_RUN",
               "PIP_BREAK_SYSTEM_PACKAGES", "_HORA_PY_CHOSEN")  # fmt: skip


def _base_python() -> Path:
    """The interpreter this one was made from (this one when it is not in a venv)."""
    for name in (f"python{sys.version_info[0]}.{sys.version_info[1]}", "python3"):
        found = BASE / "bin" / name
        if found.exists():
            return Path(os.path.realpath(found))
    pytest.skip(f"no python3 under {BASE}/bin")


def _stock_python(root: Path, ensurepip: bool = True) -> Path:
    """A python3 with no pip whose stdlib carries EXTERNALLY-MANAGED; returns its bin/."""
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (root / "bin").mkdir(parents=True)
    lib = root / "lib" / version
    (lib / "site-packages").mkdir(parents=True)
    shutil.copy2(_base_python(), root / "bin" / "python3")
    for entry in STDLIB.iterdir():
        if entry.name in ("site-packages", "dist-packages", "EXTERNALLY-MANAGED"):
            continue
        if entry.name == "ensurepip" and not ensurepip:
            continue
        (lib / entry.name).symlink_to(entry)
    (lib / "EXTERNALLY-MANAGED").write_text(
        "[externally-managed]\nError=this python3 is managed by the system's packages\n"
    )
    probe = subprocess.run(
        [str(root / "bin" / "python3"), "-c",
         "import sys; print(sys.prefix == sys.base_prefix); import pip"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if not probe.stdout.startswith("True") or "No module named 'pip'" not in probe.stderr:
        pytest.skip(f"this interpreter cannot be copied into a stand-alone one: {probe.stderr}")
    return root / "bin"


def _env(first_on_path: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_CHOICES}
    active = os.environ.get("VIRTUAL_ENV")
    parts = [p for p in env.get("PATH", "").split(os.pathsep)
             if p and not (active and p.startswith(active))]  # fmt: skip
    if first_on_path is not None:
        parts.insert(0, str(first_on_path))
    env["PATH"] = os.pathsep.join(parts)
    return {**env, **extra}


def _install(
    env: dict[str, str], *args: str, script: str = "install.sh"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / script), *args],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )  # fmt: skip


def _commands(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln[2:] for ln in done.stdout.splitlines() if ln.startswith("+ ")]


def _no_nvidia() -> bool:
    return shutil.which("nvidia-smi") is None and not Path("/proc/driver/nvidia").exists()


def test_a_managed_python_gets_a_project_venv_and_no_pip_install(tmp_path) -> None:
    stock = _stock_python(tmp_path / "stock")
    venv = tmp_path / "venv"
    env = _env(stock, HORA_VENV=str(venv), HORA_INSTALL_DRY_RUN="1")
    done = _install(env)
    assert done.returncode == 0, done.stderr
    cfg = (venv / "pyvenv.cfg").read_text()
    assert f"home = {stock}" in cfg
    assert "include-system-site-packages = false" in cfg  # isolated from a managed python3
    pips = [c for c in _commands(done) if " -m pip " in c]
    assert len(pips) == 2, done.stdout  # torch, then hora with the main job's extra
    assert all(c.startswith(f"{venv}/bin/python") for c in pips), pips
    assert not any(str(stock) in c for c in _commands(done))
    assert pips[0].endswith("torch==2.13.0") and pips[1].endswith("-e .[torch]")
    if _no_nvidia():  # no GPU: torch's CPU wheels
        assert f"--index-url {CPU_INDEX}" in pips[0]
    assert f"source {venv}/bin/activate" in done.stderr  # says where it is and how to use it
    has_pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--version"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert has_pip.returncode == 0, has_pip.stderr

    # again: the same environment is used, not made anew
    before = (venv / "pyvenv.cfg").stat().st_mtime_ns
    again = _install(env, "--all")
    assert again.returncode == 0, again.stderr
    assert "made earlier" in again.stderr
    assert (venv / "pyvenv.cfg").stat().st_mtime_ns == before
    extras = [c for c in _commands(again) if c.endswith("]")][-1]
    assert extras.startswith(f"{venv}/bin/python") and "tensorflow" in extras and "ray" in extras


def test_opting_out_on_a_managed_python_is_refused_with_what_to_do(tmp_path) -> None:
    stock = _stock_python(tmp_path / "stock")
    venv = tmp_path / "venv"
    env = _env(stock, HORA_VENV=str(venv), HORA_INSTALL_DRY_RUN="1", HORA_NO_VENV="1")
    done = _install(env)
    assert done.returncode != 0
    assert "externally managed" in done.stderr and "Unset HORA_NO_VENV" in done.stderr
    assert not venv.exists() and not _commands(done)


def test_an_active_environment_or_python_is_used_as_it_is(tmp_path) -> None:
    active = tmp_path / "active"
    subprocess.run([str(_base_python()), "-m", "venv", "--without-pip", str(active)],
                   check=True, timeout=120)  # fmt: skip
    unused = tmp_path / "unused"
    env = _env(active / "bin", VIRTUAL_ENV=str(active), HORA_VENV=str(unused),
               HORA_INSTALL_DRY_RUN="1")  # fmt: skip
    done = _install(env)
    assert done.returncode == 0, done.stderr
    pips = [c for c in _commands(done) if " -m pip " in c]
    assert pips and all(c.startswith(f"{active}/bin/python3 ") for c in pips), pips
    assert not unused.exists()

    chosen = tmp_path / "chosen" / "python"
    done = _install(_env(PYTHON=str(chosen), HORA_VENV=str(unused), HORA_INSTALL_DRY_RUN="1"))
    assert done.returncode == 0, done.stderr
    pips = [c for c in _commands(done) if " -m pip " in c]
    assert pips and all(c.startswith(f"{chosen} ") for c in pips), pips
    assert not unused.exists()


def test_a_python_without_ensurepip_gets_python3_venv_or_says_how(tmp_path) -> None:
    stock = _stock_python(tmp_path / "stock", ensurepip=False)
    venv = tmp_path / "venv"
    done = _install(_env(stock, HORA_VENV=str(venv), HORA_INSTALL_DRY_RUN="1"))
    if os.geteuid() == 0 and shutil.which("apt-get"):
        assert done.returncode == 0, done.stderr
        apt = [c for c in _commands(done) if "apt-get install" in c]
        assert apt and "python3-venv" in apt[0], done.stdout
        assert not venv.exists()
    else:
        assert done.returncode != 0
        assert "apt-get install python3-venv" in done.stderr


def test_a_real_install_into_a_venv_that_sees_this_pythons_packages(tmp_path) -> None:
    """The CI path on a provisioned interpreter: a venv made with --system-site-packages and
    `pip install -e .[torch]` into it, for real. Skips where that would download torch."""
    base = _base_python()
    ready = subprocess.run(
        [str(base), "-c", "import importlib.metadata as m, sklearn, numpy, yaml, cloudpickle;"
         "print(m.version('torch'))"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if ready.returncode != 0 or not ready.stdout.startswith("2.13.0"):
        pytest.skip(f"{base} lacks torch 2.13.0 or scikit-learn: the install would download")
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "python3").symlink_to(base)
    venv = tmp_path / "venv"
    done = _install(_env(shim, HORA_VENV=str(venv), HORA_VENV_SYSTEM_SITE="1"))
    assert done.returncode == 0, done.stderr
    assert "torch 2.13.0" in done.stderr and "installed already" in done.stderr
    assert list((venv / "lib").glob("python3*/site-packages/hora-*.dist-info"))
    check = subprocess.run([str(venv / "bin" / "hora"), "check"], capture_output=True,
                           text=True, timeout=120, env=_env())  # fmt: skip
    assert check.returncode == 0, check.stderr
    assert f"({venv}/bin/python" in check.stdout.splitlines()[0]
    assert "[X] PyTorch: torch 2.13.0" in check.stdout


def test_the_two_commands_use_one_project_venv(tmp_path) -> None:
    """train.sh and test.sh (CI's path) pick the environment once, install into it (the main
    job only what it needs, the tests every extra) and run with its interpreter."""
    stock = _stock_python(tmp_path / "stock")
    venv = tmp_path / "venv"
    env = _env(stock, HORA_VENV=str(venv), HORA_INSTALL_DRY_RUN="1")
    train = _install(env, "--epochs", "2", script="train.sh")
    assert train.returncode == 0, train.stderr
    commands = _commands(train)
    assert commands[-1] == f"hora run -np 2 {venv}/bin/python examples/pytorch_mnist.py --epochs 2"
    extras = [c for c in commands if " -e ." in c]
    assert extras == [f"{venv}/bin/python -m pip install -q -e .[torch]"], commands
    assert train.stderr.count("making the project's virtual environment") == 1
    assert f"source {venv}/bin/activate" in train.stderr

    test = _install(env, "-x", script="test.sh")
    assert test.returncode == 0, test.stderr
    commands = _commands(test)
    assert "made earlier" in test.stderr
    assert all(c.startswith(f"{venv}/bin/python ") for c in commands if " -m " in c), commands
    extras = next(c for c in commands if " -e ." in c)
    for extra in ("torch", "tensorflow", "dev", "spark", "ray"):
        assert extra in extras.split("[")[1]
    assert commands[-1] == f"{venv}/bin/python -m pytest -rs --durations=20 -n 2 --dist loadfile -x"


def test_a_venv_made_earlier_without_pip_is_kept_and_given_pip(tmp_path) -> None:
    stock = _stock_python(tmp_path / "stock")
    venv = tmp_path / "venv"
    subprocess.run([str(stock / "python3"), "-m", "venv", "--without-pip", str(venv)],
                   check=True, timeout=120)  # fmt: skip
    mine = venv / "kept.txt"  # something of the user's in it
    mine.write_text("mine")
    done = _install(_env(stock, HORA_VENV=str(venv), HORA_INSTALL_DRY_RUN="1"))
    assert done.returncode == 0, done.stderr
    assert mine.read_text() == "mine" and "has no pip: adding it" in done.stderr
    pips = [c for c in _commands(done) if " -m pip " in c]
    assert pips and all(c.startswith(f"{venv}/bin/python ") for c in pips), pips
    has_pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--version"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert has_pip.returncode == 0, has_pip.stderr


def test_hora_builds_with_what_the_project_asks_for_not_the_interpreters_setuptools(
    tmp_path,
) -> None:
    """The README commands' step that installs hora itself (`pip install -e .[...]`, taken from
    scripts/install.sh's dry run), run for real into an environment as a stock interpreter
    makes it: setuptools old (Python 3.11's ensurepip gives 65.5, which cannot build a wheel
    without the `wheel` package) or absent (3.12 on), and no `wheel`. The build must take what
    pyproject.toml's [build-system] asks for, not what the interpreter happens to have."""
    target = tmp_path / "bare"
    subprocess.run([str(_base_python()), "-m", "venv", str(target)], check=True, timeout=180)
    python = str(target / "bin" / "python")
    tools = subprocess.run(
        [python, "-c", "import importlib.metadata as m\n"
         "for name in ('setuptools', 'wheel'):\n"
         "    try: print(name, m.version(name))\n"
         "    except m.PackageNotFoundError: print(name, '-')"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    found = dict(ln.split() for ln in tools.stdout.splitlines())
    assert found["wheel"] == "-", tools.stdout
    setuptools = found["setuptools"]
    assert setuptools == "-" or tuple(map(int, setuptools.split(".")[:2])) < (70, 1), (
        f"this interpreter's venv brings setuptools {setuptools}, which builds wheels by itself:"
        " the test needs one that cannot"
    )

    plan = _install(_env(PYTHON=python, HORA_INSTALL_DRY_RUN="1"))
    assert plan.returncode == 0, plan.stderr
    step = next(c for c in _commands(plan) if " -e ." in c)
    assert step.startswith(f"{python} -m pip install "), step
    # hora alone: its dependencies are other packages' business (and would download torch)
    done = subprocess.run([*step.split(), "--no-deps"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=_env())  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    where = subprocess.run(
        [python, "-c", "from importlib.util import find_spec as f\n"
         "print(f('hora').origin, f('hora_torch_plugin') is not None)"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert where.returncode == 0, where.stderr
    assert where.stdout.split() == [str(ROOT / "src" / "hora" / "__init__.py"), "True"]
