"""The estimators' argument checks (no Spark, no framework needed: they run before either)."""

from __future__ import annotations

import pytest

from hora.spark.keras import KerasEstimator
from hora.spark.torch import TorchEstimator


@pytest.mark.parametrize("cls", [TorchEstimator, KerasEstimator])
def test_estimator_needs_model_optimizer_loss_and_columns(cls) -> None:
    with pytest.raises(ValueError, match=f"{cls.__name__} needs model, optimizer and loss"):
        cls(model=object(), optimizer=object(), feature_cols=["x"], label_cols=["y"])
    with pytest.raises(ValueError, match=f"{cls.__name__} needs feature_cols and label_cols"):
        cls(model=object(), optimizer=object(), loss=object(), feature_cols=["x"])
    with pytest.raises(ValueError, match=r"validation=1.5: a fraction must be in \(0, 1\)"):
        cls(
            model=object(), optimizer=object(), loss=object(), feature_cols=["x"],
            label_cols=["y"], validation=1.5,
        )  # fmt: skip


def test_keras_estimator_keeps_metrics_and_custom_objects() -> None:
    est = KerasEstimator(
        model=object(), optimizer=object(), loss="mse", metrics=["mae"], feature_cols=["x"],
        label_cols=["y"], custom_objects={"k": int}, epochs=4,
    )  # fmt: skip
    assert (est.metrics, est.custom_objects, est.epochs, est.batch_size) == (
        ["mae"], {"k": int}, 4, 32,
    )  # fmt: skip
