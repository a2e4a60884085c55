"""Elastic TensorFlow/Keras: the state classes on real ranks, and a Keras job under
``hora run --min-np`` that loses a worker and finishes from the last commit."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import numpy as np
import pytest

from harness import run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None,
    reason="tensorflow is not installed (pip install 'hora[tensorflow]')",
)

HORA = [sys.executable, "-c", "import sys; from hora.launch.cli import main; sys.exit(main())"]


def _states(rank: int) -> str:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    import hora.tensorflow as hvd_tf
    import hora.tensorflow.keras as hvd

    try:
        hvd.init()
        tf.keras.utils.set_random_seed(10 + rank)  # the ranks start apart
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
        model.compile(optimizer=tf.keras.optimizers.Adam(0.1), loss="mse")
        state = hvd.elastic.KerasState(model, epoch=rank)
        state.sync()  # weights, a freshly built optimizer and epoch: rank 0's
        flat = lambda: np.concatenate([w.ravel() for w in model.get_weights()])  # noqa: E731
        everyone = hvd.allgather_object(flat().tolist())
        assert everyone[0] == everyone[1], everyone
        assert state.epoch == 0
        assert len(model.optimizer.variables) > 0
        saved = flat()
        model.fit(np.ones((4, 3)) * (rank + 1), np.zeros((4, 2)), verbose=0, epochs=1)
        state.epoch = 5
        assert not np.allclose(flat(), saved)
        state.restore()
        np.testing.assert_array_equal(flat(), saved)
        assert state.epoch == 0
        v = tf.Variable([float(rank)] * 3)
        tstate = hvd_tf.elastic.TensorFlowState([v], batch=rank)
        tstate.sync()
        assert v.numpy().tolist() == [0.0] * 3 and tstate.batch == 0
        v.assign([7.0] * 3)
        tstate.restore()
        assert v.numpy().tolist() == [0.0] * 3
        hvd.shutdown()
        return "ok"
    except Exception:
        return traceback.format_exc()


@pytest.mark.timeout(120)
def test_keras_and_tensorflow_states_sync_and_restore() -> None:
    for rank, result in enumerate(run_ranks(_states, 2, timeout=100)):
        assert result == "ok", f"rank {rank}:\n{result}"


WORKER = """
import os, signal, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np
import tensorflow as tf
import hora.tensorflow.keras as hvd

EPOCHS, KILL_AT, VICTIM = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ME = os.environ["HORA_ELASTIC_ID"]
hvd.init()
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.keras.utils.set_random_seed(hvd.rank())
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)), loss="mse")
x = np.random.default_rng(hvd.rank()).normal(size=(32, 4)).astype("float32")
y = x.sum(axis=1, keepdims=True)
state = hvd.elastic.KerasState(model, epoch=0)
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])


class Kill(tf.keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if state.epoch == KILL_AT and ME == VICTIM:
            os.kill(os.getpid(), signal.SIGKILL)


@hvd.elastic.run
def train(state):
    state.model.fit(x, y, batch_size=8, epochs=EPOCHS - state.epoch, verbose=0, shuffle=False,
                    callbacks=[Kill(), hvd.elastic.CommitStateCallback(state),
                               hvd.elastic.UpdateBatchStateCallback(state),
                               hvd.elastic.UpdateEpochStateCallback(state)])


train(state)
weights = np.concatenate([w.ravel() for w in model.get_weights()]).tolist()
same = all(w == weights for w in hvd.allgather_object(weights))
print(f"DONE id={ME} rank={hvd.rank()} size={hvd.size()} epoch={state.epoch} "
      f"same={same} resets={resets}", flush=True)
hvd.shutdown()
"""


@pytest.mark.timeout(200)
def test_a_killed_worker_in_a_keras_job_and_the_rest_finish(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    # two "hosts" (a failed worker's host is blacklisted): the victim is 127.0.0.1's worker
    flags = ["-np", "3", "--min-np", "2", "-H", "localhost:2,127.0.0.1:1",
             "--elastic-timeout", "60"]  # fmt: skip
    proc = subprocess.run([*HORA, "run", *flags, sys.executable, str(script), "4", "2",
                           "127.0.0.1:0"], capture_output=True, text=True, timeout=190)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    done = [ln.split("DONE ", 1)[1] for ln in out.splitlines() if "DONE " in ln]
    assert sorted(ln.split()[0] for ln in done) == ["id=localhost:0", "id=localhost:1"], out[-4000:]
    for line in done:
        assert "size=2 epoch=4 same=True resets=[2]" in line, out[-4000:]
    assert "(127.0.0.1:0) exited with 137" in out, out[-4000:]
    assert "a collective failed (" in out, out[-4000:]
    assert "a collective failed (Graph execution error" not in out  # hora's message, not TF's


