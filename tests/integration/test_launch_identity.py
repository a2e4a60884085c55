"""hvd.init() without `hora run`: plain mpirun, torchrun-style and Slurm-style variables.

Each starts two real processes that find each other through the variables alone (rank 0 hosts
the rendezvous store) and run an allreduce.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

WORKER = (
    "import numpy as np, hora as hvd\n"
    "from hora.identity import detect\n"
    "hvd.init()\n"
    "total = hvd.allreduce(np.full(2, hvd.rank() + 1.0), op=hvd.Sum)\n"
    "import sys\n"
    "sys.stdout.write(f'{detect().source} rank={hvd.rank()} size={hvd.size()} "
    "local={hvd.local_rank()}/{hvd.local_size()} sum={total.tolist()}\\n')\n"
    "sys.stdout.flush()\n"
    "hvd.shutdown()\n"
)


def _clean_env() -> dict[str, str]:
    prefixes = ("HORA_", "HOROVOD_", "OMPI_", "PMI", "SLURM_")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two(envs: list[dict[str, str]]) -> list[str]:
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER], env={**_clean_env(), **env},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for env in envs
    ]  # fmt: skip
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            outputs.append(out.strip())
    finally:
        for proc in procs:
            proc.kill()
    return outputs


@pytest.mark.timeout(90)
def test_torchrun_style_variables() -> None:
    port = str(_free_port())
    envs = [
        {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        for r in range(2)
    ]  # fmt: skip
    assert _run_two(envs) == [
        f"torchrun rank={r} size=2 local={r}/2 sum=[3.0, 3.0]" for r in range(2)
    ]


@pytest.mark.timeout(90)
def test_slurm_style_variables() -> None:
    job = str(os.getpid())
    envs = [
        {"SLURM_PROCID": str(r), "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": str(r),
         "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_ID": "0",
         "SLURM_JOB_ID": job, "SLURM_STEP_NODELIST": "localhost"}
        for r in range(2)
    ]  # fmt: skip
    assert _run_two(envs) == [f"slurm rank={r} size=2 local={r}/2 sum=[3.0, 3.0]" for r in range(2)]


@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_plain_mpirun() -> None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("Open MPI's mpirun is not installed")
    argv = [mpirun, "--allow-run-as-root", "--tag-output", "-np", "2", "-bind-to", "none",
            sys.executable, "-c", WORKER]  # fmt: skip
    done = subprocess.run(argv, env=_clean_env(), capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stderr
    # mpirun forwards output in chunks, not lines: the two ranks' text may interleave, so
    # each rank's chunks are put back together by their tags before comparing
    text = {r: "" for r in range(2)}
    for m in re.finditer(r"\[1,(\d)\]<stdout>:(.*?)(?=\[1,\d\]<stdout>:|\Z)", done.stdout, re.S):
        text[int(m.group(1))] += m.group(2)
    for r in range(2):
        assert text[r].strip() == f"mpi rank={r} size=2 local={r}/2 sum=[3.0, 3.0]", done.stdout
