"""deploy/slurm.sbatch and deploy/kubernetes.yaml with real processes on this host.

There is no Slurm or Kubernetes here, so each test plays the part of the system with the
variables it sets: a stand-in ``srun`` that starts the batch script's tasks with srun's
``SLURM_*`` variables, and two processes with a pod's environment from the manifest (its
variables, the index Kubernetes sets, and 127.0.0.1 for the pod-0 DNS name). Every rank must
find its place and agree on an allreduce.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

WORKER = """\
import sys
import numpy as np
import hora as hvd
from hora.identity import detect
hvd.init()
total = hvd.allreduce(np.full(2, hvd.rank() + 1.0), op=hvd.Sum)
sys.stdout.write(f"{detect().source} rank={hvd.rank()} size={hvd.size()} "
                 f"local={hvd.local_rank()}/{hvd.local_size()} sum={total.tolist()}\\n")
hvd.shutdown()
"""

# srun on one node: every task of the step here, with the variables srun gives a task
FAKE_SRUN = """\
#!/bin/bash
while [[ "${1:-}" == -* ]]; do shift; done
n=${SLURM_NTASKS:?sbatch sets SLURM_NTASKS}
pids=()
for ((i = 0; i < n; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 SLURM_STEP_ID=0 SLURM_STEPID=0 \\
    SLURM_STEP_NUM_TASKS=$n SLURM_STEP_TASKS_PER_NODE=$n SLURM_STEP_NODELIST=localhost \\
    SLURM_STEP_NUM_NODES=1 "$@" > "$SRUN_OUT.$i" &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
"""


def _clean_env() -> dict[str, str]:
    prefixes = ("HORA_", "HOROVOD_", "OMPI_", "PMI", "SLURM_")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "JOB_COMPLETION_INDEX"}  # fmt: skip
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}


@pytest.mark.timeout(120)
def test_slurm_batch_script_starts_ranks_that_find_each_other(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    (tmp_path / "worker.py").write_text(WORKER)
    env = {
        **_clean_env(),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HORA_PYTHON": sys.executable,
        "SRUN_OUT": str(tmp_path / "out"),
        # what sbatch sets for the batch script: one node here, 2 tasks
        "SLURM_JOB_ID": str(random.randrange(10**6, 10**7)),
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_SUBMIT_DIR": str(tmp_path),
    }
    done = subprocess.run(["bash", str(ROOT / "deploy" / "slurm.sbatch"), "worker.py"], env=env,
                          capture_output=True, text=True, timeout=100)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [(tmp_path / f"out.{r}").read_text().strip() for r in range(2)]
    assert lines == [f"slurm rank={r} size=2 local={r}/2 sum=[3.0, 3.0]" for r in range(2)]


@pytest.mark.timeout(120)
def test_kubernetes_pods_find_each_other(tmp_path: Path) -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all((ROOT / "deploy" / "kubernetes.yaml").open())}
    job = docs["Job"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    pod_env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    with socket.socket() as s:  # the manifest's port may be taken on a shared host
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    n = job["spec"]["completions"]
    procs = []
    for i in range(n):
        env = {**_clean_env(), **pod_env, "JOB_COMPLETION_INDEX": str(i),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "HORA_SECRET_KEY": "5e" * 16}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    lines = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err
            lines.append(out.strip())
    finally:
        for proc in procs:
            proc.kill()
    total = float(sum(range(1, n + 1)))
    assert lines == [f"kubernetes rank={i} size={n} local=0/1 sum={[total, total]}"
                     for i in range(n)]  # fmt: skip
