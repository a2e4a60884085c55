"""Training throughput on synthetic data: Horovod's PyTorch synthetic benchmark, on hora.

    hora run -np 2 python examples/pytorch_synthetic_benchmark.py --model mlp --batch-size 64
    hora run -np 2 python examples/pytorch_synthetic_benchmark.py --model mlp --ddp

Models (``--model``), chosen to span compute/communication ratios:
  resnet50  ResNet-50 (25.6M parameters, 3x224x224 images), defined here (no torchvision);
  cnn       a small VGG-style CNN (4.2M parameters, 3x32x32 images): compute-heavy;
  mlp       a 3072-1024-64-10 perceptron (3.2M parameters, 3x32x32 images): communication-heavy;
  lstm      a 2-layer LSTM classifier over 64-token sequences (2.2M parameters).
``--ddp`` runs the same loop under torch DistributedDataParallel instead of hora, for
comparison in the same job: on NCCL when the model trains on GPUs (the peer hora is compared
with there), else on Gloo (``--ddp-backend`` chooses); hora is then only used to agree on the
rendezvous port and is shut down before timing starts. Rank 0 prints Horovod's lines
(``Iter #i: X img/sec per CPU``, ``Img/sec per CPU: m +-c``, ``Total img/sec on N CPU(s): ...``).
"""

from __future__ import annotations

import argparse
import os
import socket
import timeit

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import hora.torch as hvd


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="PyTorch Synthetic Benchmark on hora",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--fp16-allreduce",
        action="store_true",
        default=False,
        help="use fp16 compression during allreduce",
    )
    p.add_argument(
        "--model", type=str, default="resnet50", choices=sorted(MODELS), help="model to benchmark"
    )
    p.add_argument("--batch-size", type=int, default=32, help="input batch size")
    p.add_argument(
        "--num-warmup-batches",
        type=int,
        default=10,
        help="number of warm-up batches that don't count towards benchmark",
    )
    p.add_argument(
        "--num-batches-per-iter",
        type=int,
        default=10,
        help="number of batches per benchmark iteration",
    )
    p.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    p.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
    p.add_argument(
        "--use-adasum",
        action="store_true",
        default=False,
        help="use adasum algorithm to do reduction",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="torch CPU threads per rank (0 keeps torch's default)",
    )
    p.add_argument(
        "--priority-forward",
        action="store_true",
        default=False,
        help="reduce the first layers' gradients first (DistributedOptimizer priority='forward')",
    )
    p.add_argument(
        "--ddp",
        action="store_true",
        default=False,
        help="use torch DistributedDataParallel instead of hora (NCCL on GPUs, else Gloo)",
    )
    p.add_argument(
        "--ddp-backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="torch.distributed backend of --ddp: auto is NCCL on GPUs, Gloo on CPUs",
    )
    return p.parse_args(argv)


# -- models -----------------------------------------------------------------------------------
class Bottleneck(nn.Module):
    """ResNet's 1x1-3x3-1x1 block with a projection shortcut when the shape changes."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class ResNet50(nn.Module):
    """ResNet-50 for 224x224 images: stages of 3, 4, 6 and 3 bottleneck blocks."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(3, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        ]
        cin = 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(blocks):
                layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * Bottleneck.expansion
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


def small_cnn() -> nn.Module:
    """Four 3x3 conv layers and two dense ones over 32x32 images (4.2M parameters)."""

    def conv(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(inplace=True)]

    return nn.Sequential(
        *conv(3, 64),
        *conv(64, 128),
        nn.MaxPool2d(2),
        *conv(128, 256),
        nn.MaxPool2d(2),
        *conv(256, 256),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(256 * 4 * 4, 800),
        nn.ReLU(inplace=True),
        nn.Linear(800, 10),
    )


def mlp() -> nn.Module:
    """A 3072-1024-64-10 perceptron over flattened 32x32 images (3.2M parameters)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(3 * 32 * 32, 1024),
        nn.ReLU(inplace=True),
        nn.Linear(1024, 64),
        nn.ReLU(inplace=True),
        nn.Linear(64, 10),
    )


class LSTMClassifier(nn.Module):
    """Embedding, a 2-layer LSTM and a classifier on the last step (2.2M parameters)."""

    def __init__(self, vocab: int = 10000, embed: int = 128, hidden: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=2, batch_first=True)
        self.fc = nn.Linear(hidden, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.fc(out[:, -1])


# name -> (constructor, make a synthetic batch of inputs, number of classes)
MODELS = {
    "resnet50": (ResNet50, lambda n: torch.randn(n, 3, 224, 224), 1000),
    "cnn": (small_cnn, lambda n: torch.randn(n, 3, 32, 32), 10),
    "mlp": (mlp, lambda n: torch.randn(n, 3, 32, 32), 10),
    "lstm": (LSTMClassifier, lambda n: torch.randint(0, 10000, (n, 64)), 10),
}


# -- setup --------------------------------------------------------------------------------------
def ddp_backend(choice: str, use_cuda: bool) -> str:
    """The torch.distributed backend for --ddp: ``auto`` is NCCL on GPUs, Gloo on CPUs."""
    if choice == "auto":
        return "nccl" if use_cuda else "gloo"
    if choice == "nccl" and not use_cuda:
        raise SystemExit("--ddp-backend nccl needs the model on GPUs (drop --no-cuda)")
    return choice


def init_ddp(backend: str) -> tuple[int, int]:
    """Start torch.distributed on ``backend``, on this rank's GPU for NCCL. The port comes
    from MASTER_PORT, or rank 0 picks a free one and hora broadcasts it; hora is shut down
    before any timing."""
    hvd.init()
    rank, size, local = hvd.rank(), hvd.size(), hvd.local_rank()
    if "MASTER_PORT" not in os.environ:
        port = 0
        if rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        os.environ["MASTER_PORT"] = str(hvd.broadcast_object(port, 0, name="ddp_port"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    hvd.shutdown()
    if backend == "nccl":  # NCCL takes the current device as this rank's
        torch.cuda.set_device(local % torch.cuda.device_count())
    torch.distributed.init_process_group(backend, rank=rank, world_size=size)
    return rank, size


def main(args: argparse.Namespace) -> None:
    use_cuda = not args.no_cuda and torch.cuda.is_available()
    comm = "hora"
    if args.ddp:
        if args.use_adasum:
            raise SystemExit("--use-adasum is a hora option; it cannot be combined with --ddp")
        backend = ddp_backend(args.ddp_backend, use_cuda)
        comm = f"torch DDP ({'NCCL' if backend == 'nccl' else 'Gloo'})"
        rank, size = init_ddp(backend)
    else:
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    if use_cuda:
        # more ranks than GPUs share them (hora's staged path can; NCCL cannot)
        torch.cuda.set_device(
            (hvd.local_rank() if not args.ddp else rank) % torch.cuda.device_count()
        )
    elif args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    device = torch.device("cuda" if use_cuda else "cpu")

    build, make_input, classes = MODELS[args.model]
    torch.manual_seed(0)
    model = build().to(device)
    lr_scaler = size if not args.use_adasum else 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    if args.ddp:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[torch.cuda.current_device()] if use_cuda else None
        )
        if args.fp16_allreduce:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        optimizer = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
            op=hvd.Adasum if args.use_adasum else hvd.Average,
            **({"priority": "forward"} if args.priority_forward else {}),
        )
    data = make_input(args.batch_size).to(device)
    target = torch.randint(0, classes, (args.batch_size,), device=device)

    def benchmark_step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    dev = "GPU" if use_cuda else "CPU"
    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {dev}s: {size}")
    log(f"Communication: {comm}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for i in range(args.num_iters):
        elapsed = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / elapsed
        log(f"Iter #{i}: {img_sec:.1f} img/sec per {dev}")
        img_secs.append(img_sec)
    mean, conf = float(np.mean(img_secs)), 1.96 * float(np.std(img_secs))
    log(f"Img/sec per {dev}: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {size} {dev}(s): {size * mean:.1f} +-{size * conf:.1f}")
    if args.ddp:
        torch.distributed.destroy_process_group()
    else:
        hvd.shutdown()


if __name__ == "__main__":
    main(parse_args())
