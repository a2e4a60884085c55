"""What the framework estimators share: the parameters, ``fit``'s data preparation (the
DataFrame written to the store as Parquet through Spark), the ranks' shard reading, and the
trained model's ``transform`` (predictions added as columns, one batch per partition chunk).

A framework estimator (``hora.spark.torch``, ``hora.spark.keras``) supplies the training
function run in the ranks, its payload (model, optimizer, loss, callbacks), and how the
driver rebuilds the trained model from rank 0's result; its model class supplies a picklable
predictor ``predict(matrix) -> matrix``. Methods run in the driver's calling thread; the
training function and the predictor run in Spark tasks.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from hora.spark.common.store import LocalStore, Store
from hora.spark.runner import run

# rows handed to the predictor at once by ``transform``
_PREDICT_CHUNK = 1024


def columns(table: Any, names: Sequence[str]) -> Any:
    """The named columns of a pyarrow table as one float or int matrix (rows x values)."""
    import numpy as np

    parts = []
    for name in names:
        values = np.asarray(table.column(name).to_pylist())
        parts.append(values.reshape(len(values), -1))
    return np.hstack(parts)


def read_shard(path: str, cols: Sequence[str], rank: int, size: int) -> Any:
    """Rank ``rank``'s shard (every ``size``-th row) of the Parquet data at ``path``."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=list(cols))
    return table.take(list(range(rank, table.num_rows, size)))


def feature_matrix(rows: Sequence[Any], features: Sequence[str]) -> Any:
    """Spark rows' feature columns concatenated into one float32 matrix (rows x values)."""
    import numpy as np

    return np.stack(
        [np.hstack([np.asarray(r[c], dtype=np.float32).ravel() for c in features]) for r in rows]
    )


class EstimatorBase:
    """The parameters and ``fit`` of every framework estimator (Horovod's main params).

    ``feature_cols`` are numeric or array columns, concatenated into one input vector;
    ``label_cols`` the targets (one integer column: class indices). ``validation``: a
    fraction of the rows held out, or the name of a boolean column marking them.
    ``store``: a :class:`Store` (default a :class:`LocalStore` in a temporary directory),
    where the data and each run's checkpoint go.
    """

    def __init__(
        self,
        num_proc: int | None = None,
        model: Any = None,
        optimizer: Any = None,
        loss: Any = None,
        feature_cols: Sequence[str] = (),
        label_cols: Sequence[str] = (),
        batch_size: int = 32,
        epochs: int = 1,
        store: Store | None = None,
        validation: float | str | None = None,
        callbacks: Sequence[Any] = (),
        verbose: int = 1,
        random_seed: int | None = None,
        run_id: str | None = None,
    ):
        name = type(self).__name__
        if model is None or optimizer is None or loss is None:
            raise ValueError(f"{name} needs model, optimizer and loss")
        if not feature_cols or not label_cols:
            raise ValueError(f"{name} needs feature_cols and label_cols")
        if isinstance(validation, float) and not 0.0 < validation < 1.0:
            raise ValueError(f"validation={validation}: a fraction must be in (0, 1)")
        self.num_proc = num_proc
        self.model = model
        self.optimizer = optimizer
        self.loss = loss
        self.feature_cols = list(feature_cols)
        self.label_cols = list(label_cols)
        self.batch_size = batch_size
        self.epochs = epochs
        self.store = store
        self.validation = validation
        self.callbacks = list(callbacks)
        self.verbose = verbose
        self.random_seed = random_seed
        self.run_id = run_id

    # what a framework supplies
    checkpoint_name = "checkpoint"

    def _train_fn(self) -> Callable[[bytes, dict[str, Any]], Any]:
        raise NotImplementedError

    def _payload(self) -> bytes:
        raise NotImplementedError

    def _trained(self, result: dict[str, Any], run_id: str) -> Any:
        raise NotImplementedError

    def fit(self, df: Any) -> Any:
        """Write ``df``'s columns to the store, train on ``num_proc`` ranks, return the model."""
        import os

        missing = [c for c in self.feature_cols + self.label_cols if c not in df.columns]
        if missing:
            raise ValueError(f"{type(self).__name__}.fit: the DataFrame has no column {missing}")
        store = self.store or LocalStore(tempfile.mkdtemp(prefix="hora-store-"))
        if not isinstance(store, LocalStore):
            raise NotImplementedError(f"{type(store).__name__}: only LocalStore is supported")
        num_proc = self.num_proc or df.sparkSession.sparkContext.defaultParallelism
        run_id = self.run_id or f"run-{uuid.uuid4().hex[:8]}"
        cols = self.feature_cols + self.label_cols
        train_df, val_df = df, None
        if isinstance(self.validation, str):
            train_df = df.filter(~df[self.validation])
            val_df = df.filter(df[self.validation])
        elif self.validation:
            train_df, val_df = df.randomSplit(
                [1.0 - self.validation, self.validation], seed=self.random_seed
            )
        train_path = store.get_train_data_path()
        train_df.select(*cols).repartition(num_proc).write.mode("overwrite").parquet(
            store.to_spark_path(train_path)
        )
        val_path = None
        if val_df is not None:
            val_path = store.get_val_data_path()
            val_df.select(*cols).write.mode("overwrite").parquet(store.to_spark_path(val_path))
        checkpoint = None
        if store.saving_runs():
            checkpoint = os.path.join(store.get_run_path(run_id), self.checkpoint_name)
        spec = {
            "features": self.feature_cols,
            "labels": self.label_cols,
            "train_path": train_path,
            "val_path": val_path,
            "batch_size": self.batch_size,
            "epochs": self.epochs,
            "seed": self.random_seed,
            "checkpoint": checkpoint,
        }
        results = run(
            self._train_fn(), args=(self._payload(), spec), num_proc=num_proc,
            verbose=self.verbose,
        )  # fmt: skip
        return self._trained(results[0], run_id)


class ModelBase:
    """A trained model: ``transform(df)`` adds one ``<label>__output`` column per label column
    (or the names in ``output_cols``) with the model's output for each row."""

    def __init__(
        self,
        model: Any,
        feature_cols: Sequence[str],
        label_cols: Sequence[str],
        history: list[dict[str, float]],
        run_id: str,
        output_cols: Sequence[str] | None = None,
    ):
        self.model = model
        self.feature_cols = list(feature_cols)
        self.label_cols = list(label_cols)
        self.history = history
        self.run_id = run_id
        self.output_cols = list(output_cols or [f"{c}__output" for c in self.label_cols])

    def getModel(self) -> Any:  # noqa: N802  (Horovod's name)
        return self.model

    def getHistory(self) -> list[dict[str, float]]:  # noqa: N802  (Horovod's name)
        return self.history

    def _predictor(self) -> Callable[[Any], Any]:
        """A picklable ``predict(float32 matrix) -> float64 matrix`` (one row per input)."""
        raise NotImplementedError

    def transform(self, df: Any) -> Any:
        """``df`` with the prediction column(s) added: a double for a single output value,
        else an array of doubles (with several label columns, one output value each)."""
        from pyspark.sql.types import ArrayType, DoubleType, StructField, StructType

        features, outputs = self.feature_cols, self.output_cols
        predict = self._predictor()

        def values(out: Any) -> list[Any]:
            flat = [float(v) for v in out.ravel()]
            if len(outputs) > 1:
                return flat[: len(outputs)]
            return [flat[0] if len(flat) == 1 else flat]

        def predict_partition(rows: Any) -> Any:
            chunk: list[Any] = []
            for row in rows:
                chunk.append(row)
                if len(chunk) == _PREDICT_CHUNK:
                    yield from _with_outputs(chunk)
                    chunk = []
            if chunk:
                yield from _with_outputs(chunk)

        def _with_outputs(chunk: list[Any]) -> Any:
            out = predict(feature_matrix(chunk, features))
            for row, row_out in zip(chunk, out):
                yield (*row, *values(row_out))

        first = df.select(*features).first()
        width = len(predict(feature_matrix([first], features))[0].ravel()) if first else 1
        kind = DoubleType() if width == 1 or len(outputs) > 1 else ArrayType(DoubleType())
        schema = StructType(list(df.schema.fields) + [StructField(o, kind) for o in outputs])
        return df.sparkSession.createDataFrame(df.rdd.mapPartitions(predict_partition), schema)
