"""``TorchEstimator.fit(df)`` trains a PyTorch model with hora.torch inside Spark tasks and
returns a :class:`TorchModel` whose ``transform(df)`` adds the model's predictions.

``fit`` (shared with the other estimators: :mod:`hora.spark.common.estimator`) writes the
feature and label columns to the store as Parquet through Spark, then :func:`hora.spark.run`
starts ``num_proc`` ranks; each reads its shard (every ``size``-th row) with pyarrow, trains
with ``hvd.DistributedOptimizer`` from rank 0's initial weights, averages the epoch's losses
over the ranks, and rank 0 saves a checkpoint in the store after each epoch and returns the
trained weights. Methods run in the driver's calling thread; the training function runs in
the ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import cloudpickle

from hora.spark.common.estimator import EstimatorBase, ModelBase, columns, read_shard


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
        table = read_shard(path, spec["features"] + spec["labels"], hvd.rank(), hvd.size())
        x = torch.as_tensor(columns(table, spec["features"]), dtype=torch.float32)
        y = torch.as_tensor(columns(table, spec["labels"]))
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


class TorchEstimator(EstimatorBase):
    """Train ``model`` on a DataFrame (``horovod.spark.torch.TorchEstimator``'s main params).

    ``optimizer`` is an optimizer over ``model``'s parameters: each rank builds the same kind
    with the same settings (``optimizer.defaults``) over its copy. ``loss`` is a callable
    ``loss(output, label)``. ``feature_cols`` are numeric or array columns, concatenated into
    one input vector; ``label_cols`` the targets (one integer column: class indices).
    ``validation``: a fraction of the rows held out, or the name of a boolean column marking
    them. ``callbacks``: callables ``cb(epoch, metrics)`` run on every rank after each epoch
    (``metrics``: ``train_loss`` and ``val_loss``, averaged over the ranks). ``store``: a
    :class:`~hora.spark.common.store.Store` (default a ``LocalStore`` in a temporary
    directory), where the data and each run's checkpoint (``checkpoint.pt``) go.
    """

    checkpoint_name = "checkpoint.pt"

    def _train_fn(self) -> Callable[[bytes, dict[str, Any]], Any]:
        return _train

    def _payload(self) -> bytes:
        opt = self.optimizer
        return cloudpickle.dumps(
            (self.model, type(opt), dict(opt.defaults), self.loss, self.callbacks)
        )

    def _trained(self, result: dict[str, Any], run_id: str) -> TorchModel:
        trained = copy.deepcopy(self.model)
        trained.load_state_dict(result["state"])
        return TorchModel(trained, self.feature_cols, self.label_cols, result["history"], run_id)

    def fit(self, df: Any) -> TorchModel:
        """Write ``df``'s columns to the store, train on ``num_proc`` ranks, return the model."""
        model: TorchModel = super().fit(df)
        return model


class _TorchPredictor:
    """Picklable: the model's output for a float32 matrix (loads the model once per task)."""

    def __init__(self, model: Any):
        self.model_bytes = cloudpickle.dumps(model)
        self._model: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"model_bytes": self.model_bytes, "_model": None}

    def __call__(self, matrix: Any) -> Any:
        import torch

        if self._model is None:
            self._model = cloudpickle.loads(self.model_bytes)
            self._model.eval()
        with torch.no_grad():
            out = self._model(torch.as_tensor(matrix))
        return out.double().reshape(len(matrix), -1).numpy()


class TorchModel(ModelBase):
    """A trained model: ``transform(df)`` adds one ``<label>__output`` column per label column
    (or the names in ``output_cols``) with the model's output for each row."""

    def _predictor(self) -> Callable[[Any], Any]:
        return _TorchPredictor(self.model)
