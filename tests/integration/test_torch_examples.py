"""The examples end to end under ``hora run``: the main job and the synthetic benchmark.

The main job is the README's command: ``hora run -np 2 python examples/pytorch_mnist.py`` with
default flags must print Horovod's lines and end at >= 95% test accuracy (no MNIST files here,
so it trains on scikit-learn's digits). The benchmark runs every model briefly, under hora and
under torch DDP, and must print Horovod's throughput lines.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HORA = [sys.executable, "-c", "import sys; from hora.launch.cli import main; sys.exit(main())"]


def hora_run(np_: int, script: str, *args: str, timeout: float) -> str:
    argv = [*HORA, "run", "-np", str(np_), sys.executable, str(ROOT / "examples" / script), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, (
        f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


@pytest.mark.timeout(400)
def test_main_job_mnist_two_ranks_reaches_95_percent(tmp_path: Path) -> None:
    out = hora_run(2, "pytorch_mnist.py", "--data-dir", str(tmp_path), timeout=380)
    assert "Dataset: scikit-learn digits" in out
    for rank in (0, 1):
        assert re.search(
            rf"\[{rank}\]<stdout>:Train Epoch: 10 \[\d+/\d+ \(\d+%\)\]\tLoss: \d+\.\d{{6}}", out
        )
    accuracies = re.findall(r"Test set: Average loss: \d+\.\d{4}, Accuracy: (\d+\.\d{2})%", out)
    assert len(accuracies) == 10, out[-2000:]
    assert float(accuracies[-1]) >= 95.0, accuracies


BENCH = [
    "--batch-size",
    "8",
    "--num-warmup-batches",
    "1",
    "--num-batches-per-iter",
    "2",
    "--num-iters",
    "2",
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("np_", "model", "extra"),
    [
        (2, "mlp", []),
        (2, "mlp", ["--ddp"]),
        (2, "cnn", ["--fp16-allreduce"]),
        (2, "lstm", []),
        (1, "resnet50", ["--batch-size", "1"]),
    ],
)
def test_synthetic_benchmark_prints_horovods_lines(np_: int, model: str, extra: list[str]) -> None:
    out = hora_run(
        np_, "pytorch_synthetic_benchmark.py", "--model", model, *BENCH, *extra, timeout=280
    )
    assert f"Model: {model}" in out and f"Number of CPUs: {np_}" in out
    assert len(re.findall(r"Iter #\d+: \d+\.\d img/sec per CPU", out)) == 2
    assert re.search(r"Img/sec per CPU: \d+\.\d \+-\d+\.\d", out)
    total = re.search(rf"Total img/sec on {np_} CPU\(s\): (\d+\.\d) \+-\d+\.\d", out)
    assert total and float(total.group(1)) > 0
    assert ("torch DDP" in out) == ("--ddp" in extra)
