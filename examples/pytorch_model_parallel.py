"""Model parallelism on process sets: a model split into three stages, each stage data-parallel.

    hora run -np 6 python examples/pytorch_model_parallel.py --epochs 3

Six ranks, three stages of two ranks each (rank ``r`` is stage ``r // 2``, replica ``r % 2``):

    stage 0 (ranks 0, 1)  input -> hidden     the first layers
    stage 1 (ranks 2, 3)  hidden -> hidden    the middle layers
    stage 2 (ranks 4, 5)  hidden -> logits    the last layer and the loss

Every rank registers the same process sets at ``hvd.init``, in the same order:

* three *stage* sets ``[0, 1]``, ``[2, 3]``, ``[4, 5]``: the two replicas of a stage average
  their gradients there (``hvd.DistributedOptimizer(..., process_set=stage_set)``), so each
  stage is trained data-parallel on its two shards of the batch;
* four *link* sets ``[0, 2]``, ``[2, 4]``, ``[1, 3]``, ``[3, 5]``: one replica's activations go
  forward from stage to stage (``hvd.broadcast`` rooted at the sender), and the gradients with
  respect to those activations come back the same way during the backward pass.

Replica ``k`` of every stage works on shard ``k`` of each global batch, so replica 0 forms one
pipeline (ranks 0 -> 2 -> 4) and replica 1 the other (1 -> 3 -> 5). The result is the same
training as one process running the whole model on the whole batch (the mean of two equal
shards' mean gradients is the whole batch's mean gradient); the tests check that.

The model is a small multi-layer perceptron on synthetic data (``--features``, ``--hidden``,
``--classes``) so that six ranks run on two CPU cores in seconds; the stage layout is what
matters, and a larger network (a ResNet cut after its second and third block groups) goes in
the same three places. ``--save-dir DIR`` writes each stage's parameters and the loss history
(``stage<i>.pt`` from the stage's replica 0, ``losses.pt`` from rank 4) for comparison.

See docs/model_parallel.md for the layout and for what goes wrong (mismatched set
configuration, nested operations on different sets, contention) and how to tell.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

import hora.torch as hvd

STAGES = 3
REPLICAS = 2


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Three-stage model parallelism on process sets (run with -np 6)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--epochs", type=int, default=3, help="passes over the training data")
    p.add_argument("--batch-size", type=int, default=32, help="global batch (both replicas)")
    p.add_argument("--samples", type=int, default=512, help="synthetic training samples")
    p.add_argument("--features", type=int, default=16, help="input features")
    p.add_argument("--hidden", type=int, default=32, help="width of the hidden layers")
    p.add_argument("--classes", type=int, default=4, help="output classes")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=42, help="seed of the model and the data")
    p.add_argument("--save-dir", default="", help="write stage parameters and losses here")
    return p.parse_args(argv)


def build_stages(args: argparse.Namespace) -> list[nn.Module]:
    """The whole model as three stages, initialised from ``args.seed`` (same on every rank)."""
    torch.manual_seed(args.seed)
    return [
        nn.Sequential(nn.Linear(args.features, args.hidden), nn.ReLU()),
        nn.Sequential(nn.Linear(args.hidden, args.hidden), nn.Tanh()),
        nn.Sequential(nn.Linear(args.hidden, args.classes)),
    ]


def make_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic classification data: labels from a fixed random linear teacher."""
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.samples, args.features, generator=g)
    teacher = torch.randn(args.features, args.classes, generator=g)
    return x, (x @ teacher).argmax(dim=1)


def batches(args: argparse.Namespace, epoch: int) -> list[torch.Tensor]:
    """Index tensors of each global batch of ``epoch`` (the same shuffle on every rank)."""
    g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
    order = torch.randperm(args.samples, generator=g)
    usable = args.samples - args.samples % args.batch_size
    return list(order[:usable].split(args.batch_size))


def shard(index: torch.Tensor, replica: int) -> torch.Tensor:
    """Replica ``replica``'s half of a global batch."""
    return index.chunk(REPLICAS)[replica]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.batch_size % REPLICAS:
        raise SystemExit(f"--batch-size must be a multiple of {REPLICAS}, got {args.batch_size}")
    torch.set_num_threads(1)
    stage_sets = [hvd.ProcessSet([2 * s, 2 * s + 1]) for s in range(STAGES)]
    # link[(s, k)]: replica k's connection from stage s to stage s + 1
    links = {
        (s, k): hvd.ProcessSet([2 * s + k, 2 * (s + 1) + k])
        for k in range(REPLICAS)
        for s in range(STAGES - 1)
    }
    hvd.init(process_sets=[*stage_sets, *links.values()])
    if hvd.size() != STAGES * REPLICAS:
        raise SystemExit(
            f"this example needs exactly {STAGES * REPLICAS} ranks (hora run -np 6), "
            f"got {hvd.size()}"
        )
    stage, replica = divmod(hvd.rank(), REPLICAS)
    model = build_stages(args)[stage]
    x_all, y_all = make_data(args)
    base = torch.optim.SGD(model.parameters(), lr=args.lr)
    optimizer = hvd.DistributedOptimizer(
        base,
        named_parameters=[(f"stage{stage}.{n}", p) for n, p in model.named_parameters()],
        process_set=stage_sets[stage],
    )
    half = args.batch_size // REPLICAS
    losses: list[float] = []
    for epoch in range(1, args.epochs + 1):
        total = 0.0
        steps = batches(args, epoch)
        for step, index in enumerate(steps):
            mine = shard(index, replica)
            optimizer.zero_grad()
            tag = f"e{epoch}.s{step}"
            # forward: receive the previous stage's activations (stage 0 reads the data)
            if stage == 0:
                inputs = x_all[mine]
            else:
                inputs = torch.empty(half, args.hidden)
                inputs = hvd.broadcast(
                    inputs,
                    2 * (stage - 1) + replica,
                    name=f"act{stage}.{tag}",
                    process_set=links[(stage - 1, replica)],
                ).requires_grad_()
            out = model(inputs)
            if stage < STAGES - 1:
                hvd.broadcast(
                    out.detach(),
                    hvd.rank(),
                    name=f"act{stage + 1}.{tag}",
                    process_set=links[(stage, replica)],
                )
                # backward: the next stage sends d(loss)/d(out)
                grad_out = hvd.broadcast(
                    torch.empty_like(out),
                    2 * (stage + 1) + replica,
                    name=f"grad{stage + 1}.{tag}",
                    process_set=links[(stage, replica)],
                )
                out.backward(grad_out)
            else:
                loss = F.cross_entropy(out, y_all[mine])
                loss.backward()
                total += float(
                    hvd.allreduce(loss.detach(), process_set=stage_sets[stage], name=f"loss.{tag}")
                )
            if stage > 0:
                assert inputs.grad is not None
                hvd.broadcast(
                    inputs.grad,
                    hvd.rank(),
                    name=f"grad{stage}.{tag}",
                    process_set=links[(stage - 1, replica)],
                )
            optimizer.step()  # waits for this stage's gradient allreduce
        if stage == STAGES - 1:
            losses.append(total / len(steps))
            if replica == 0:
                print(f"Epoch {epoch}: mean loss {losses[-1]:.6f}", flush=True)
    if args.save_dir and replica == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(args.save_dir, f"stage{stage}.pt"))
        if stage == STAGES - 1:
            torch.save(torch.tensor(losses), os.path.join(args.save_dir, "losses.pt"))
    # one rank's shutdown ends the job for all: wait until every stage is done
    hvd.barrier()
    hvd.shutdown()


if __name__ == "__main__":
    main()
