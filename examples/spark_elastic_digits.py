"""Elastic training in Spark tasks with ``hora.spark.run_elastic``: scikit-learn's digits, a
small PyTorch network, and one worker that dies on purpose.

    SPARK_LOCAL_IP=127.0.0.1 PYSPARK_PYTHON=$(which python) \\
        python examples/spark_elastic_digits.py --num-proc 2 --kill-once

``local[N,F]`` gives N task slots and lets a task fail F times. With ``--kill-once``, rank 1
exits (``os._exit(1)``) in its second epoch: its Spark task fails, Spark runs the task again,
the new attempt's worker joins, and the survivor rolls back to its last commit; the job ends
with the same test accuracy on every rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def train(epochs: int, lr: float, kill_flag: str | None) -> tuple[int, int, float]:
    """One elastic worker: ``(rank, size, test accuracy)`` at the end."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr), named_parameters=model.named_parameters()
    )
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0)

    @hvd.elastic.run
    def loop(state: hvd.elastic.TorchState) -> None:
        while state.epoch < epochs:
            # this rank's share of the training set for the current world size: every rank
            # takes the same number of batches (each step is one allreduce on all ranks)
            for step in range(len(x_train) // (32 * hvd.size())):
                i = (step * hvd.size() + hvd.rank()) * 32
                optimizer.zero_grad()
                F.cross_entropy(model(x_train[i : i + 32]), y_train[i : i + 32]).backward()
                optimizer.step()
            if kill_flag and state.epoch == 1 and hvd.rank() == 1:
                try:
                    os.close(os.open(kill_flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    print("rank 1 exits on purpose", flush=True)
                    os._exit(1)
                except FileExistsError:
                    pass  # once per job
            state.epoch += 1
            state.commit()

    loop(state)
    with torch.no_grad():
        accuracy = model(x_test).argmax(dim=1).eq(y_test).float().mean().item()
    return hvd.rank(), hvd.size(), accuracy


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="elastic training in Spark tasks")
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--kill-once", action="store_true", help="rank 1 exits once, in epoch 2")
    args = p.parse_args(argv)

    from pyspark.sql import SparkSession

    import hora.spark

    master = f"local[{args.num_proc},4]"  # a task may fail 4 times
    spark = SparkSession.builder.master(master).config("spark.ui.enabled", "false").getOrCreate()
    spark.sparkContext.setLogLevel("FATAL")
    with tempfile.TemporaryDirectory() as tmp:
        flag = os.path.join(tmp, "killed") if args.kill_once else None
        results = hora.spark.run_elastic(
            train, args=(args.epochs, args.lr, flag), num_proc=args.num_proc, reset_limit=5
        )
    for rank, size, accuracy in results:
        print(f"rank {rank} of {size}: test accuracy {100 * accuracy:.2f}%")
    spark.stop()


if __name__ == "__main__":
    sys.exit(main())
