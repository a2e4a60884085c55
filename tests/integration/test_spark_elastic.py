"""hora.spark.run_elastic on a real local Spark that retries failed tasks (``local[2,4]``: two
task slots, a task may fail four times): one SparkSession for the module.

A worker process that dies mid-training (``os._exit``) makes its Spark task fail; Spark runs
the task again, the new attempt's worker joins, the survivor rolls back to its last commit, and
the job ends with every committed epoch counted exactly once. A job whose failures exceed
``reset_limit`` fails at once with Horovod's message. After both, no worker process, Spark job,
driver thread or rendezvous store is left.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import pytest
from spark_session import session  # skips the module without pyspark or Java

from hora.errors import LaunchError  # noqa: E402

# the workers cannot import this test module: its functions travel by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def spark():
    started = session("local[2,4]", "hora-elastic-tests", {"spark.python.worker.reuse": "true"})
    yield started
    started.stop()


def _train(flag_dir: str, epochs: int, die_at: int, every_time: bool = False):
    """Elastic training that counts committed epochs (each adds exactly 1.0 to ``total``
    whatever the world size). Rank 1 dies after epoch ``die_at``'s allreduce, before
    committing it (``os._exit``), once per job (``every_time``: whichever worker is rank 1 at
    any later epoch, each time); rank 0 notes when the first epoch after that one is done."""
    import numpy as np

    import hora as hvd
    from hora.elastic import ObjectState, run

    Path(flag_dir, f"pid.{os.getpid()}").touch()
    Path(flag_dir, "port").write_text(os.environ["HORA_RENDEZVOUS_PORT"])
    hvd.init()
    state = ObjectState(hvd.broadcast_object, hvd.rank, epoch=0, total=0.0)

    @run
    def loop(state):
        while state.epoch < epochs:
            out = hvd.allreduce(np.ones(4, np.float32), op=hvd.Sum, name="grad")
            state.total += float(out[0]) / hvd.size()
            state.epoch += 1
            at = state.epoch >= die_at if every_time else state.epoch == die_at
            if at and hvd.rank() == 1:
                if every_time:
                    Path(flag_dir, f"died.{os.getpid()}").touch()
                    os._exit(1)
                try:
                    fd = os.open(Path(flag_dir, "died"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    pass
                else:
                    os.write(fd, repr(time.time()).encode())
                    os.close(fd)
                    os._exit(1)
            died = Path(flag_dir, "died")
            if state.epoch == die_at + 1 and hvd.rank() == 0 and died.exists():
                Path(flag_dir, "recovered").write_text(repr(time.time()))
            time.sleep(0.05)
            state.commit()

    loop(state)
    port = int(os.environ["HORA_RENDEZVOUS_PORT"])
    return hvd.rank(), hvd.size(), state.epoch, state.total, port


def _assert_nothing_left(spark, flag_dir: Path, port: int) -> None:
    pids = [int(p.name[4:]) for p in flag_dir.glob("pid.*")]
    end = time.monotonic() + 30.0
    alive = pids
    while alive and time.monotonic() < end:
        alive = [p for p in alive if os.path.exists(f"/proc/{p}")]
        time.sleep(0.2)
    assert alive == [], f"worker processes left running: {alive}"
    tracker = spark.sparkContext.statusTracker()
    end = time.monotonic() + 10.0
    while tracker.getActiveJobsIds() and time.monotonic() < end:
        time.sleep(0.1)
    assert list(tracker.getActiveJobsIds()) == []
    names = ("hora-spark-job", "hora-spark-match", "hora-store-accept")
    end = time.monotonic() + 10.0
    while any(t.name in names for t in threading.enumerate()) and time.monotonic() < end:
        time.sleep(0.1)
    assert [t.name for t in threading.enumerate() if t.name in names] == []
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_a_dead_worker_is_replaced_by_sparks_retry(spark, tmp_path) -> None:
    import hora.spark

    started = time.monotonic()
    results = hora.spark.run_elastic(
        _train, args=(str(tmp_path), 8, 3), num_proc=2, elastic_timeout=60, start_timeout=60
    )
    took = time.monotonic() - started
    assert (tmp_path / "died").exists(), "no worker died"
    # two ranks at the end (the survivor and Spark's new attempt); every epoch counted once
    assert [r[:4] for r in results] == [(0, 2, 8, 8.0), (1, 2, 8, 8.0)]
    died = float((tmp_path / "died").read_text())
    recovered = float((tmp_path / "recovered").read_text())
    gap = recovered - died
    print(f"\nrun_elastic: {took:.1f} s in all; first epoch after the death {gap:.2f} s after it")
    _assert_nothing_left(spark, tmp_path, results[0][4])


def test_failures_past_reset_limit_fail_fast(spark, tmp_path) -> None:
    import hora.spark

    started = time.monotonic()
    with pytest.raises(LaunchError, match="number of resets during elastic job exceeded limit: 0"):
        hora.spark.run_elastic(
            _train, args=(str(tmp_path), 50, 2), num_proc=2, min_np=1, reset_limit=0
        )
    print(f"\nrun_elastic past reset_limit raised after {time.monotonic() - started:.1f} s")
    assert (tmp_path / "died").exists()
    _assert_nothing_left(spark, tmp_path, int((tmp_path / "port").read_text()))


def test_failures_past_sparks_retries_end_the_job(spark, tmp_path) -> None:
    """Rank 1 dies at every epoch from the second: Spark gives up on its task after the fourth
    failure (local[2,4]), and the job fails naming Spark's reason."""
    import hora.spark

    started = time.monotonic()
    with pytest.raises(LaunchError, match="Spark gave up on a task .* worker exited with status 1"):
        hora.spark.run_elastic(_train, args=(str(tmp_path), 50, 2, True), num_proc=2)
    print(f"\nrun_elastic past Spark's retries raised after {time.monotonic() - started:.1f} s")
    assert len(list(tmp_path.glob("died.*"))) == 4
    _assert_nothing_left(spark, tmp_path, int((tmp_path / "port").read_text()))


def test_example_survives_its_killed_worker(spark, tmp_path) -> None:
    """examples/spark_elastic_digits.py's training function, its rank 1 exiting once."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    import importlib.util

    import hora.spark

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "spark_elastic_digits", root / "examples" / "spark_elastic_digits.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
    cloudpickle.register_pickle_by_value(example)
    flag = tmp_path / "killed"
    results = hora.spark.run_elastic(example.train, args=(3, 0.1, str(flag)), num_proc=2)
    assert flag.exists()
    assert [r[:2] for r in results] == [(0, 2), (1, 2)]
    assert results[0][2] == results[1][2] > 0.5
