"""Train a small PyTorch network on handwritten digits with hora inside Spark tasks.

    python examples/spark_torch_mnist.py --num-proc 2            # a local[2] Spark
    python examples/spark_torch_mnist.py --master spark://host:7077 --num-proc 4 \
        --work-dir /shared/tmp                                   # a cluster; see docs/spark.md

The data lives in Spark: a DataFrame of scikit-learn's digits (1,797 8x8 images, as 64
features and a label). Spark writes it as JSON part files under ``--work-dir`` (a directory
every executor can read); ``hora.spark.run`` then starts one hora rank per Spark task, each
rank reads its share of the rows, trains with ``hora.torch``'s DistributedOptimizer, and the
test accuracy (averaged over the ranks with an allreduce) comes back to the driver. Reaches
about 95% test accuracy in 10 epochs.

Then the same with ``hora.spark.torch.TorchEstimator``: ``fit`` writes the training DataFrame
to a store as Parquet and trains on ``--num-proc`` ranks (10% held out for validation), and
the model's ``transform`` adds a ``label__output`` column to the test DataFrame
(``--no-estimator`` skips this part).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="hora.spark.run: PyTorch on the digits")
    p.add_argument("--master", default="local[2]", help="Spark master (default: local[2])")
    p.add_argument("--num-proc", type=int, default=2, help="hora ranks = Spark tasks (2)")
    p.add_argument("--epochs", type=int, default=10, help="training epochs (default: 10)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per rank (32)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default: 0.05)")
    p.add_argument("--work-dir", help="where Spark writes the data (default: a temp dir)")
    p.add_argument("--no-estimator", action="store_true", help="skip the TorchEstimator part")
    return p.parse_args(argv)


def load_rows(path: str, rank: int, size: int) -> tuple[list[list[float]], list[int]]:
    """This rank's rows of the JSON part files Spark wrote under ``path``."""
    rows = []
    for part in sorted(glob.glob(os.path.join(path, "part-*"))):
        with open(part) as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    rows.sort(key=lambda r: r["id"])  # the same order on every rank, whatever the files
    mine = rows[rank::size]
    return [r["features"] for r in mine], [r["label"] for r in mine]


def train(train_path: str, test_path: str, epochs: int, batch_size: int, lr: float) -> float:
    """One rank's work: the body Spark runs in each task. Returns the test accuracy."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)
    x, y = load_rows(train_path, hvd.rank(), hvd.size())
    data = torch.tensor(x, dtype=torch.float32) / 16.0
    labels = torch.tensor(y)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.5)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # the same number of steps on every rank: the shards differ by at most one row
    steps = hvd.allreduce(torch.tensor(len(labels) // batch_size), op=hvd.Min).item()
    for epoch in range(epochs):
        order = torch.randperm(len(labels))
        for step in range(int(steps)):
            idx = order[step * batch_size : (step + 1) * batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data[idx]), labels[idx])
            loss.backward()
            optimizer.step()
        if hvd.rank() == 0:
            print(f"Train Epoch: {epoch + 1}\tLoss: {loss.item():.4f}", flush=True)
    tx, ty = load_rows(test_path, hvd.rank(), hvd.size())
    with torch.no_grad():
        pred = model(torch.tensor(tx, dtype=torch.float32) / 16.0).argmax(1)
    correct = torch.tensor([float((pred == torch.tensor(ty)).sum()), float(len(ty))])
    correct = hvd.allreduce(correct, op=hvd.Sum)
    accuracy = float(correct[0] / correct[1])
    hvd.shutdown()
    return accuracy


def estimate(args: argparse.Namespace, train_df: object, test_df: object, work: str) -> None:
    """The same training through TorchEstimator: fit on the DataFrame, transform the test set."""
    import torch
    from torch import nn

    from hora.spark.common.store import Store
    from hora.spark.torch import TorchEstimator

    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    estimator = TorchEstimator(
        num_proc=args.num_proc,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01 * args.num_proc, momentum=0.5),
        loss=nn.functional.cross_entropy,
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=args.batch_size,
        epochs=args.epochs,
        store=Store.create(os.path.join(work, "store")),
        validation=0.1,
        random_seed=1,
    )
    start = time.perf_counter()
    trained = estimator.fit(train_df)
    elapsed = time.perf_counter() - start
    rows = trained.transform(test_df).select("label", "label__output").collect()
    right = sum(max(range(10), key=lambda k: r["label__output"][k]) == r["label"] for r in rows)
    last = trained.getHistory()[-1]
    print(
        f"TorchEstimator: fit in {elapsed:.1f} s, last epoch train loss "
        f"{last['train_loss']:.4f}, val loss {last['val_loss']:.4f}; "
        f"test accuracy {right / len(rows):.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession
    from sklearn.datasets import load_digits

    import hora.spark

    spark = (
        SparkSession.builder.master(args.master)
        .appName("hora-spark-torch-digits")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        digits = load_digits()
        rows = [
            (i, [float(v) for v in digits.data[i]], int(digits.target[i]))
            for i in range(len(digits.target))
        ]
        df = spark.createDataFrame(rows, ["id", "features", "label"])
        train_df, test_df = df.randomSplit([0.8, 0.2], seed=1)
        work = args.work_dir or tempfile.mkdtemp(prefix="hora-spark-")
        train_path, test_path = os.path.join(work, "train"), os.path.join(work, "test")
        train_df.repartition(args.num_proc).write.mode("overwrite").json(train_path)
        test_df.write.mode("overwrite").json(test_path)
        start = time.perf_counter()
        accuracies = hora.spark.run(
            train,
            args=(train_path, test_path, args.epochs, args.batch_size, args.lr),
            num_proc=args.num_proc,
        )
        elapsed = time.perf_counter() - start
        print(f"Test accuracy per rank: {', '.join(f'{a:.3f}' for a in accuracies)}")
        print(f"hora.spark.run: {args.num_proc} ranks in {elapsed:.1f} s")
        if not args.no_estimator:
            estimate(args, train_df, test_df, work)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
