"""Train a small CNN on MNIST with hora, Horovod's PyTorch MNIST example run unchanged on hora.

    hora run -np 2 python examples/pytorch_mnist.py

Data: the MNIST IDX files when ``--data-dir`` holds them (``train-images-idx3-ubyte[.gz]`` and
the other three, directly or under ``MNIST/raw``); otherwise the handwritten digits that
scikit-learn ships (1,797 8x8 images, scaled to 20x20 inside a 28x28 canvas as MNIST's digits
are, the training images at 9 offsets, so the same network applies), since nothing can be
downloaded here. Rank 0 says which one it used. On the digits the default
settings reach 97-99% test accuracy (at least 95%) in 10 epochs, in about 40 seconds on
two CPU cores with ``-np 2``.

``--num-proc N`` starts the N ranks itself through ``hora.run`` instead of being launched.
"""

from __future__ import annotations

import argparse
import gzip
import os
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hora.torch as hvd

MNIST_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="PyTorch MNIST Example on hora")
    p.add_argument(
        "--batch-size",
        type=int,
        default=64,
        metavar="N",
        help="input batch size for training (default: 64)",
    )
    p.add_argument(
        "--test-batch-size",
        type=int,
        default=1000,
        metavar="N",
        help="input batch size for testing (default: 1000)",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=10,
        metavar="N",
        help="number of epochs to train (default: 10)",
    )
    p.add_argument(
        "--lr", type=float, default=0.01, metavar="LR", help="learning rate (default: 0.01)"
    )
    p.add_argument(
        "--momentum", type=float, default=0.5, metavar="M", help="SGD momentum (default: 0.5)"
    )
    p.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
    p.add_argument("--seed", type=int, default=42, metavar="S", help="random seed (default: 42)")
    p.add_argument(
        "--log-interval",
        type=int,
        default=10,
        metavar="N",
        help="how many batches to wait before logging training status",
    )
    p.add_argument(
        "--fp16-allreduce",
        action="store_true",
        default=False,
        help="use fp16 compression during allreduce",
    )
    p.add_argument(
        "--compression",
        choices=["none", "fp16", "bf16", "powersgd", "topk"],
        help="gradient compression (hora; powersgd: rank 4, exact for the first 10 steps; "
        "topk: 1%% of each gradient, with error feedback); overrides --fp16-allreduce",
    )
    p.add_argument(
        "--use-mixed-precision",
        action="store_true",
        default=False,
        help="use mixed precision for training",
    )
    p.add_argument(
        "--use-adasum",
        action="store_true",
        default=False,
        help="use adasum algorithm to do reduction",
    )
    p.add_argument(
        "--gradient-predivide-factor",
        type=float,
        default=1.0,
        help="apply gradient predivide factor in optimizer (default: 1.0)",
    )
    p.add_argument(
        "--data-dir", default="./data", help="directory holding the MNIST files (default: ./data)"
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="torch CPU threads per rank (default: 1; 0 keeps torch's default)",
    )
    p.add_argument(
        "--num-proc",
        type=int,
        help="start this many ranks through hora.run instead of being launched",
    )
    p.add_argument("--hosts", help="with --num-proc: hosts as host:slots,... (default: here)")
    p.add_argument(
        "--communication",
        choices=["gloo", "mpi"],
        help="with --num-proc: the controller to request",
    )
    return p.parse_args(argv)


def _read_idx(path: str) -> np.ndarray:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _find_mnist(data_dir: str) -> dict[str, str] | None:
    for folder in (data_dir, os.path.join(data_dir, "MNIST", "raw")):
        found = {}
        for key, name in MNIST_FILES.items():
            path = next(
                (
                    os.path.join(folder, name + ext)
                    for ext in ("", ".gz")
                    if os.path.isfile(os.path.join(folder, name + ext))
                ),
                None,
            )
            if path is None:
                break
            found[key] = path
        if len(found) == len(MNIST_FILES):
            return found
    return None


def compression_of(args: argparse.Namespace) -> object:
    """``DistributedOptimizer(compression=)`` for ``--compression`` (or ``--fp16-allreduce``)."""
    name = args.compression or ("fp16" if args.fp16_allreduce else "none")
    if name == "powersgd":
        return hvd.Compression.powersgd(rank=4, start_iter=10)
    if name == "topk":
        return hvd.Compression.topk(ratio=0.01)
    return getattr(hvd.Compression, name)


def load_data(data_dir: str) -> tuple[TensorDataset, TensorDataset, str]:
    """(train, test, description): MNIST if present, else scikit-learn's digits."""
    files = _find_mnist(data_dir)
    if files is not None:
        arrays = {k: _read_idx(p) for k, p in files.items()}

        def images(a: np.ndarray) -> torch.Tensor:
            return ((torch.from_numpy(a.copy()).float() / 255.0 - 0.1307) / 0.3081).unsqueeze(1)

        train = TensorDataset(
            images(arrays["train_x"]), torch.from_numpy(arrays["train_y"].astype(np.int64))
        )
        test = TensorDataset(
            images(arrays["test_x"]), torch.from_numpy(arrays["test_y"].astype(np.int64))
        )
        about = f"MNIST from {os.path.dirname(files['train_x'])}"
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        small = torch.from_numpy(digits.images).float().unsqueeze(1) / 16.0
        # Like MNIST: the digit scaled to 20x20 inside a 28x28 canvas. Test images are
        # centred; the training set holds every image at 9 offsets (x9 augmentation), which
        # gives the small dataset enough steps per epoch to train in Horovod's 10 epochs.
        glyphs = F.interpolate(small, size=(20, 20), mode="bilinear", align_corners=False)
        y = torch.from_numpy(digits.target.astype(np.int64))
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        n_test = len(y) // 5
        test_idx, train_idx = order[:n_test], order[n_test:]

        def canvas(idx: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
            return F.pad(glyphs[idx], (dx, 8 - dx, dy, 8 - dy))

        shifts = [(dy, dx) for dy in (2, 4, 6) for dx in (2, 4, 6)]
        train_x = torch.cat([canvas(train_idx, dy, dx) for dy, dx in shifts])
        test_x = canvas(test_idx, 4, 4)
        mean, std = train_x.mean(), train_x.std()
        train = TensorDataset((train_x - mean) / std, y[train_idx].repeat(len(shifts)))
        test = TensorDataset((test_x - mean) / std, y[test_idx])
        about = (
            f"scikit-learn digits ({len(train_idx)} 8x8 images scaled to 20x20 in a 28x28 "
            f"canvas, training set at {len(shifts)} offsets; no MNIST files in "
            f"{os.path.abspath(data_dir)})"
        )
    return train, test, f"{about}: {len(train)} train / {len(test)} test images"


class Net(nn.Module):
    """Two conv layers and two fully connected ones: Horovod's MNIST network."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def metric_average(value: float, name: str) -> float:
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main(args: argparse.Namespace) -> float:
    """Train and test; returns the final test accuracy (percent)."""
    hvd.init()
    use_cuda = not args.no_cuda and torch.cuda.is_available()
    torch.manual_seed(args.seed)
    if use_cuda:
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)
    elif args.num_threads > 0:
        torch.set_num_threads(args.num_threads)  # one core per rank: ranks do not fight
    device = torch.device("cuda" if use_cuda else "cpu")

    train_set, test_set, about = load_data(args.data_dir)
    if hvd.rank() == 0:
        print(f"Dataset: {about}", flush=True)
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = DistributedSampler(
        test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False
    )
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net().to(device)
    lr_scaler = 1 if args.use_adasum else hvd.size()  # linear scaling with the world size
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression_of(args),
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )
    autocast_dtype = torch.float16 if use_cuda else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda") if args.use_mixed_precision and use_cuda else None

    def autocast() -> object:
        if not args.use_mixed_precision:
            return nullcontext()
        return torch.autocast(device.type, dtype=autocast_dtype)

    def train(epoch: int) -> None:
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            with autocast():
                loss = F.nll_loss(model(data), target)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:  # reduce first, then unscale and step without reducing again
                scaler.scale(loss).backward()
                optimizer.synchronize()
                scaler.unscale_(optimizer)
                with optimizer.skip_synchronize():
                    scaler.step(optimizer)
                scaler.update()
            if batch_idx % args.log_interval == 0:
                print(
                    f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)} "
                    f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}",
                    flush=True,
                )

    def test() -> float:
        model.eval()
        test_loss, correct = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                data, target = data.to(device), target.to(device)
                with autocast():
                    output = model(data).float()
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                correct += output.argmax(dim=1).eq(target).sum().item()
        test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
        accuracy = metric_average(correct / len(test_sampler), "avg_accuracy")
        if hvd.rank() == 0:
            print(
                f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * accuracy:.2f}%\n",
                flush=True,
            )
        return 100.0 * accuracy

    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        train(epoch)
        accuracy = test()
    return accuracy


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.num_proc:
        import hora

        accuracies = hora.run(
            main,
            args=(arguments,),
            np=arguments.num_proc,
            hosts=arguments.hosts,
            use_gloo=arguments.communication == "gloo",
            use_mpi=arguments.communication == "mpi",
        )
        print(f"Final test accuracy: {accuracies[0]:.2f}%")
    else:
        main(arguments)
