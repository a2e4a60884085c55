"""``TorchEstimator.fit(df)`` trains a PyTorch model with hora.torch inside Spark tasks and
returns a :class:`TorchModel` whose ``transform(df)`` adds the model's predictions.

``fit`` writes the feature and label columns to the store as Parquet through Spark, then
:func:`hora.spark.run` starts ``num_proc`` ranks; each reads its shard (every ``size``-th
row) with pyarrow, trains with ``hvd.DistributedOptimizer`` from rank 0's initial weights,
averages the epoch's losses over the ranks, and rank 0 saves a checkpoint in the store after
each epoch and returns the trained weights. Methods run in the driver's calling thread; the
training function runs in the ranks.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

from hora.spark.common.store import LocalStore, Store
from hora.spark.runner import run


def _columns(table: Any, names: Sequence[str]) -> Any:
    """The named columns of a pyarrow table as one float or int matrix (rows x values)."""
    import numpy as np

    parts = []
    for name in names:
        values = np.asarray(table.column(name).to_pylist())
        parts.append(values.reshape(len(values), -1))
    return np.hstack(parts)


def _read_shard(path: str, columns: Sequence[str], rank: int, size: int) -> Any:
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=list(columns))
    return table.take(list(range(rank, table.num_rows, size)))


def _train(payload: bytes, spec: dict[str, Any]) -> dict[str, Any] | None:
    """One rank's training (runs in a Spark task's rank); rank 0 returns the weights."""
    import os

    import torch

    import hora.torch as hvd

    hvd.init()
    model, opt_class, opt_defaults, loss_fn, callbacks = cloudpickle.loads(payload)
    if spec["seed"] is not None:
        torch.manual_seed(spec["seed"])
    optimizer = opt_class(model.parameters(), **opt_defaults)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def load(path: str) -> tuple[Any, Any]:
        table = _read_shard(path, spec["features"] + spec["labels"], hvd.rank(), hvd.size())
        x = torch.as_tensor(_columns(table, spec["features"]), dtype=torch.float32)
        y = torch.as_tensor(_columns(table, spec["labels"]))
        y = y.float() if y.is_floating_point() else y.long()
        return x, (y[:, 0] if y.shape[1] == 1 else y)

    x, y = load(spec["train_path"])
    val = load(spec["val_path"]) if spec["val_path"] else None
    batch = spec["batch_size"]
    # every rank takes the same number of steps: shards differ by at most one row
    steps = int(hvd.allreduce(torch.tensor(max(len(y) // batch, 1)), op=hvd.Min).item())
    history: list[dict[str, float]] = []
    for epoch in range(spec["epochs"]):
        model.train()
        order = torch.randperm(len(y))
        total = 0.0
        for step in range(steps):
            idx = order[step * batch : (step + 1) * batch]
            optimizer.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
        metrics = {"train_loss": float(hvd.allreduce(torch.tensor(total / steps)))}
        if val is not None:
            model.eval()
            with torch.no_grad():
                val_loss = float(loss_fn(model(val[0]), val[1])) if len(val[1]) else 0.0
            metrics["val_loss"] = float(hvd.allreduce(torch.tensor(val_loss)))
        history.append(metrics)
        for callback in callbacks:
            callback(epoch, dict(metrics))
        if hvd.rank() == 0 and spec["checkpoint"]:
            os.makedirs(os.path.dirname(spec["checkpoint"]), exist_ok=True)
            torch.save({"epoch": epoch, "model": model.state_dict()}, spec["checkpoint"])
    out = None
    if hvd.rank() == 0:
        out = {"state": {k: v.cpu() for k, v in model.state_dict().items()}, "history": history}
    hvd.shutdown()
    return out


class TorchEstimator:
    """Train ``model`` on a DataFrame (``horovod.spark.torch.TorchEstimator``'s main params).

    ``optimizer`` is an optimizer over ``model``'s parameters: each rank builds the same kind
    with the same settings (``optimizer.defaults``) over its copy. ``loss`` is a callable
    ``loss(output, label)``. ``feature_cols`` are numeric or array columns, concatenated into
    one input vector; ``label_cols`` the targets (one integer column: class indices).
    ``validation``: a fraction of the rows held out, or the name of a boolean column marking
    them. ``callbacks``: callables ``cb(epoch, metrics)`` run on every rank after each epoch
    (``metrics``: ``train_loss`` and ``val_loss``, averaged over the ranks). ``store``: a
    :class:`Store` (default a :class:`LocalStore` in a temporary directory), where the data and
    each run's checkpoint go.
    """

    def __init__(
        self,
        num_proc: int | None = None,
        model: Any = None,
        optimizer: Any = None,
        loss: Callable[..., Any] | None = None,
        feature_cols: Sequence[str] = (),
        label_cols: Sequence[str] = (),
        batch_size: int = 32,
        epochs: int = 1,
        store: Store | None = None,
        validation: float | str | None = None,
        callbacks: Sequence[Callable[[int, dict[str, float]], Any]] = (),
        verbose: int = 1,
        random_seed: int | None = None,
        run_id: str | None = None,
    ):
        if model is None or optimizer is None or loss is None:
            raise ValueError("TorchEstimator needs model, optimizer and loss")
        if not feature_cols or not label_cols:
            raise ValueError("TorchEstimator needs feature_cols and label_cols")
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

    def fit(self, df: Any) -> TorchModel:
        """Write ``df``'s columns to the store, train on ``num_proc`` ranks, return the model."""
        import tempfile

        missing = [c for c in self.feature_cols + self.label_cols if c not in df.columns]
        if missing:
            raise ValueError(f"TorchEstimator.fit: the DataFrame has no column {missing}")
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
        opt = self.optimizer
        payload = cloudpickle.dumps(
            (self.model, type(opt), dict(opt.defaults), self.loss, self.callbacks)
        )
        spec = {
            "features": self.feature_cols,
            "labels": self.label_cols,
            "train_path": train_path,
            "val_path": val_path,
            "batch_size": self.batch_size,
            "epochs": self.epochs,
            "seed": self.random_seed,
            "checkpoint": store.get_checkpoint_path(run_id) if store.saving_runs() else None,
        }
        results = run(_train, args=(payload, spec), num_proc=num_proc, verbose=self.verbose)
        trained = copy.deepcopy(self.model)
        trained.load_state_dict(results[0]["state"])
        return TorchModel(
            trained, self.feature_cols, self.label_cols, results[0]["history"], run_id
        )


class TorchModel:
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

    def transform(self, df: Any) -> Any:
        """``df`` with the prediction column(s) added: a double for a single output value,
        else an array of doubles (with several label columns, one output value each)."""
        from pyspark.sql.types import ArrayType, DoubleType, StructField, StructType

        features, outputs = self.feature_cols, self.output_cols
        model_bytes = cloudpickle.dumps(self.model)

        def predict(rows: Any) -> Any:
            import numpy as np
            import torch

            model = cloudpickle.loads(model_bytes)
            model.eval()
            for row in rows:
                vector = np.hstack([np.asarray(row[c], dtype=np.float32).ravel() for c in features])
                with torch.no_grad():
                    out = model(torch.as_tensor(vector)[None])[0].double().ravel().tolist()
                if len(outputs) > 1:
                    values = [float(v) for v in out[: len(outputs)]]
                else:
                    values = [float(out[0]) if len(out) == 1 else out]
                yield (*row, *values)

        first = df.select(*features).first()
        sample = self._predict_one(first) if first is not None else [0.0]
        kind = DoubleType() if len(sample) == 1 or len(outputs) > 1 else ArrayType(DoubleType())
        schema = StructType(list(df.schema.fields) + [StructField(o, kind) for o in outputs])
        return df.sparkSession.createDataFrame(df.rdd.mapPartitions(predict), schema)

    def _predict_one(self, row: Any) -> list[float]:
        import numpy as np
        import torch

        vector = np.hstack(
            [np.asarray(row[c], dtype=np.float32).ravel() for c in self.feature_cols]
        )
        self.model.eval()
        with torch.no_grad():
            return [float(v) for v in self.model(torch.as_tensor(vector)[None])[0].ravel()]
