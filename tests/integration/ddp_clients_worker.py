"""The training script of tests/integration/test_ddp_clients.py: PyTorch Lightning or Hugging
Face Accelerate trains a small MLP on a tiny synthetic dataset, first on ``backend="hora"``, then
on Gloo in the same processes, as their users write it.

``python ddp_clients_worker.py CLIENTS OUT [--hora-env]``, started by the client's own launcher
(Lightning's, which starts the other rank by running this script again; torchrun) or by ``hora
run``. CLIENTS is ``lightning``, ``accelerate`` or both, comma-separated, run in that order;
``--hora-env`` gives Lightning's Trainer ``plugins=[HoraEnvironment()]``. For each client each
rank writes ``OUT/<client>.<rank>.json``: for each backend the backend torch reports, the losses
of every step (``float.hex``, so that the test compares bits), the losses gathered from every
rank (Accelerate) and a digest of the final parameters; for Accelerate also what it says to
``InitProcessGroupKwargs(backend="hora")`` on its own.

:func:`lightning_fit` is also called by the test's fault job, with ``die_at``: that rank kills
itself inside that step, between forward and backward.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

STEPS = 4
BATCH = 4  # per rank
# A training returns its group, and main() frees the trainer and its DDP model first, the group
# last. Freed by the DDP reducer, torch destroys a Gloo group with the GIL held and waits for
# Gloo's worker threads, one of which may still need the GIL to free its last work's tensors:
# a deadlock (seen here under load; pytorch/pytorch#56297). Freed from Python, the group's
# destructor releases the GIL. The process leaves with os._exit for the same reason.


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS * BATCH * 2, 8, generator=g)
    return TensorDataset(x, (x @ torch.randn(8, 1, generator=g)).tanh())


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def lightning_fit(
    backend: str, hora_env: bool, die_at: int | None = None, t_death: str | None = None
) -> tuple[dict[str, Any], Any]:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy

    import hora.torch.lightning

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()
            self.losses: list[str] = []

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.losses.append(loss.item().hex())
            if i == die_at and t_death:
                Path(t_death).write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    net = Net()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_steps=STEPS,
        strategy=DDPStrategy(process_group_backend=backend),
        plugins=[hora.torch.lightning.HoraEnvironment()] if hora_env else None,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(net, DataLoader(dataset(), batch_size=BATCH))
    out = {"backend": dist.get_backend(), "rank": dist.get_rank(), "losses": net.losses,
           "params": digest(net.net), "size": dist.get_world_size()}  # fmt: skip
    group = dist.group.WORLD
    dist.destroy_process_group()
    return out, group


def accelerate_refusal() -> str:
    """What Accelerate says to the backend named in its own way (why the recipe is needed)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs

    try:
        Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="hora")])
    except ValueError as e:
        return str(e)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # it kept a partial state
    return "accepted"


def accelerate_fit(backend: str) -> tuple[dict[str, Any], Any]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs

    import hora.torch.accelerate

    if backend == "hora":  # the line a user writes first, through hora's helper
        handler = InitProcessGroupKwargs(backend="hora")
        acc = hora.torch.accelerate.accelerator(cpu=True, kwargs_handlers=[handler])
    else:
        acc = Accelerator(cpu=True)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, DataLoader(dataset(), batch_size=BATCH))
    losses, gathered = [], []
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item().hex())
        gathered.append([v.hex() for v in acc.gather(loss.detach()).tolist()])
    out = {"backend": dist.get_backend(), "rank": dist.get_rank(), "losses": losses,
           "gathered": gathered, "state_backend": acc.state.backend,
           "params": digest(acc.unwrap_model(model)), "size": dist.get_world_size()}  # fmt: skip
    group = dist.group.WORLD
    acc.end_training()  # destroys the group
    AcceleratorState._reset_state(reset_partial_state=True)  # a second Accelerator follows
    return out, group


def all_here(out: Path, step: str, res: dict[str, Any]) -> None:
    """Wait until every rank has freed its group of ``step`` (``res``: this rank's results),
    through files in ``out``. The next training's store listens on the same port, and torch's
    stores of one port in one process share a server (``multi_tenant``): a rank that connects
    before rank 0 has freed the last one reaches the old server, and rank 0's new one waits for
    it forever."""
    (out / f".{step}.{res['rank']}").touch()
    deadline = time.monotonic() + 60
    while not all((out / f".{step}.{r}").exists() for r in range(res["size"])):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other ranks did not finish {step} within 60 s")
        time.sleep(0.01)


def main() -> None:
    clients, out = sys.argv[1].split(","), Path(sys.argv[2])
    torch.set_num_threads(1)
    for client in clients:
        results: dict[str, Any] = {}
        if client == "accelerate":
            results["refusal"] = accelerate_refusal()
        for backend in ("hora", "gloo"):
            if client == "lightning":
                results[backend], group = lightning_fit(backend, "--hora-env" in sys.argv)
            else:
                results[backend], group = accelerate_fit(backend)
            gc.collect()  # the trainer, the model and its reducer (cycles among them)
            del group  # then the group (see above)
            all_here(out, f"{client}.{backend}", results[backend])
        rank = results["hora"]["rank"]
        (out / f"{client}.{rank}.json").write_text(json.dumps(results))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no finalizers (see above)


if __name__ == "__main__":
    main()
