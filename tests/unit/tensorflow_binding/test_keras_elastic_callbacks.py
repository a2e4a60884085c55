"""The Keras elastic callbacks' bookkeeping across resets (hora.tensorflow.keras and hora.keras),
in this process with a state that counts commits; no rank is started.

The callbacks are made once and given to every ``fit`` of the elastic function, as in Horovod's
examples, so what one ``fit`` leaves in them must not change the next one's commits.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
pytest.importorskip(
    "tensorflow", reason="tensorflow is not installed (pip install 'hora[tensorflow]')"
)

import hora.keras as hk  # noqa: E402
import hora.tensorflow.keras as hvk  # noqa: E402
from hora.errors import HostsUpdatedInterrupt  # noqa: E402


class CountingState:
    """Counts commits; the commits listed in ``interrupt_at`` raise HostsUpdatedInterrupt."""

    def __init__(self, interrupt_at: tuple[int, ...] = ()) -> None:
        self.commits = 0
        self.interrupt_at = interrupt_at
        self.batch = 0
        self.epoch = 0

    def commit(self) -> None:
        self.commits += 1
        if self.commits in self.interrupt_at:
            raise HostsUpdatedInterrupt(False)


@pytest.mark.parametrize("module", [hvk, hk], ids=["tensorflow.keras", "keras"])
@pytest.mark.parametrize("every", [1, 2])
def test_the_batch_count_starts_again_at_each_fit(module, every: int) -> None:
    state = CountingState(interrupt_at=(1,))
    callback = module.elastic.CommitStateCallback(state, batches_per_commit=every)
    callback.on_train_begin()
    for batch in range(every - 1):
        callback.on_train_batch_end(batch)
    with pytest.raises(HostsUpdatedInterrupt):  # the job re-forms; fit is called again
        callback.on_train_batch_end(every - 1)
    callback.on_train_begin()
    for batch in range(3 * every):
        callback.on_train_batch_end(batch)
    assert state.commits == 1 + 3  # a commit every `every` batches, as on a new worker


@pytest.mark.parametrize("module", [hvk, hk], ids=["tensorflow.keras", "keras"])
def test_the_first_epoch_after_a_reset_is_told_the_batches_left(module) -> None:
    state = CountingState()
    callback = module.elastic.UpdateBatchStateCallback(state)
    callback.set_params({"steps": 5, "epochs": 3})
    callback.on_train_begin()
    callback.on_epoch_begin(0)
    assert callback.params["steps"] == 5
    for batch in range(3):
        callback.on_train_batch_end(batch)
    assert state.batch == 2
    # a reset after batch 2: the next fit's first epoch has 5 - 2 batches left
    callback.set_params({"steps": 5, "epochs": 3})
    callback.on_train_begin()
    callback.on_epoch_begin(0)
    assert callback.params["steps"] == 3
    callback.on_epoch_end(0)
    assert state.batch == 0
    callback.on_epoch_begin(1)
    assert callback.params["steps"] == 5


@pytest.mark.parametrize("kind", ["tf_keras", "tf_keras legacy", "keras"])
def test_a_new_workers_optimizer_has_the_slots_of_a_trained_one(kind: str) -> None:
    """KerasState builds the optimizer before a sync, so that a new worker (whose optimizer
    never ran a step) broadcasts as many variables as the workers that trained: tf_keras's
    optimizer has no ``built`` (only ``_built`` once built), its legacy one neither."""
    import numpy as np

    if kind.startswith("tf_keras"):
        keras = pytest.importorskip("tf_keras")
        sgd = keras.optimizers.legacy.SGD if kind.endswith("legacy") else keras.optimizers.SGD
    else:
        import keras

        sgd = keras.optimizers.SGD

    def fresh():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=sgd(0.1, momentum=0.9), loss="mse")
        return model

    def variables(opt):
        vs = opt.variables
        return list(vs() if callable(vs) else vs)

    trained = fresh()
    trained.fit(np.ones((2, 3)), np.zeros((2, 2)), verbose=0)
    new = fresh()
    hvk.elastic.KerasState(new)._build_optimizer()
    shapes = [tuple(v.shape) for v in variables(trained.optimizer)]
    assert [tuple(v.shape) for v in variables(new.optimizer)] == shapes
