"""Elastic MNIST: Horovod's ``pytorch_mnist_elastic.py`` on hora.

    hora run -np 3 --min-np 2 -H 127.0.0.1:1,localhost:2 python examples/pytorch_mnist_elastic.py

Kill the worker on 127.0.0.1 while it trains: its host is blacklisted, the two on localhost roll
back to their last commit, re-form as a job of two and finish. Uses the same data (MNIST
files, else scikit-learn's digits) and network as ``pytorch_mnist.py``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import hora.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_mnist import Net, load_data  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="elastic MNIST training on hora")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--batches-per-commit", type=int, default=5, help="commit every N batches")
    p.add_argument("--data-dir", default="./data", help="MNIST files, if any (else digits)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
    return p.parse_args(argv)


def main(args: argparse.Namespace) -> None:
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    use_cuda = not args.no_cuda and torch.cuda.is_available()
    if use_cuda:  # one GPU per worker, as Horovod's example pins them
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda" if use_cuda else "cpu")
    train_set, test_set, about = load_data(args.data_dir)
    if hvd.rank() == 0:
        print(f"Dataset: {about}", flush=True)

    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(train_set, seed=args.seed)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)

    def rescale_lr() -> None:  # the world size changed: keep the learning rate per sample
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"Job re-formed: {hvd.size()} workers", flush=True)

    state.register_reset_callbacks([rescale_lr])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        for epoch in range(state.epoch, args.epochs):
            state.epoch = epoch
            model.train()
            loader = DataLoader(train_set, batch_size=args.batch_size, sampler=state.sampler)
            for batch_idx, (data, target) in enumerate(loader):
                data, target = data.to(device), target.to(device)
                optimizer.zero_grad()
                loss = F.nll_loss(model(data), target)
                loss.backward()
                optimizer.step()
                state.sampler.record_batch(batch_idx, args.batch_size)
                if batch_idx % args.batches_per_commit == 0:
                    print(
                        f"Train Epoch: {state.epoch} batch {batch_idx} "
                        f"size {hvd.size()}\tLoss: {loss.item():.6f}",
                        flush=True,
                    )
                    state.commit()
            state.sampler.set_epoch(epoch + 1)
            state.epoch = epoch + 1
            state.commit()

    train(state)

    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in DataLoader(test_set, batch_size=1000):
            data, target = data.to(device), target.to(device)
            correct += model(data).argmax(dim=1).eq(target).sum().item()
    if hvd.rank() == 0:
        print(
            f"Done: {hvd.size()} workers, test accuracy {100.0 * correct / len(test_set):.2f}%",
            flush=True,
        )


if __name__ == "__main__":
    main(parse_args())
