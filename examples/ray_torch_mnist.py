"""Horovod's PyTorch MNIST training on a Ray cluster: ``hora.ray.RayExecutor`` runs
examples/pytorch_mnist.py's ``main`` on Ray actors, one rank each.

    python examples/ray_torch_mnist.py --num-workers 2 --epochs 3            # a local Ray
    python examples/ray_torch_mnist.py --address auto --num-workers 8 --use-gpu  # a cluster

Every flag the Ray part does not know goes to pytorch_mnist.py (``--epochs``, ``--batch-size``,
``--data-dir``, ...); without MNIST files the ranks train on scikit-learn's digits, as there.
Without ``--address`` this starts a local Ray with ``--num-workers x --cpus-per-worker`` CPUs.
The workers print as under ``hora run`` (Ray prefixes each line with the actor's pid); the
driver prints the final test accuracy and how long the start and the training took.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import ray

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_mnist  # noqa: E402  (the training itself, shared with the launched example)

from hora.ray import RayExecutor  # noqa: E402

# Ray workers cannot import this folder: send this file's and pytorch_mnist's functions by value.
ray.cloudpickle.register_pickle_by_value(pytorch_mnist)
if __name__ != "__main__":  # imported (a test); __main__'s functions always travel by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def train(mnist_argv: list[str]) -> float:
    """One rank: pytorch_mnist's training with its own flags; the final test accuracy."""
    return pytorch_mnist.main(pytorch_mnist.parse_args(mnist_argv))


def run_on_ray(
    num_workers: int,
    mnist_argv: list[str],
    cpus_per_worker: float = 1,
    use_gpu: bool = False,
) -> tuple[list[Any], float, float]:
    """Train on ``num_workers`` Ray actors (Ray must be up or starts itself); the ranks'
    accuracies in rank order, and the seconds the start and the training took."""
    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(
        settings, num_workers=num_workers, cpus_per_worker=cpus_per_worker, use_gpu=use_gpu
    )
    began = time.perf_counter()
    executor.start()
    try:
        started = time.perf_counter()
        accuracies = executor.run(train, args=[mnist_argv])
        return accuracies, started - began, time.perf_counter() - started
    finally:
        executor.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description="PyTorch MNIST on Ray with hora")
    p.add_argument("--num-workers", type=int, default=2, help="ranks (default: 2)")
    p.add_argument("--cpus-per-worker", type=float, default=1, help="CPUs per rank (default: 1)")
    p.add_argument("--use-gpu", action="store_true", help="one GPU per rank")
    p.add_argument("--address", help="a running Ray cluster ('auto', or host:port)")
    args, mnist_argv = p.parse_known_args()
    if args.address:
        ray.init(address=args.address)
    else:
        cpus = max(1, int(args.num_workers * args.cpus_per_worker + 0.999))
        ray.init(address="local", num_cpus=cpus, include_dashboard=False)
    if args.use_gpu:
        mnist_argv = [a for a in mnist_argv if a != "--no-cuda"]
    elif "--no-cuda" not in mnist_argv:
        mnist_argv.append("--no-cuda")
    accuracies, start_s, train_s = run_on_ray(
        args.num_workers, mnist_argv, args.cpus_per_worker, args.use_gpu
    )
    print(f"Final test accuracy: {accuracies[0]:.2f}%")
    print(f"RayExecutor.start: {start_s:.2f}s, training: {train_s:.2f}s")
    ray.shutdown()


if __name__ == "__main__":
    main()
