"""hora over the Gloo and NCCL backends, on real processes: the whole conformance battery at
np 2 and 3 through Gloo, process sets and the ``*_enabled`` flags, ``hora run --gloo``, a peer
killed inside a Gloo collective, and clear errors for what this machine or launch cannot run.
``sets_and_flags`` is also run under mpirun by ``test_backends_mpi.py``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from typing import Any

import pytest

from conformance.battery import CHECKS, run_battery
from harness import run_ranks, spawn_ranks

GLOO = {"HOROVOD_CPU_OPERATIONS": "gloo"}


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


needs_gpu = pytest.mark.skipif(not _has_cuda(), reason="needs an NVIDIA GPU")


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"np{n}")
def gloo_battery(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, str]]]:
    return request.param, run_ranks(run_battery, request.param, timeout=150, env=GLOO)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_gloo_conformance(gloo_battery: tuple[int, list[dict[str, str]]], check: str) -> None:
    np_, per_rank = gloo_battery
    for rank, results in enumerate(per_rank):
        assert check in results, f"rank {rank} did not reach {check} (an earlier check broke it)"
        assert results[check] == "ok", f"gloo np={np_} rank {rank}:\n{results[check]}"


def _sets(size: int) -> list[list[int]]:
    """Two sets to add and remove in turn (never the whole world, which exists already)."""
    return [[0, size - 1] if size > 2 else [0], list(range(1, size))]


def sets_and_flags(rank: int) -> dict[str, Any]:
    """Dynamic process sets through the backend, and what hora says about the backend."""
    import numpy as np

    import hora as hvd
    from hora.core.runtime import runtime

    hvd.init(process_sets="dynamic")
    size = hvd.size()
    rt = runtime()
    out: dict[str, Any] = {
        "backend": rt.backend_name,
        "class": type(rt.engine.executor.backend).__name__,
        "mpi_enabled": hvd.mpi_enabled(),
        "gloo_enabled": hvd.gloo_enabled(),
    }
    try:
        out["mpi_threads"] = hvd.mpi_threads_supported()
    except ValueError as e:
        out["mpi_threads"] = str(e)
    for step, ranks in enumerate(_sets(size)):
        ps = hvd.add_process_set(ranks)
        if rank in ranks:
            x = np.full(3, rank + 1.0, dtype=np.float32)
            out[f"sum{step}"] = hvd.allreduce(x, op=hvd.Sum, process_set=ps).tolist()
            out[f"gather{step}"] = hvd.allgather(np.array([rank]), process_set=ps).tolist()
            root = ranks[-1]
            bc = hvd.broadcast(np.array([rank, 7]), root, process_set=ps)
            out[f"bcast{step}"] = bc.tolist()
            hvd.barrier(process_set=ps)
        hvd.remove_process_set(ps)
    out["global"] = hvd.allreduce(np.ones(2), op=hvd.Sum, name="after.sets").tolist()
    hvd.shutdown()
    out["enabled_after_shutdown"] = hvd.mpi_enabled() or hvd.gloo_enabled()
    return out


def check_sets_and_flags(out: list[dict[str, Any]], backend: str, cls: str) -> None:
    size = len(out)
    for step, ranks in enumerate(_sets(size)):
        want = [float(sum(r + 1 for r in ranks))] * 3
        for r in ranks:
            assert out[r][f"sum{step}"] == want, (step, r, out[r])
            assert out[r][f"gather{step}"] == ranks, (step, r, out[r])
            assert out[r][f"bcast{step}"] == [ranks[-1], 7], (step, r, out[r])
    for o in out:
        assert (o["backend"], o["class"]) == (backend, cls), o
        assert o["mpi_enabled"] is (backend == "mpi") and o["gloo_enabled"] is (backend == "gloo")
        if backend == "mpi":
            assert isinstance(o["mpi_threads"], bool), o
        else:
            assert "MPI is not enabled" in o["mpi_threads"], o
        assert o["global"] == [float(size)] * 2
        assert o["enabled_after_shutdown"] is False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_gloo_process_sets_and_flags(np_: int) -> None:
    out = run_ranks(sets_and_flags, np_, timeout=90, env=GLOO)
    check_sets_and_flags(out, "gloo", "GlooBackend")


@pytest.mark.timeout(120)
def test_hora_run_gloo() -> None:
    hora = shutil.which("hora")
    if hora is None:
        pytest.skip("the hora command is not on PATH (pip install -e .)")
    code = (
        "import numpy as np, hora as hvd\n"
        "hvd.init()\n"
        "s = hvd.allreduce(np.ones(2) * (hvd.rank() + 1), op=hvd.Sum)\n"
        "print('RESULT', hvd.rank(), hvd.gloo_enabled(), hvd.mpi_enabled(), s.tolist())\n"
        "hvd.shutdown()\n"
    )
    argv = [hora, "run", "--gloo", "-np", "2", sys.executable, "-c", code]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(line.split("RESULT ", 1)[1] for line in done.stdout.splitlines()
                   if "RESULT " in line)  # fmt: skip
    assert lines == ["0 True False [3.0, 3.0]", "1 True False [3.0, 3.0]"], done.stdout


def _killed_in_collective(rank: int) -> dict[str, Any]:
    import os
    import signal
    import threading
    import time

    import numpy as np

    import hora as hvd

    hvd.init()
    x = np.ones(4 << 20, dtype=np.float32)  # 16 MiB: each allreduce spends its time in Gloo
    hvd.allreduce(x, op=hvd.Sum, name="warm")
    if rank == 1:  # dies while the ranks are inside one of the next allreduces
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        for i in range(10_000):
            hvd.allreduce(x, op=hvd.Sum, name=f"step{i % 2}")
        return {"error": "no error", "seconds": time.monotonic() - t0}
    except hvd.HorovodInternalError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    finally:
        hvd.shutdown()


@pytest.mark.timeout(90)
def test_gloo_peer_killed_inside_a_collective_fails_the_others() -> None:
    results = spawn_ranks(_killed_in_collective, 3, timeout=40, env=GLOO)
    assert results[1].status == "died" and results[1].returncode == -9
    for r in (results[0], results[2]):
        assert r.ok, r.stderr
        assert "has been shut down" in r.value["error"], r.value


def init_error(rank: int, comm: Any = None) -> str:
    """``hvd.init(comm=comm)`` on one rank: the ValueError it raised, or "init succeeded"."""
    import hora as hvd

    try:
        hvd.init(comm=comm)
    except ValueError as e:
        return str(e)
    hvd.shutdown()
    return "init succeeded"


@pytest.mark.timeout(60)
def test_unknown_backend_name_is_a_clear_error() -> None:
    (msg,) = run_ranks(init_error, 1, timeout=30, env={"HOROVOD_CPU_OPERATIONS": "carrier"})
    assert "HOROVOD_CPU_OPERATIONS=carrier: expected one of" in msg, msg
    assert "gloo" in msg and "mpi" in msg


@pytest.mark.timeout(60)
def test_init_comm_without_mpirun_is_a_clear_error() -> None:
    for msg in run_ranks(init_error, 2, ([0, 1],), timeout=30):
        assert "init(comm=...) needs a job started by MPI" in msg, msg


@pytest.mark.timeout(60)
@pytest.mark.skipif(_has_cuda(), reason="checks the error on machines without a GPU")
def test_nccl_without_a_gpu_is_a_clear_error() -> None:
    (msg,) = run_ranks(init_error, 1, timeout=30, env={"HOROVOD_CPU_OPERATIONS": "nccl"})
    assert "NCCL backend needs an NVIDIA GPU" in msg, msg
    # Horovod's GPU selectors say nothing about CPU data: without a GPU the job runs natively
    for env in ({"HOROVOD_GPU_OPERATIONS": "nccl"}, {"HOROVOD_GPU_ALLREDUCE": "NCCL"}):
        (msg,) = run_ranks(init_error, 1, timeout=30, env=env)
        assert msg == "init succeeded", msg


@needs_gpu
@pytest.mark.timeout(200)
def test_nccl_battery_world_of_one() -> None:
    env = {"HOROVOD_GPU_OPERATIONS": "nccl", "HORA_LOCAL_SETS": "0"}  # NCCL, not a set of one
    (results,) = run_ranks(run_battery, 1, timeout=150, env=env)
    assert results and all(v == "ok" for v in results.values()), results


def _cuda_tensors(rank: int) -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    hvd.init()
    x = torch.arange(6, dtype=torch.float32, device="cuda").reshape(2, 3)
    y = hvd.allreduce(x, op=hvd.Sum, name="cuda.sum")
    g = hvd.allgather(x[:1], name="cuda.gather")
    out = {"device": str(y.device), "sum": y.cpu().tolist(), "gather": g.cpu().tolist()}
    hvd.shutdown()
    return out


@needs_gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("env", [{}, {"HOROVOD_GPU_OPERATIONS": "nccl"},
                                 {"HORA_LOCAL_SETS": "0"},
                                 {"HOROVOD_GPU_OPERATIONS": "nccl", "HORA_LOCAL_SETS": "0"}],
                         ids=["staged", "nccl", "staged-engine", "nccl-engine"])  # fmt: skip
def test_cuda_tensors_world_of_one(env: dict[str, str]) -> None:
    (out,) = run_ranks(_cuda_tensors, 1, timeout=90, env=env)
    assert out["device"].startswith("cuda")
    assert out["sum"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert out["gather"] == [[0.0, 1.0, 2.0]]
