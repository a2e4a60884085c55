"""``KerasEstimator.fit(df)`` trains a Keras model with hora.tensorflow.keras inside Spark tasks
and returns a :class:`KerasModel` whose ``transform(df)`` adds the model's predictions.

``fit`` (shared with the other estimators: :mod:`hora.spark.common.estimator`) writes the
feature and label columns to the store as Parquet through Spark, then :func:`hora.spark.run`
starts ``num_proc`` ranks; each reads its shard with pyarrow, rebuilds the model (saved in
Keras' format) and the optimizer (from its config), wraps the optimizer in
``hvd.DistributedOptimizer``, and runs ``model.fit`` with rank 0's initial weights broadcast
and the epoch's metrics averaged over the ranks; rank 0 saves the model in the store after
each epoch and returns the trained weights. Methods run in the driver's calling thread; the
training function runs in the ranks.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

from hora.spark.common.estimator import EstimatorBase, ModelBase, columns, read_shard
from hora.spark.common.store import Store


def _model_bytes(model: Any) -> bytes:
    """``model`` in Keras' ``.keras`` format, as bytes."""
    with tempfile.TemporaryDirectory(prefix="hora-keras-") as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def _load_model(data: bytes, custom_objects: dict[str, Any] | None) -> Any:
    """The model saved by :func:`_model_bytes`, uncompiled."""
    import tensorflow as tf

    with tempfile.TemporaryDirectory(prefix="hora-keras-") as tmp:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return tf.keras.models.load_model(path, custom_objects=custom_objects, compile=False)


def _train(payload: bytes, spec: dict[str, Any]) -> dict[str, Any] | None:
    """One rank's training (runs in a Spark task's rank); rank 0 returns the weights."""
    import numpy as np
    import tensorflow as tf

    import hora.tensorflow.keras as hvd

    hvd.init()
    model_data, opt_config, loss, metrics, callbacks, custom_objects = cloudpickle.loads(payload)
    if spec["seed"] is not None:
        tf.keras.utils.set_random_seed(spec["seed"])
    model = _load_model(model_data, custom_objects)
    optimizer = tf.keras.optimizers.deserialize(opt_config, custom_objects=custom_objects)
    model.compile(
        optimizer=hvd.DistributedOptimizer(optimizer), loss=loss, metrics=list(metrics)
    )

    def load(path: str) -> tuple[Any, Any]:
        table = read_shard(path, spec["features"] + spec["labels"], hvd.rank(), hvd.size())
        x = columns(table, spec["features"]).astype(np.float32)
        y = columns(table, spec["labels"])
        return x, (y[:, 0] if y.shape[1] == 1 else y)

    x, y = load(spec["train_path"])
    batch = spec["batch_size"]
    # every rank takes the same number of steps: shards differ by at most one row
    steps = int(hvd.allreduce(np.array(max(len(y) // batch, 1)), op=hvd.Min))
    x, y = x[: steps * batch], y[: steps * batch]
    val = load(spec["val_path"]) if spec["val_path"] else None
    if val is not None and int(hvd.allreduce(np.array(len(val[1])), op=hvd.Min)) == 0:
        val = None  # a rank without validation rows: no rank validates (same steps everywhere)
    hooks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        *callbacks,
    ]
    checkpoint = spec["checkpoint"]
    if hvd.rank() == 0 and checkpoint:
        os.makedirs(os.path.dirname(checkpoint), exist_ok=True)
        save = tf.keras.callbacks.LambdaCallback(on_epoch_end=lambda e, l: model.save(checkpoint))
        hooks.append(save)
    fit = model.fit(
        x, y, batch_size=batch, epochs=spec["epochs"], validation_data=val, callbacks=hooks,
        shuffle=True, verbose=0,
    )  # fmt: skip
    names = sorted(fit.history)
    history = [
        {"train_" + k if not k.startswith("val_") else k: float(fit.history[k][e]) for k in names}
        for e in range(spec["epochs"])
    ]
    out = None
    if hvd.rank() == 0:
        out = {"weights": [np.asarray(w) for w in model.get_weights()], "history": history}
    hvd.shutdown()
    return out


class KerasEstimator(EstimatorBase):
    """Train a Keras ``model`` on a DataFrame (``horovod.spark.keras.KerasEstimator``'s main
    params).

    ``model``: a built Keras model (``tf.keras``); ``optimizer``: a Keras optimizer, rebuilt in
    each rank from its config; ``loss``: a loss name, function or ``Loss`` object;
    ``metrics``: metric names or objects, reported in the history (as ``train_<name>`` and
    ``val_<name>``, averaged over the ranks). ``callbacks``: Keras callbacks run by
    ``model.fit`` in every rank. ``custom_objects``: what the model, loss or optimizer need to
    be loaded. Each run's model goes to the store as ``checkpoint.keras`` after each epoch.
    Feature and label columns, ``validation``, ``store``, ``batch_size`` and ``epochs`` as in
    :class:`hora.spark.torch.TorchEstimator`.
    """

    checkpoint_name = "checkpoint.keras"

    def __init__(
        self,
        num_proc: int | None = None,
        model: Any = None,
        optimizer: Any = None,
        loss: Any = None,
        metrics: Sequence[Any] = (),
        feature_cols: Sequence[str] = (),
        label_cols: Sequence[str] = (),
        batch_size: int = 32,
        epochs: int = 1,
        store: Store | None = None,
        validation: float | str | None = None,
        callbacks: Sequence[Any] = (),
        custom_objects: dict[str, Any] | None = None,
        verbose: int = 1,
        random_seed: int | None = None,
        run_id: str | None = None,
    ):
        super().__init__(
            num_proc=num_proc, model=model, optimizer=optimizer, loss=loss,
            feature_cols=feature_cols, label_cols=label_cols, batch_size=batch_size,
            epochs=epochs, store=store, validation=validation, callbacks=callbacks,
            verbose=verbose, random_seed=random_seed, run_id=run_id,
        )  # fmt: skip
        self.metrics = list(metrics)
        self.custom_objects = custom_objects

    def _train_fn(self) -> Callable[[bytes, dict[str, Any]], Any]:
        return _train

    def _payload(self) -> bytes:
        import tensorflow as tf

        return cloudpickle.dumps((
            _model_bytes(self.model), tf.keras.optimizers.serialize(self.optimizer),
            self.loss, self.metrics, self.callbacks, self.custom_objects,
        ))  # fmt: skip

    def _trained(self, result: dict[str, Any], run_id: str) -> KerasModel:
        trained = _load_model(_model_bytes(self.model), self.custom_objects)
        trained.set_weights(result["weights"])
        return KerasModel(
            trained, self.feature_cols, self.label_cols, result["history"], run_id,
            custom_objects=self.custom_objects,
        )  # fmt: skip

    def fit(self, df: Any) -> KerasModel:
        """Write ``df``'s columns to the store, train on ``num_proc`` ranks, return the model."""
        model: KerasModel = super().fit(df)
        return model


class _KerasPredictor:
    """Picklable: the model's output for a float32 matrix (loads the model once per task)."""

    def __init__(self, model: Any, custom_objects: dict[str, Any] | None):
        self.model_bytes = _model_bytes(model)
        self.custom_objects = custom_objects
        self._model: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_model": None}

    def __call__(self, matrix: Any) -> Any:
        import numpy as np

        if self._model is None:
            self._model = _load_model(self.model_bytes, self.custom_objects)
        out = np.asarray(self._model(matrix, training=False))
        return out.astype(np.float64).reshape(len(matrix), -1)


class KerasModel(ModelBase):
    """A trained Keras model: ``transform(df)`` adds one ``<label>__output`` column per label
    column (or the names in ``output_cols``) with the model's output for each row."""

    def __init__(
        self,
        model: Any,
        feature_cols: Sequence[str],
        label_cols: Sequence[str],
        history: list[dict[str, float]],
        run_id: str,
        output_cols: Sequence[str] | None = None,
        custom_objects: dict[str, Any] | None = None,
    ):
        super().__init__(model, feature_cols, label_cols, history, run_id, output_cols)
        self.custom_objects = custom_objects

    def _predictor(self) -> Callable[[Any], Any]:
        return _KerasPredictor(self.model, self.custom_objects)
