"""``hora run -np 2`` of a small TensorFlow program: TensorFlow's start-up notes (absl's banner,
oneDNN, the CUDA driver and CPU-instruction notes, the cuInit error on a machine without a
driver) are absent from the console by default, while the program's own stderr lines and
TensorFlow's Python warnings pass; ``--tf-logs`` or ``HORA_TF_LOGS=1`` brings the notes back."""

from __future__ import annotations

import importlib.util
import os
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
PROGRAM = """
import sys
import tensorflow as tf
import hora.tensorflow as hvd

hvd.init()
total = hvd.allreduce(tf.constant(float(hvd.rank() + 1)), op=hvd.Sum)
print("sum", float(total), flush=True)
print("my own note on stderr", file=sys.stderr, flush=True)
tf.get_logger().warning("a warning of the program")
"""
NOTES = ["absl::InitializeLog()", "oneDNN custom operations", "cpu_feature_guard",
         "To enable the following instructions"]  # fmt: skip


def run(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[str, str]:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    environ = {k: v for k, v in os.environ.items()
               if k not in ("TF_CPP_MIN_LOG_LEVEL", "HORA_TF_LOGS", "HOROVOD_TF_LOGS")}
    environ.update(env or {})
    done = subprocess.run([*HORA, "run", "-np", "2", *flags, sys.executable, str(script)],
                          capture_output=True, text=True, timeout=100, cwd=ROOT,
                          env=environ)  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    for r in range(2):
        assert f"[{r}]<stdout>:sum 3.0" in done.stdout, done.stdout
        assert f"[{r}]<stderr>:my own note on stderr" in done.stderr, done.stderr
        warning = f"[{r}]<stderr>:WARNING:tensorflow:a warning of the program"
        assert warning in done.stderr, done.stderr
    return done.stdout, done.stderr


@pytest.mark.timeout(120)
def test_tensorflow_notes_hidden_by_default(tmp_path: Path) -> None:
    _, err = run(tmp_path)
    shown = [n for n in NOTES if n in err]
    assert not shown, err
    assert "Could not find cuda drivers" not in err and "failed call to cuInit" not in err, err


@pytest.fixture(scope="module")
def notes_here() -> list[str]:
    """The notes TensorFlow prints at import on this machine, unfiltered: which ones depends on
    the CPU (the oneDNN note only where oneDNN is on by default: AVX-512 VNNI, AMX, ...)."""
    environ = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", "import tensorflow"], capture_output=True,
                          text=True, timeout=100, env=environ)  # fmt: skip
    assert done.returncode == 0, done.stderr
    here = [n for n in NOTES if n in done.stderr]
    assert NOTES[0] in here, done.stderr  # absl's banner, printed everywhere
    return here


@pytest.mark.timeout(240)
def test_tf_logs_knob_brings_them_back(tmp_path: Path, notes_here: list[str]) -> None:
    # the flag; HORA_TF_LOGS=1 reaches the same knob (tests/unit/launch/test_quiet.py)
    _, err = run(tmp_path, "--tf-logs")
    for r in range(2):
        assert f"[{r}]<stderr>:WARNING: All log messages before absl::InitializeLog()" in err
    shown = [n for n in NOTES if n in err]
    assert shown == notes_here, err
