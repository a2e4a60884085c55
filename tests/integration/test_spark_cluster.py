"""hora.spark.run on ``local-cluster[2,1,1024]``: two executor JVMs on one host, as on a
cluster (one SparkSession for the module).

The two ranks run in different executors of the same host, so they share its local ranks;
and although Spark retries failed tasks on a cluster master (``local[N]`` never does), the
job's function does not run a second time after a rank fails (the driver cancels the stage at
once, and a retried task refuses to start a rank).
"""

from __future__ import annotations

import os

import pytest
from spark_session import session  # skips the module without pyspark or Java

from hora.errors import LaunchError  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def spark():
    conf = {"spark.executor.memory": "512m", "spark.ui.showConsoleProgress": "false"}
    started = session("local-cluster[2,1,1024]", "hora-tests-cluster", conf)
    yield started
    started.stop()


def test_ranks_of_two_executors_on_one_host_share_its_local_ranks(spark) -> None:
    import hora.spark

    def where() -> tuple[int, int, int, int]:
        import os

        import hora as hvd

        hvd.init()
        # the rank's parent is the wrapper shell; the wrapper's parent is the task's worker
        with open(f"/proc/{os.getppid()}/stat") as f:
            task_pid = int(f.read().rsplit(")", 1)[1].split()[1])
        out = (hvd.rank(), hvd.local_rank(), hvd.local_size(), task_pid)
        hvd.shutdown()
        return out

    results = hora.spark.run(where, num_proc=2)
    assert [r[:3] for r in results] == [(0, 0, 2), (1, 1, 2)]
    assert results[0][3] != results[1][3]  # two tasks' Python workers
    assert spark.sparkContext.defaultParallelism == 2


def test_failed_rank_is_reported_and_the_job_is_not_run_again(spark, tmp_path) -> None:
    import hora.spark

    piddir = str(tmp_path)

    def fail_once() -> int:
        import os
        import time

        with open(os.path.join(piddir, str(os.getpid())), "w"):
            pass
        while len(os.listdir(piddir)) < 2:
            time.sleep(0.05)
        if os.environ["HORA_RANK"] == "1":
            raise ValueError("bad shard")
        time.sleep(600)
        return 0

    with pytest.raises(LaunchError, match="rank 1 raised") as info:
        hora.spark.run(fail_once, num_proc=2)
    assert "ValueError: bad shard" in str(info.value)
    assert len(os.listdir(piddir)) == 2  # each rank ran once: no retried stage ran fn again
