"""hora over the MPI backend under a real ``mpirun``: the conformance battery at np 2 (plain
mpirun, hora's store bootstrapped over MPI), process sets and flags at np 3, ``hora run --mpi``,
``init(comm=...)`` with sub-communicators and rank lists, and the clear error when the MPI
backend is chosen without mpirun. Each job runs under a hard timeout and is killed as a whole
process group if it overruns."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_backends import check_sets_and_flags, init_error

from conformance.battery import CHECKS
from harness import spawn_ranks

TESTS = Path(__file__).resolve().parents[1]


def _mpi_missing() -> str | None:
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH (install Open MPI)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install 'hora[mpi]')"
    return None


pytestmark = pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))

# Every rank runs this with the result directory as argv[1]; it writes <rank>.json.
PRELUDE = f"""
import json, os, sys
sys.path[:0] = [{str(TESTS)!r}, {str(TESTS / "integration")!r}]
OUT = sys.argv[1]
RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
def put(value):
    with open(os.path.join(OUT, f"{{RANK}}.json"), "w") as f:
        json.dump(value, f)
"""


def _run(argv: list[str], code: str, np_: int, out: Path, env: dict[str, str],
         timeout: float) -> list[Any]:  # fmt: skip
    """Run ``argv + [python -c PRELUDE+code, out]``; every rank's JSON result, in rank order."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "HORA_STALL_SHUTDOWN_TIME_SECONDS": "30", **env}  # fmt: skip
    cmd = argv + [sys.executable, "-c", PRELUDE + code, str(out)]
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        pytest.fail(f"{argv[0]} did not finish within {timeout}s:\n{text.decode()[-4000:]}")
    log = text.decode(errors="replace")
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{log[-4000:]}"
    results = []
    for r in range(np_):
        path = out / f"{r}.json"
        assert path.exists(), f"rank {r} wrote no result:\n{log[-4000:]}"
        results.append(json.loads(path.read_text()))
    return results


def mpirun(np_: int, code: str, out: Path, env: dict[str, str], timeout: float = 150) -> list[Any]:
    argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np_)]
    return _run(argv, code, np_, out, env, timeout)


MPI = {"HOROVOD_CPU_OPERATIONS": "mpi"}

BATTERY = """
import hora as hvd
from conformance.battery import run_battery
hvd.init()  # a first generation: the backend in use, then shut down and start again
backend = hvd.mpi_enabled()
hvd.shutdown()
put({"mpi_enabled": backend, "battery": run_battery(RANK)})
"""


@pytest.fixture(scope="module")
def mpi_battery(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    return mpirun(2, BATTERY, tmp_path_factory.mktemp("mpi-battery"), MPI)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_mpi_conformance(mpi_battery: list[Any], check: str) -> None:
    for rank, out in enumerate(mpi_battery):
        assert out["mpi_enabled"] is True, out
        results = out["battery"]
        assert check in results, f"rank {rank} did not reach {check} (an earlier check broke it)"
        assert results[check] == "ok", f"mpi np=2 rank {rank}:\n{results[check]}"


SETS = "from test_backends import sets_and_flags\nput(sets_and_flags(RANK))\n"


@pytest.mark.timeout(200)
def test_mpi_process_sets_and_flags(tmp_path: Path) -> None:
    check_sets_and_flags(mpirun(3, SETS, tmp_path, MPI), "mpi", "MpiBackend")


@pytest.mark.timeout(200)
def test_hora_run_mpi(tmp_path: Path) -> None:
    hora = shutil.which("hora")
    if hora is None:
        pytest.skip("the hora command is not on PATH (pip install -e .)")
    argv = [hora, "run", "--mpi", "-np", "2"]
    check_sets_and_flags(_run(argv, SETS, 2, tmp_path, {}, 150), "mpi", "MpiBackend")


THREADS = """
import numpy as np
import hora as hvd
hvd.init()
put({"threads": hvd.mpi_threads_supported(), "backend": hvd.mpi_enabled(),
     "sum": hvd.allreduce(np.ones(2), op=hvd.Sum).tolist()})
hvd.shutdown()
"""


@pytest.mark.timeout(200)
def test_mpi_threads_disable_starts_mpi_serialized(tmp_path: Path) -> None:
    hora = shutil.which("hora")
    if hora is None:
        pytest.skip("the hora command is not on PATH (pip install -e .)")
    runs = {}
    for level, flags in (("multiple", []), ("serialized", ["--mpi-threads-disable"])):
        (tmp_path / level).mkdir()
        argv = [hora, "run", "--mpi", "-np", "2", *flags]
        runs[level] = _run(argv, THREADS, 2, tmp_path / level, {}, 150)
    for level, want in (("multiple", True), ("serialized", False)):
        for out in runs[level]:
            assert out == {"threads": want, "backend": True, "sum": [2.0, 2.0]}, (level, out)


SUBCOMM = """
import numpy as np
from mpi4py import MPI
import hora as hvd
from hora.core.runtime import runtime
world = MPI.COMM_WORLD
out = {}
sub = world.Split(color=0 if RANK < 2 else MPI.UNDEFINED, key=RANK)  # ranks 0 and 1
comm = sub
if RANK == 2:
    for bad, key in ((sub, "null"), ([0, 1], "not_listed")):
        try:
            hvd.init(comm=bad)
        except ValueError as e:
            out[key] = str(e)
    comm = [2]  # the list form, on its own
hvd.init(comm=comm)
out.update(size=hvd.size(), rank=hvd.rank(), local=[hvd.local_rank(), hvd.local_size()],
           backend=runtime().backend_name,
           sum=hvd.allreduce(np.full(3, RANK + 1.0), op=hvd.Sum, name="sub").tolist(),
           gather=hvd.allgather(np.array([RANK]), name="sub.gather").tolist())
hvd.shutdown()
put(out)
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", ["native", "mpi"])
def test_init_with_sub_communicators(tmp_path: Path, backend: str) -> None:
    out = mpirun(3, SUBCOMM, tmp_path, {"HOROVOD_CPU_OPERATIONS": backend})
    for r in (0, 1):
        assert (out[r]["size"], out[r]["rank"], out[r]["local"]) == (2, r, [r, 2]), out[r]
        assert out[r]["sum"] == [3.0] * 3 and out[r]["gather"] == [0, 1], out[r]
    assert (out[2]["size"], out[2]["rank"], out[2]["sum"], out[2]["gather"]) == (
        1, 0, [3.0] * 3, [2])  # fmt: skip
    assert "not a member of the communicator" in out[2]["null"]
    assert "rank 2 of MPI.COMM_WORLD is not in the list" in out[2]["not_listed"]
    assert {o["backend"] for o in out} == {backend}


@pytest.mark.timeout(90)
def test_mpi_backend_without_mpirun_is_a_clear_error() -> None:
    results = spawn_ranks(init_error, 2, timeout=60, env=MPI)
    for r in results:
        assert r.ok, r.stderr
        assert "MPI backend needs the job started by MPI" in r.value, r.value
        assert "hora run --mpi" in r.value
