"""hora.spark.run_elastic on ``local-cluster[2,1,1024]``: two executor JVMs, one task slot
each, as on a cluster whose executors can be lost (one SparkSession for the module).

Both executors run on this machine, so the test gives the Spark side distinct host names: the
executors' Python daemons (through a ``sitecustomize`` on the executors' ``PYTHONPATH``) report
``hora-host-a`` for the first two executors and ``hora-host-b`` for any later one. The job starts
with two workers on ``hora-host-a``; mid-training the worker on slot 0 kills its own executor's
JVM (SIGKILL): that executor's daemon, task and worker go with it, Spark's standalone master
starts a new executor (on "another host", ``hora-host-b``) and runs the task again there. So
``hora-host-a`` goes from two slots to one while its other worker (on slot 1) is healthy: that
worker must stay in the job, and the retried task's worker joins it. The committed-step ledger
stays exact (steps 1..N each once, with the world size of each), every rank ends with the same
parameters, and no worker process, Spark job or driver thread is left. The survivor trains
alone after the kill, then holds (committing) until the new worker is in, for at most 60 s.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
from spark_session import session  # skips the module without pyspark or Java

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(300)

STEPS = 40


# executor ids 0 and 1 are the first two executors; a replacement gets 2, 3, ...
SITECUSTOMIZE = """
import os, socket
try:
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        _args = f.read().split(b"\\0")
except OSError:
    _args = []
if b"--executor-id" in _args:  # a Python daemon of an executor JVM (forked workers inherit it)
    _id = _args[_args.index(b"--executor-id") + 1].decode()
    _name = "hora-host-a" if _id in ("0", "1") else "hora-host-b"
    socket.gethostname = lambda: _name
"""


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    site = tmp_path_factory.mktemp("executor-site")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    conf = {"spark.executor.memory": "512m", "spark.ui.showConsoleProgress": "false",
            "spark.task.maxFailures": "4", "spark.executorEnv.PYTHONPATH": str(site)}  # fmt: skip
    started = session("local-cluster[2,1,1024]", "hora-tests-elastic-cluster", conf)
    yield started
    started.stop()


def _executor_jvm() -> int:
    """The pid of the Java process above this one (this rank's executor)."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/comm") as f:
            if f.read().strip() == "java":
                return pid
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    raise RuntimeError("no executor JVM above this worker")


def train_ledger(flag_dir: str, steps: int, kill_at: int, victim: str):
    """Elastic training with a committed-step ledger: ``history`` gets ``(step, size)`` at
    each commit, ``params`` moves by the same sum whatever the size. The worker ``victim``
    (its ``HORA_ELASTIC_ID``) kills its executor's JVM at step ``kill_at``, once per job."""
    import numpy as np

    import hora as hvd
    from hora.elastic import ObjectState, run

    Path(flag_dir, f"pid.{os.getpid()}").touch()
    Path(flag_dir, "port").write_text(os.environ["HORA_RENDEZVOUS_PORT"])
    hvd.init()
    state = ObjectState(hvd.broadcast_object, hvd.rank, step=0, history=[], params=np.zeros(4))

    @run
    def loop(state):
        while state.step < steps:
            out = hvd.allreduce(np.array([state.step + 1.0, 1.0, 0, 0]), op=hvd.Sum, name="g")
            size = int(out[1])
            state.params = state.params - 0.01 * out / size
            state.step += 1
            state.history = [*state.history, (state.step, size)]
            if state.step == kill_at and os.environ["HORA_ELASTIC_ID"] == victim:
                try:
                    fd = os.open(Path(flag_dir, "killed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    pass
                else:
                    os.close(fd)
                    os.kill(_executor_jvm(), signal.SIGKILL)
                    time.sleep(60)  # the task's wrapper stops this worker
            time.sleep(0.1)
            state.commit()
            # alone after the kill: hold (committing) until the retried task's worker joined,
            # so that a slow executor start cannot let the job end at size 1
            deadline = time.monotonic() + 60
            while Path(flag_dir, "killed").exists() and hvd.size() < 2:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
                state.commit()

    loop(state)
    where = os.environ["HORA_ELASTIC_ID"]
    return hvd.rank(), hvd.size(), state.history, state.params.tolist(), where


def test_a_healthy_worker_stays_when_its_hosts_task_moves_to_another_host(
    spark, tmp_path
) -> None:
    from test_spark_elastic import _assert_nothing_left

    import hora.spark

    results = hora.spark.run_elastic(
        train_ledger, args=(str(tmp_path), STEPS, 3, "hora-host-a:0"), num_proc=2,
        min_num_proc=1,
        elastic_timeout=40, start_timeout=120,
    )  # fmt: skip
    assert (tmp_path / "killed").exists(), "no executor was killed"
    print("\nworkers at the end:", [(r[0], r[1], r[4]) for r in results])
    print("sizes by step:", [n for _, n in results[0][2]])
    # the healthy worker of hora-host-a stayed; the retried task's worker joined on hora-host-b
    assert sorted(r[4] for r in results) == ["hora-host-a:1", "hora-host-b:0"]
    expected = [-0.01 * sum(range(1, STEPS + 1)), -0.01 * STEPS, 0.0, 0.0]
    for rank, (r, size, history, params, _) in enumerate(results):
        assert (r, size) == (rank, len(results))
        assert [s for s, _ in history] == list(range(1, STEPS + 1))  # each step once
        assert params == results[0][3]  # identical on every rank
        assert params == pytest.approx(expected)
    _assert_nothing_left(spark, tmp_path, int((tmp_path / "port").read_text()))
