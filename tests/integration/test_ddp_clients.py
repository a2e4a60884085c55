"""PyTorch Lightning and Hugging Face Accelerate on ``backend="hora"``, on real ranks at np=2.

Each job runs tests/integration/ddp_clients_worker.py as its users would start it (Lightning's
own launcher or ``hora run`` with :class:`hora.torch.lightning.HoraEnvironment`; torchrun or
``hora run`` with :func:`hora.torch.accelerate.accelerator`): a small MLP trains a few steps on
hora, then on Gloo in the same processes. Every step's loss, the losses Accelerate gathers and
the final parameters must be Gloo's bit for bit: DDP divides each gradient by the world size and
then sums, and a sum of two addends has one result whichever rank adds. A job of Lightning
ranks in which one is killed mid-step checks that the survivor raises within seconds, naming it.
Both ``hora run`` tests share one job (both clients in turn), and ``hora bench clients`` runs
once, Accelerate alone, with two steps.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness import spawn_ranks
from hora.lab.procs import free_port

# looked up, not imported: the ranks import them (Lightning's import takes seconds)
pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("pytorch_lightning", "accelerate")),
    reason="needs pytorch-lightning and accelerate (the dev extra)",
)

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "ddp_clients_worker.py")
HORA_RUN = [sys.executable, "-c", "import sys; from hora.launch.cli import main; sys.exit(main())",
            "run", "-np", "2"]  # fmt: skip
TIMEOUT = 150  # one job: two interpreters importing torch and the clients, their trainings


def _env() -> dict[str, str]:
    """The test's environment without any launcher's variables."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "NODE_RANK", "GROUP_RANK")  # fmt: skip
    launcher = ("HORA_", "HOROVOD_", "TORCHELASTIC_")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(launcher)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env



def job(argv: list[str], clients: str, out: Path, *flags: str) -> dict[str, list[dict[str, Any]]]:
    """Run the worker for ``clients`` under the launcher ``argv``; each client's per-rank
    results (a failure shows the job's output)."""
    started = time.monotonic()
    proc = subprocess.Popen([*argv, WORKER, clients, str(out), *flags], env=_env(), cwd=out,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        text = proc.communicate(timeout=TIMEOUT)[0][-4000:]
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun and hora run then stop the ranks they started in sessions
        # of their own
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            text = proc.communicate(timeout=15)[0][-4000:]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text = proc.communicate()[0][-4000:]
        raise AssertionError(f"{clients} job ran past {TIMEOUT} s:\n{text}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a rank of Lightning's left behind
    assert proc.returncode == 0, f"{clients} job exited {proc.returncode}:\n{text}"
    got = {}
    for client in clients.split(","):
        files = [out / f"{client}.{r}.json" for r in range(2)]
        assert all(f.exists() for f in files), f"a rank wrote no {client} results:\n{text}"
        got[client] = [json.loads(f.read_text()) for f in files]
    print(f"{clients} job: {time.monotonic() - started:.1f} s")
    return got


@pytest.fixture(scope="module")
def hora_run_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Both clients in one ``hora run -np 2`` job (one start-up of the interpreters)."""
    out = tmp_path_factory.mktemp("hora_run")
    return job([*HORA_RUN, sys.executable], "lightning,accelerate", out, "--hora-env")


def assert_same_as_gloo(per_rank: list[dict[str, Any]], keys: tuple[str, ...]) -> None:
    for rank, res in enumerate(per_rank):
        hora, gloo = res["hora"], res["gloo"]
        assert (hora["backend"], gloo["backend"]) == ("hora", "gloo"), (hora, gloo)
        assert hora["rank"] == rank and len(hora["losses"]) == 4, hora
        for key in keys:
            assert hora[key] == gloo[key], (
                f"rank {rank}, {key}: hora {_floats(hora[key])} != gloo {_floats(gloo[key])}"
            )
    # DDP keeps the replicas equal, and each rank trained on its own data
    assert per_rank[0]["hora"]["params"] == per_rank[1]["hora"]["params"]
    assert per_rank[0]["hora"]["losses"] != per_rank[1]["hora"]["losses"]


def _floats(value: Any) -> Any:
    if isinstance(value, list):
        return [_floats(v) for v in value]
    return float.fromhex(value) if isinstance(value, str) and value.startswith("0x") else value


# -- Lightning ------------------------------------------------------------------------------
@pytest.mark.timeout(TIMEOUT + 30)
def test_lightning_under_its_own_launcher(tmp_path: Path) -> None:
    per_rank = job([sys.executable], "lightning", tmp_path)["lightning"]
    assert_same_as_gloo(per_rank, ("losses", "params"))


@pytest.mark.timeout(TIMEOUT + 30)
def test_lightning_under_hora_run_with_hora_environment(hora_run_job: Any) -> None:
    assert_same_as_gloo(hora_run_job["lightning"], ("losses", "params"))


def killed_mid_step(rank: int, t_death: str) -> Any:
    """Lightning on hora, ranks started from outside (as by a scheduler) with HoraEnvironment;
    rank 1 kills itself in step 2, between forward and backward."""
    import torch

    sys.path.insert(0, str(HERE))
    from ddp_clients_worker import lightning_fit

    torch.set_num_threads(1)
    try:
        lightning_fit("hora", True, die_at=2 if rank == 1 else None, t_death=t_death)
    except Exception as e:  # noqa: BLE001 - what the survivor's Trainer raises
        return type(e).__name__, str(e), time.time()
    return "no error"


@pytest.mark.timeout(TIMEOUT + 30)
def test_lightning_rank_killed_mid_step_makes_the_survivor_raise_naming_it(
    tmp_path: Path,
) -> None:
    t_death = tmp_path / "t_death"
    results = spawn_ranks(killed_mid_step, 2, args=(str(t_death),), timeout=TIMEOUT - 30)
    victim, survivor = results[1], results[0]
    assert victim.status == "died" and victim.returncode == -9, (victim.status, victim.stderr)
    assert survivor.ok, f"{survivor.status}: {survivor.value}\n{survivor.stderr[-3000:]}"
    assert survivor.value != "no error", "the survivor trained on without its peer"
    kind, text, t_raised = survivor.value
    assert kind in ("DistBackendError", "RuntimeError"), survivor.value
    assert "hora backend" in text and "rank 1" in text, text
    waited = t_raised - float(t_death.read_text())
    print(f"the survivor raised {waited:.1f} s after rank 1 died: {kind}: {text}")
    assert 0 <= waited < TIMEOUT / 5, f"the survivor raised {waited:.1f} s after the death"


# -- Accelerate -----------------------------------------------------------------------------
ACCELERATE_KEYS = ("losses", "gathered", "params")


def assert_accelerate(per_rank: list[dict[str, Any]]) -> None:
    assert_same_as_gloo(per_rank, ACCELERATE_KEYS)
    for res in per_rank:
        # why hora.torch.accelerate.accelerator() exists: Accelerate refuses the name itself
        assert "backend hora is not available, please use gloo" in res["refusal"], res["refusal"]
        assert (res["hora"]["state_backend"], res["gloo"]["state_backend"]) == ("hora", "gloo")


@pytest.mark.timeout(TIMEOUT + 30)
def test_accelerate_under_torchrun(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_addr", "127.0.0.1", "--master_port", str(free_port())]  # fmt: skip
    assert_accelerate(job(argv, "accelerate", tmp_path)["accelerate"])


@pytest.mark.timeout(TIMEOUT + 30)
def test_accelerate_under_hora_run(hora_run_job: Any) -> None:
    assert_accelerate(hora_run_job["accelerate"])


# -- hora bench clients ---------------------------------------------------------------------
@pytest.mark.timeout(TIMEOUT + 30)
def test_bench_clients_times_both_backends() -> None:
    """Accelerate alone (the cheaper start-up); Lightning's path is the one trained above."""
    from hora.lab.clients import render, run_clients_bench

    result = run_clients_bench(["accelerate"], "mlp", np_=2, steps=2, warmup=1, batch=4,
                               timeout=TIMEOUT)  # fmt: skip
    for backend in ("gloo", "hora"):
        got = result["results"][f"accelerate.{backend}"]
        assert (got["backend"], got["np"], got["steps"], got["batch"]) == (backend, 2, 2, 4), got
        assert got["step_ms"] > 0, got
    text = render(result)
    assert "accelerate" in text and "hora/gloo" in text, text
