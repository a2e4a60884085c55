"""The TensorFlow examples end to end under ``hora run -np 2``: the GradientTape loop, the
Keras ``fit`` with Horovod's callbacks and the TensorFlow 1 MonitoredTrainingSession must print
Horovod's lines and learn the digits (no MNIST files here, so they train on scikit-learn's
digits); the synthetic benchmark, under hora and
under MultiWorkerMirroredStrategy, must print Horovod's throughput lines."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None,
    reason="tensorflow is not installed (pip install 'hora[tensorflow]')",
)

ROOT = Path(__file__).resolve().parents[2]
HORA = [sys.executable, "-c", "import sys; from hora.launch.cli import main; sys.exit(main())"]


def hora_run(np_: int, script: str, *args: str, timeout: float) -> str:
    argv = [*HORA, "run", "-np", str(np_), sys.executable, str(ROOT / "examples" / script), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, (
        f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


@pytest.mark.timeout(300)
def test_tensorflow2_mnist_gradient_tape(tmp_path: Path) -> None:
    out = hora_run(2, "tensorflow2_mnist.py", "--data-dir", str(tmp_path), "--steps", "200",
                   timeout=280)  # fmt: skip
    assert "Dataset: scikit-learn digits" in out
    assert re.search(r"\[0\]<stdout>:Step #90\tLoss: \d+\.\d{6}", out), out[-2000:]
    accuracy = re.search(r"Test accuracy: (\d+\.\d\d)%", out)
    assert accuracy and float(accuracy.group(1)) >= 90.0, out[-2000:]


@pytest.mark.timeout(300)
def test_tensorflow2_keras_mnist_fit_with_callbacks(tmp_path: Path) -> None:
    out = hora_run(2, "tensorflow2_keras_mnist.py", "--data-dir", str(tmp_path),
                   "--checkpoint-dir", str(tmp_path / "ck"), "--steps-per-epoch", "50",
                   timeout=280)  # fmt: skip
    assert "Epoch 1: finished gradual learning rate warmup to" in out
    assert "[1]<stdout>:Epoch" not in out  # rank 0 alone reports progress
    assert sorted(p.name for p in (tmp_path / "ck").iterdir())[-1] == "checkpoint-4.keras"
    accuracy = re.search(r"Test accuracy: (\d+\.\d\d)%", out)
    assert accuracy and float(accuracy.group(1)) >= 90.0, out[-2000:]


@pytest.mark.timeout(200)
def test_tensorflow1_mnist_monitored_session(tmp_path: Path) -> None:
    """TensorFlow 1 graphs: MonitoredTrainingSession, BroadcastGlobalVariablesHook,
    DistributedOptimizer over tf.compat.v1's Adam, checkpoints written by rank 0 alone."""
    ck = tmp_path / "ck"
    out = hora_run(2, "tensorflow_mnist.py", "--data-dir", str(tmp_path), "--checkpoint-dir",
                   str(ck), "--steps", "160", timeout=180)  # fmt: skip
    assert "Dataset: scikit-learn digits" in out
    assert re.search(r"\[0\]<stdout>:Step #70\tLoss: \d+\.\d{6}", out), out[-2000:]
    assert "[1]<stdout>:Step" not in out  # rank 0 alone reports progress
    assert (ck / "model.ckpt-80.index").is_file(), sorted(p.name for p in ck.iterdir())
    accuracy = re.search(r"Test accuracy: (\d+\.\d\d)%", out)
    assert accuracy and float(accuracy.group(1)) >= 90.0, out[-2000:]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("extra", [["--fp16-allreduce"], ["--mwms"]], ids=["hora", "mwms"])
def test_tensorflow2_synthetic_benchmark_prints_horovods_lines(extra: list[str]) -> None:
    out = hora_run(2, "tensorflow2_synthetic_benchmark.py", "--model", "mlp", "--batch-size",
                   "8", "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
                   "--num-iters", "2", *extra, timeout=180)  # fmt: skip
    assert "Model: mlp" in out and "Number of CPUs: 2" in out
    assert ("MultiWorkerMirroredStrategy" in out) == ("--mwms" in extra)
    assert len(re.findall(r"Iter #\d+: \d+\.\d img/sec per CPU", out)) == 2
    total = re.search(r"Total img/sec on 2 CPU\(s\): (\d+\.\d) \+-\d+\.\d", out)
    assert total and float(total.group(1)) > 0
