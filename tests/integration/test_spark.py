"""hora.spark.run on a real local Spark (``local[2]``): one SparkSession for the module.

Results come back in rank order with each rank's identity and the ``env=`` it was given; a
rank that raises makes run raise naming the rank with its traceback; a Spark task killed
mid-job fails the job (never a hang) naming the rank; too few task slots gives the
start_timeout message; and no rank process is left running after any of them.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
from spark_session import session  # skips the module without pyspark or Java

from hora.errors import LaunchError  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def spark():
    started = session("local[2]", "hora-tests", {"spark.python.worker.reuse": "true"})
    yield started
    started.stop()


def _hora_threads(wait: float = 10.0) -> list[str]:
    """hora's driver-side threads (the stage's thread, the store's listener) still alive
    after up to ``wait`` seconds (a stopped store's listener thread ends on its own)."""
    names = ("hora-spark-job", "hora-store-accept")
    end = time.monotonic() + wait
    while True:
        alive = [t.name for t in threading.enumerate() if t.name in names]
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.1)


def _spark_jobs(spark) -> list[int]:
    """The application's Spark jobs still active (a finished job may take a moment to be
    marked so: waits up to 10 s)."""
    tracker = spark.sparkContext.statusTracker()
    end = time.monotonic() + 10.0
    while tracker.getActiveJobsIds() and time.monotonic() < end:
        time.sleep(0.1)
    return list(tracker.getActiveJobsIds())


def _gone(pids: list[int], wait: float = 30.0) -> list[int]:
    """The pids among ``pids`` still alive after up to ``wait`` seconds."""
    end = time.monotonic() + wait
    alive = pids
    while alive and time.monotonic() < end:
        alive = [p for p in alive if os.path.exists(f"/proc/{p}")]
        time.sleep(0.2)
    return alive


def _make_who(piddir: str):
    def who(tag: str) -> tuple[int, int, int, int, str, str]:
        import os

        import numpy as np

        import hora as hvd

        with open(os.path.join(piddir, str(os.getpid())), "w"):
            pass
        hvd.init()
        total = float(hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)[0])
        out = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), str(total))
        hvd.shutdown()
        return (*out, tag + os.environ.get("HORA_TEST_SPARK_VAR", "<unset>"))

    return who


def test_results_in_rank_order_with_env(spark, tmp_path) -> None:
    import hora.spark

    env = {**os.environ, "HORA_TEST_SPARK_VAR": "from-driver"}
    results = hora.spark.run(_make_who(str(tmp_path)), args=("v=",), num_proc=2, env=env)
    assert results == [
        (0, 2, 0, 2, "3.0", "v=from-driver"),
        (1, 2, 1, 2, "3.0", "v=from-driver"),
    ]
    pids = [int(p) for p in os.listdir(tmp_path)]
    assert len(pids) == 2 and _gone(pids) == []
    assert _hora_threads() == []
    assert _spark_jobs(spark) == []


def test_output_reaches_the_given_streams(spark) -> None:
    import io

    import hora.spark

    def talk() -> None:
        import os

        rank = os.environ["HORA_RANK"]
        print(f"out of {rank}")
        print(f"err of {rank}", file=sys.stderr)

    out, err = io.StringIO(), io.StringIO()
    assert hora.spark.run(talk, num_proc=2, stdout=out, stderr=err) == [None, None]
    assert sorted(out.getvalue().splitlines()) == ["[0]<stdout>:out of 0", "[1]<stdout>:out of 1"]
    assert sorted(err.getvalue().splitlines()) == ["[0]<stderr>:err of 0", "[1]<stderr>:err of 1"]


def _make_raiser(piddir: str):
    def raiser() -> int:
        import os
        import time

        with open(os.path.join(piddir, str(os.getpid())), "w"):
            pass
        while len(os.listdir(piddir)) < 2:  # both ranks run before rank 1 fails
            time.sleep(0.05)
        if os.environ["HORA_RANK"] == "1":
            raise KeyError("no such column: label_1")
        time.sleep(600)  # rank 0 must be stopped by the failure, not finish by itself
        return 0

    return raiser


def test_exception_names_the_rank_and_carries_the_traceback(spark, tmp_path) -> None:
    import hora.spark

    with pytest.raises(LaunchError, match="rank 1 raised") as info:
        hora.spark.run(_make_raiser(str(tmp_path)), num_proc=2)
    assert "KeyError: 'no such column: label_1'" in str(info.value)
    assert isinstance(info.value.__cause__, KeyError)
    pids = [int(p) for p in os.listdir(tmp_path)]
    assert len(pids) == 2 and _gone(pids) == []
    assert _hora_threads() == []
    assert _spark_jobs(spark) == []


def _make_task_killer(piddir: str):
    def killer() -> int:
        import os
        import signal
        import time

        with open(os.path.join(piddir, str(os.getpid())), "w"):
            pass
        while len(os.listdir(piddir)) < 2:  # both ranks run before rank 1's task dies
            time.sleep(0.05)
        if os.environ["HORA_RANK"] == "1":
            # this rank's parent is the wrapper shell; its parent is the Spark task's Python
            # worker: kill that, as Spark or the OS would when an executor dies
            with open(f"/proc/{os.getppid()}/stat") as f:
                task_pid = int(f.read().rsplit(")", 1)[1].split()[1])
            os.kill(task_pid, signal.SIGKILL)
        time.sleep(600)
        return 0

    return killer


def test_killed_task_fails_the_job_naming_the_rank(spark, tmp_path) -> None:
    import hora.spark

    with pytest.raises(LaunchError, match="the Spark task of rank 1 .* was lost"):
        hora.spark.run(_make_task_killer(str(tmp_path)), num_proc=2)
    pids = [int(p) for p in os.listdir(tmp_path)]
    assert len(pids) == 2 and _gone(pids) == []
    assert _hora_threads() == []
    assert _spark_jobs(spark) == []


def test_too_few_slots_gives_the_start_timeout_message(spark) -> None:
    import hora.spark

    with pytest.raises(LaunchError, match=r"only 0 of num_proc=3 Spark tasks started"):
        hora.spark.run(lambda: 0, num_proc=3, start_timeout=2)
    assert _hora_threads() == []
    assert _spark_jobs(spark) == []
    # the session is usable afterwards: nothing of the refused job holds its slots
    assert hora.spark.run(lambda: 5, num_proc=2) == [5, 5]


def test_example_trains_on_a_dataframe(spark, tmp_path) -> None:
    """examples/spark_torch_mnist.py's training function on data Spark wrote (2 epochs)."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    import importlib.util

    from sklearn.datasets import load_digits

    import hora.spark

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "examples", "spark_torch_mnist.py")
    spec = importlib.util.spec_from_file_location("spark_torch_mnist", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    digits = load_digits()
    rows = [(i, [float(v) for v in digits.data[i]], int(digits.target[i])) for i in range(1500)]
    df = spark.createDataFrame(rows, ["id", "features", "label"])
    df.repartition(2).write.json(str(tmp_path / "train"))
    spark.createDataFrame(
        [(i, [float(v) for v in digits.data[i]], int(digits.target[i])) for i in range(1500, 1797)],
        ["id", "features", "label"],
    ).write.json(str(tmp_path / "test"))
    accuracies = hora.spark.run(
        example.train,
        args=(str(tmp_path / "train"), str(tmp_path / "test"), 2, 32, 0.05),
        num_proc=2,
    )
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1] and accuracies[0] > 0.5


def test_torch_estimator_fits_and_transforms(spark, tmp_path) -> None:
    """TorchEstimator.fit writes the DataFrame to the store, trains on 2 ranks (history,
    checkpoint); TorchModel.transform adds the predictions."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("pyarrow")
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits

    from hora.spark.common.store import Store
    from hora.spark.torch import TorchEstimator

    digits = load_digits()
    rows = [
        ([float(v) for v in digits.data[i] / 16.0], int(digits.target[i]), i % 5 == 0)
        for i in range(len(digits.target))
    ]
    df = spark.createDataFrame(rows, ["features", "label", "is_val"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    store = Store.create(str(tmp_path))
    marks = str(tmp_path / "callbacks")

    def callback(epoch: int, metrics: dict) -> None:
        with open(marks, "a") as f:
            f.write(f"{epoch} {sorted(metrics)}\n")

    estimator = TorchEstimator(
        num_proc=2,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
        loss=torch.nn.functional.cross_entropy,
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=32,
        epochs=3,
        store=store,
        validation="is_val",
        callbacks=[callback],
        random_seed=1,
    )
    trained = estimator.fit(df)
    history = trained.getHistory()
    assert len(history) == 3 and history[-1]["train_loss"] < history[0]["train_loss"]
    assert "val_loss" in history[0]
    assert os.path.exists(store.get_checkpoint_path(trained.run_id))
    assert os.path.isdir(store.get_train_data_path())
    out = trained.transform(df.filter(df.is_val)).collect()
    assert len(out) == len([r for r in rows if r[2]])
    right = sum(max(range(10), key=lambda k: r["label__output"][k]) == r["label"] for r in out)
    assert right / len(out) > 0.5
    with open(marks) as f:  # each rank ran the callback after each epoch
        lines = sorted(f.read().splitlines())
    assert lines == sorted(f"{e} ['train_loss', 'val_loss']" for e in (0, 0, 1, 1, 2, 2))


def test_keras_estimator_fits_and_transforms(spark, tmp_path) -> None:
    """KerasEstimator.fit writes the DataFrame to the store, trains with hora.tensorflow.keras
    on 2 ranks (history with averaged metrics, checkpoint, callbacks); KerasModel.transform
    adds the predictions."""
    pytest.importorskip("tensorflow", reason="tensorflow is not installed (hora[tensorflow])")
    pytest.importorskip("pyarrow")
    pytest.importorskip("sklearn")
    import tensorflow as tf
    from sklearn.datasets import load_digits

    from hora.spark.common.store import Store
    from hora.spark.keras import KerasEstimator, KerasModel

    digits = load_digits()
    rows = [
        ([float(v) for v in digits.data[i] / 16.0], int(digits.target[i]), i % 5 == 0)
        for i in range(len(digits.target))
    ]
    df = spark.createDataFrame(rows, ["features", "label", "is_val"])
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential(
        [
            tf.keras.Input((64,)),
            tf.keras.layers.Dense(32, activation="relu"),
            tf.keras.layers.Dense(10, activation="softmax"),
        ]
    )
    store = Store.create(str(tmp_path))
    marks = str(tmp_path / "callbacks")

    class Mark(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            with open(marks, "a") as f:
                f.write(f"{epoch}\n")

    estimator = KerasEstimator(
        num_proc=2,
        model=model,
        optimizer=tf.keras.optimizers.SGD(learning_rate=0.1, momentum=0.5),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=32,
        epochs=3,
        store=store,
        validation="is_val",
        callbacks=[Mark()],
        random_seed=1,
    )
    trained = estimator.fit(df)
    assert isinstance(trained, KerasModel)
    history = trained.getHistory()
    assert len(history) == 3 and history[-1]["train_loss"] < history[0]["train_loss"]
    assert {"val_loss", "train_accuracy", "val_accuracy"} <= set(history[0])
    checkpoint = os.path.join(store.get_run_path(trained.run_id), "checkpoint.keras")
    assert os.path.exists(checkpoint)
    out = trained.transform(df.filter(df.is_val)).collect()
    assert len(out) == len([r for r in rows if r[2]])
    right = sum(max(range(10), key=lambda k: r["label__output"][k]) == r["label"] for r in out)
    assert right / len(out) > 0.5
    with open(marks) as f:  # each rank ran the callback after each epoch
        assert sorted(f.read().splitlines()) == ["0", "0", "1", "1", "2", "2"]
