"""tf.keras ``BestModelCheckpoint(save_weights_only=True)`` saves the weights alone (Keras'
meaning), and ``SyncBatchNormalization`` refuses the fused kernel as Horovod does. In this
process, without starting any rank (a checkpoint and an unsynchronised layer need none)."""

from __future__ import annotations

import os
import zipfile

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip(
    "tensorflow", reason="tensorflow is not installed (pip install 'hora[tensorflow]')"
)

import hora.tensorflow as htf  # noqa: E402
from hora.tensorflow.keras.callbacks import BestModelCheckpoint  # noqa: E402

keras = tf.keras


def _model() -> object:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _fit(model: object, checkpoint: BestModelCheckpoint, epochs: int = 2) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 3)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
    model.fit(x, y, epochs=epochs, batch_size=8, verbose=0, callbacks=[checkpoint])  # type: ignore[attr-defined]


def test_save_weights_only_saves_the_weights_alone(tmp_path) -> None:
    path = str(tmp_path / "best.weights.h5")
    model = _model()
    checkpoint = BestModelCheckpoint(monitor="loss", save_weights_only=True, filepath=path)
    assert checkpoint.save_weights_only and checkpoint.save_best_only
    # one epoch, so the best one is the last: after two, the file holds the first epoch's
    # weights whenever Keras did not count the second as better (it once did not, in a full
    # run of the tests, though 60 fits alone all improved)
    _fit(model, checkpoint, epochs=1)
    assert os.path.exists(path)
    with pytest.raises((ValueError, OSError)):  # no architecture in the file
        keras.models.load_model(path)
    fresh = _model()
    fresh.load_weights(path)  # type: ignore[attr-defined]
    for a, b in zip(fresh.get_weights(), model.get_weights(), strict=True):  # type: ignore[attr-defined]
        np.testing.assert_array_equal(a, b)


def test_the_default_saves_the_whole_model(tmp_path) -> None:
    path = str(tmp_path / "best.keras")
    model = _model()
    _fit(model, BestModelCheckpoint("loss", 0, False, filepath=path))  # Horovod's order
    assert zipfile.is_zipfile(path)
    restored = keras.models.load_model(path)
    assert restored.count_params() == model.count_params()  # type: ignore[attr-defined]
    assert BestModelCheckpoint(save_weights_only=True).filepath == "best_model.weights.h5"
    assert BestModelCheckpoint().filepath == "best_model.keras"


def test_sync_batch_normalization_takes_fused_false_only() -> None:
    for fused in (True, None):
        with pytest.raises(ValueError, match="fused=False"):
            htf.SyncBatchNormalization(fused)
    layer = htf.SyncBatchNormalization(False, momentum=0.5)
    assert layer.momentum == 0.5  # BatchNormalization's keywords after fused
    with pytest.raises(TypeError):  # nothing positional after fused
        htf.SyncBatchNormalization(False, -1)
