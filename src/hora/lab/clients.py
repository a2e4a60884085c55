"""``hora bench clients``: PyTorch Lightning's and Hugging Face Accelerate's training step on
``backend="hora"`` against the same on Gloo.

Each client trains one of the scaling lab's models (:func:`hora.lab.train_worker.build`, on its
synthetic batch, SGD) as its users write it: Lightning's ``Trainer(accelerator="cpu",
strategy=DDPStrategy(process_group_backend=...))``, Accelerate's ``Accelerator(cpu=True)`` with
``accelerator.backward``; on hora, Lightning names the backend and Accelerate takes
:func:`hora.torch.accelerate.accelerator`. Every run starts ``--np`` fresh workers as torchrun
would (:func:`hora.lab.ddp.run_backend`); rank 0 reports the median time of the timed steps
(Lightning: from one batch's end to the next's, so the client's own work per step counts).
``--repeat R`` runs the clients and backends R times in turn and keeps each one's best round,
so both backends see the same moments of a shared machine.

The parent runs in the caller's thread and blocks while the workers run; a worker is this
module run as ``python -m hora.lab.clients --worker PLAN`` (its main thread). Needs the
``lightning`` and ``accelerate`` extras.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from typing import Any

from hora.lab.ddp import BACKENDS, report, run_backend, script_main

CLIENTS = ("lightning", "accelerate")
EXAMPLES = """examples:
  hora bench clients                          both clients on the mlp, np=2, once
  hora bench clients --repeat 2               best of two rounds taking turns
  hora bench clients --clients accelerate --model cnn --steps 40
"""


# -- the worker ---------------------------------------------------------------------------------
def worker(plan: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from hora.lab.train_worker import DEFAULT_BATCH, TrainSpec, build

    torch.set_num_threads(1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batch = int(plan["batch"] or DEFAULT_BATCH[plan["model"]])
    spec = TrainSpec(plan["model"], batch, int(plan["steps"]), int(plan["warmup"]))
    net, batches, loss_fn = build(spec, rank, size)
    fit = _lightning if plan["client"] == "lightning" else _accelerate
    ends, loss = fit(plan["backend"], net, batches, loss_fn, spec.warmup + spec.steps)
    first = max(spec.warmup - 1, 0)  # the last warm-up step's end starts the first timed one
    steps = [b - a for a, b in zip(ends[first:], ends[first + 1 :])]
    if rank == 0:
        out = {"client": plan["client"], "backend": dist.get_backend(), "np": size,
               "model": spec.model, "batch": batch, "steps": len(steps),
               "step_ms": statistics.median(steps) * 1e3, "loss": loss}  # fmt: skip
        with open(plan["out"] + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(plan["out"] + ".tmp", plan["out"])
    dist.destroy_process_group()


def _lightning(backend: str, net: Any, batches: Any, loss_fn: Any,
               n: int) -> tuple[list[float], float]:  # fmt: skip
    """``n`` steps of a Trainer; the time each step's batch ended, and the last loss."""
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.strategies import DDPStrategy

    if backend == "hora":
        import hora.torch.lightning  # noqa: F401 - registers backend="hora"

    ends: list[float] = []
    last: list[float] = [0.0]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, i: int) -> Any:
            x, y = batch
            loss = loss_fn(self.net(x), y)
            last[0] = float(loss.detach())
            return loss

        def on_train_batch_end(self, *args: Any) -> None:
            ends.append(time.perf_counter())

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = [batches() for _ in range(n)]  # the rank's own batches: no sampler
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), max_steps=n,
        strategy=DDPStrategy(process_group_backend=backend), use_distributed_sampler=False,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    loader: Any = torch.utils.data.DataLoader(data, batch_size=None)  # type: ignore[arg-type]
    trainer.fit(Module(), loader)
    return ends, last[0]


def _accelerate(backend: str, net: Any, batches: Any, loss_fn: Any,
                n: int) -> tuple[list[float], float]:  # fmt: skip
    """``n`` steps of an Accelerate loop; the time each step ended, and the last loss."""
    import torch

    if backend == "hora":
        from hora.torch.accelerate import accelerator

        acc = accelerator(cpu=True)
    else:
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
    ends, loss = [], None
    for _ in range(n):
        x, y = batches()
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        acc.backward(loss)
        opt.step()
        ends.append(time.perf_counter())
    return ends, float(loss.detach()) if loss is not None else 0.0


# -- the parent ---------------------------------------------------------------------------------
def run_clients_bench(clients: list[str], model: str, np_: int = 2, steps: int = 30,
                      warmup: int = 5, batch: int = 0, repeat: int = 1,
                      timeout: float = 600.0) -> dict[str, Any]:  # fmt: skip
    """Each client on each backend, ``repeat`` rounds in turn; each pair's best round."""
    best: dict[str, dict[str, Any]] = {}
    tmp = tempfile.mkdtemp(prefix="hora-bench-clients-")
    try:
        for r in range(repeat):
            for client in clients:
                for backend in BACKENDS:
                    sys.stderr.write(f"hora bench clients: {client} on {backend}, round {r + 1} "
                                     f"of {repeat}\n")  # fmt: skip
                    plan = {"client": client, "backend": backend, "model": model,
                            "steps": steps, "warmup": warmup, "batch": batch}  # fmt: skip
                    got = run_backend(plan, np_, tmp, timeout, module="hora.lab.clients")
                    key = f"{client}.{backend}"
                    if key not in best or got["step_ms"] < best[key]["step_ms"]:
                        best[key] = got
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"np": np_, "model": model, "clients": clients, "repeat": repeat, "results": best}


def render(result: dict[str, Any]) -> str:
    res = result["results"]
    lines = [f"training step of the {result['model']}, np={result['np']} (this host), best of "
             f"{result['repeat']} round(s) taking turns", "",
             f"{'client':<12}{'batch':>6}{'gloo ms':>10}{'hora ms':>10}"
             f"{'hora/gloo':>11}"]  # fmt: skip
    for client in result["clients"]:
        g, h = res[f"{client}.gloo"], res[f"{client}.hora"]
        lines.append(f"{client:<12}{g['batch']:>6}{g['step_ms']:>10.2f}{h['step_ms']:>10.2f}"
                     f"{g['step_ms'] / h['step_ms']:>10.2f}x")  # fmt: skip
    lines += ["", "ms: median step time of rank 0; hora/gloo: hora's speed over Gloo's "
              "(above 1, hora is faster)"]  # fmt: skip
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--np", type=int, default=2, help="processes per run (default 2)")
    parser.add_argument("--clients", default=",".join(CLIENTS),
                        help="lightning, accelerate or both, comma-separated (default both)")
    parser.add_argument("--model", default="mlp", help="the scaling lab's model (default mlp)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=0,
                        help="per-process batch size (default: the scaling lab's per model)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of every client and backend in turn; each one's best is kept")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--json", default=None, help="also write the results to this file")


def command(args: argparse.Namespace) -> int:
    from hora.lab.train_worker import SYNTHETIC_MODELS

    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    if not clients or any(c not in CLIENTS for c in clients):
        raise SystemExit(f"hora bench clients: --clients {args.clients!r}: choose from {CLIENTS}")
    if args.model not in SYNTHETIC_MODELS:
        raise SystemExit(f"hora bench clients: --model {args.model!r}: choose from "
                         f"{SYNTHETIC_MODELS}")  # fmt: skip
    if args.steps < 2 or args.warmup < 0:
        raise SystemExit("hora bench clients: --steps must be at least 2, --warmup at least 0")
    return report(
        "clients",
        partial(run_clients_bench, clients, args.model, args.np, args.steps, args.warmup,
                args.batch, max(1, args.repeat), args.timeout),
        render, args.json,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return script_main(argv, "hora.lab.clients", worker, configure, command, EXAMPLES)


if __name__ == "__main__":
    sys.exit(main())
