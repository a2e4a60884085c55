"""The measuring side of ``hora bench scaling``: one training run on one rank, step by step.

:func:`train` is what :mod:`hora.lab.scaling` hands to :func:`hora.run`; it runs on every rank.
It builds one of the examples' models (``examples/pytorch_synthetic_benchmark.py``: mlp, cnn,
resnet50, lstm on synthetic batches; ``examples/pytorch_mnist.py``: the MNIST network on its
dataset, read through a ``DataLoader`` as the example does), wraps the optimizer in
``hora.torch.DistributedOptimizer`` and times every step in four phases:

- data: getting the next batch (zero for synthetic models);
- compute: ``zero_grad``, forward and backward; gradients' allreduces start during backward;
- wait: ``optimizer.synchronize()``, the communication backward did not hide;
- update: ``optimizer.step()`` under ``skip_synchronize()``.

With ``spec.device == "cuda"`` the model and its batches live on ``cuda:<local rank>`` (modulo
the GPUs there, so that staged backends may put several ranks on one GPU; NCCL needs one each).
GPU work is asynchronous, so each phase then ends with ``torch.cuda.synchronize()``: a phase's
time is the time its work took on the device, and the gradients' allreduces still start during
backward (the engine thread does not wait for the host).

Warm-up steps are run and dropped; a barrier precedes the timed ones. Rank 0 writes
``"<done> <total>"`` to ``spec.progress_path`` after every step, when that path is writable on its
host, so the caller can show how far the run is. A watchdog ends the rank with status 124 if the
run is not over within ``spec.timeout`` seconds, so a stuck configuration fails (the launcher
then stops its peers) instead of hanging the benchmark.

Runs in the rank's main thread (the watchdog is a daemon timer thread).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

SYNTHETIC_MODELS = ("mlp", "cnn", "resnet50", "lstm")
MODELS = (*SYNTHETIC_MODELS, "mnist")
# per-process batch sizes that keep a step under a second or so on one CPU core
DEFAULT_BATCH = {"mlp": 64, "cnn": 16, "resnet50": 2, "lstm": 16, "mnist": 64}
# and on one GPU: enough work per step to keep a data-centre GPU busy
DEFAULT_GPU_BATCH = {"mlp": 512, "cnn": 256, "resnet50": 64, "lstm": 128, "mnist": 256}
DEVICES = ("cpu", "cuda")
EXAMPLES = {"synthetic": "pytorch_synthetic_benchmark.py", "mnist": "pytorch_mnist.py"}
TIMEOUT_EXIT = 124


def default_examples_dir() -> str:
    """``examples/`` of the source tree hora is imported from (``src/hora/..`` -> repo root)."""
    return str(Path(__file__).resolve().parents[3] / "examples")


@dataclass(frozen=True)
class TrainSpec:
    """One configuration's training run, as every rank receives it."""

    model: str
    batch_size: int
    steps: int
    warmup: int
    threads: int = 1
    timeout: float = 600.0
    examples_dir: str = ""  # empty: default_examples_dir()
    data_dir: str = "./data"
    progress_path: str | None = None
    device: str = "cpu"  # or cuda: cuda:<local rank>
    # torch DistributedDataParallel instead of hora's DistributedOptimizer (the lab's "ddp"
    # backend): Gloo on the CPU, NCCL on the GPU; hora only starts the ranks and agrees a port
    ddp: bool = False
    compression: str = "none"  # DistributedOptimizer's (hora.lab.compression names)
    ddp_hook: str = ""  # DDP's communication hook: "" or powersgd[-r<R>]

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r}: choose from {', '.join(DEVICES)}")
        if self.model not in MODELS:
            raise ValueError(f"model {self.model!r}: choose from {', '.join(MODELS)}")
        if self.batch_size < 1 or self.steps < 1 or self.warmup < 0:
            raise ValueError(
                f"batch size ({self.batch_size}) and steps ({self.steps}) must be at least 1, "
                f"warm-up ({self.warmup}) at least 0"
            )
        if self.threads < 0 or self.timeout <= 0:
            raise ValueError(f"threads ({self.threads}) >= 0 and timeout ({self.timeout}) > 0")


def load_example(spec: TrainSpec, kind: str) -> ModuleType:
    """Import one of hora's example scripts by path (they are scripts, not a package)."""
    path = Path(spec.examples_dir or default_examples_dir()) / EXAMPLES[kind]
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the scaling lab trains the examples' models; "
            "pass --examples-dir pointing at hora's examples/ directory"
        )
    module_spec = importlib.util.spec_from_file_location(f"hora_example_{kind}", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


Batches = Callable[[], tuple[Any, Any]]


def build(
    spec: TrainSpec, rank: int, size: int, device: Any = "cpu"
) -> tuple[Any, Batches, Callable[..., Any]]:
    """(model, next-batch function, loss function) for ``spec.model``, on ``device``: a
    synthetic batch is made there once, MNIST batches are copied there as they are read."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    if spec.model == "mnist":
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        example = load_example(spec, "mnist")
        train_set, _, _ = example.load_data(spec.data_dir)
        sampler: DistributedSampler[Any] = DistributedSampler(train_set, size, rank)
        loader = DataLoader(train_set, batch_size=spec.batch_size, sampler=sampler, drop_last=True)
        read = _cycle(loader, sampler)

        def to_device() -> tuple[Any, Any]:
            x, y = read()
            return x.to(device), y.to(device)

        return example.Net().to(device), to_device, F.nll_loss

    make, make_input, classes = load_example(spec, "synthetic").MODELS[spec.model]
    data = make_input(spec.batch_size).to(device)
    target = torch.randint(0, classes, (spec.batch_size,)).to(device)
    return make().to(device), lambda: (data, target), F.cross_entropy


def _cycle(loader: Any, sampler: Any) -> Batches:
    def batches() -> Iterator[tuple[Any, Any]]:
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    it = batches()
    return lambda: next(it)


def _report_progress(path: str | None, done: int, total: int) -> None:
    if path is None:
        return
    with contextlib.suppress(OSError):  # not on this host (a remote rank 0): no progress shown
        with open(path + ".tmp", "w") as f:
            f.write(f"{done} {total}\n")
        os.replace(path + ".tmp", path)


def _expire(timeout: float) -> None:
    sys.stderr.write(f"hora bench scaling: no result within {timeout:g} s; giving up\n")
    sys.stderr.flush()
    os._exit(TIMEOUT_EXIT)


def train(spec: TrainSpec) -> dict[str, Any]:
    """Run ``spec`` on this rank; per-step phase times (seconds) and what was trained."""
    watchdog = threading.Timer(spec.timeout, _expire, args=(spec.timeout,))
    watchdog.daemon = True
    watchdog.start()
    try:
        return _train(spec)
    finally:
        watchdog.cancel()


def _device(spec: TrainSpec, local_rank: int) -> tuple[Any, Callable[[], None]]:
    """This rank's torch device, and what ends a timed phase on it (a no-op on the CPU)."""
    import torch

    if spec.device == "cpu":
        return torch.device("cpu"), lambda: None
    if not torch.cuda.is_available():
        raise RuntimeError(f"local rank {local_rank} sees no GPU: it cannot train on cuda")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device, lambda: torch.cuda.synchronize(device)


def _train(spec: TrainSpec) -> dict[str, Any]:
    import torch

    import hora.torch as hvd
    from hora.core.runtime import runtime
    from hora.lab import compression

    if spec.threads > 0:
        torch.set_num_threads(spec.threads)
    hvd.init()
    try:
        rank, size = hvd.rank(), hvd.size()
        device, fence = _device(spec, hvd.local_rank())
        model, next_batch, loss_fn = build(spec, rank, size, device)
        params = [p for p in model.parameters() if p.requires_grad]
        if spec.ddp:
            model = _ddp(model, rank, size, device, hvd, one_bucket=bool(spec.ddp_hook))
            if spec.ddp_hook:
                compression.register_ddp_hook(model, spec.ddp_hook)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01 * size, momentum=0.9)
        optimizer: Any = sgd
        if not spec.ddp:
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                                 compression=compression.make(spec.compression,
                                                                              hvd))  # fmt: skip
        # DDP waits for its last gradients inside backward: its wait phase is empty and its
        # row says so (no comm share) rather than 0%
        synchronize = (lambda: None) if spec.ddp else optimizer.synchronize
        skip = contextlib.nullcontext if spec.ddp else optimizer.skip_synchronize
        phases: dict[str, list[float]] = {k: [] for k in ("data", "compute", "wait", "update")}
        total = spec.warmup + spec.steps
        for i in range(total):
            if i == spec.warmup:
                hvd.barrier()
            t0 = time.perf_counter()
            x, y = next_batch()
            fence()
            t1 = time.perf_counter()
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            fence()
            t2 = time.perf_counter()
            synchronize()
            fence()
            t3 = time.perf_counter()
            with skip():
                optimizer.step()
            fence()
            t4 = time.perf_counter()
            if i >= spec.warmup:
                for key, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    phases[key].append(value)
            if rank == 0:
                _report_progress(spec.progress_path, i + 1, total)
        return {
            "rank": rank,
            "size": size,
            "host": socket.gethostname(),
            "backend": "ddp" if spec.ddp else runtime().backend_name,
            "wait_measured": not spec.ddp,
            # which torch.distributed backend DDP ran on (NCCL on GPUs, Gloo on CPUs)
            **({"ddp_backend": _torch_backend()} if spec.ddp else {}),
            "params": sum(p.numel() for p in params),
            "grad_bytes": sum(p.numel() * p.element_size() for p in params),
            "torch_threads": torch.get_num_threads(),
            "device": str(device),
            **{f"{key}_s": values for key, values in phases.items()},
        }
    finally:
        if spec.ddp:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        hvd.shutdown()


def _torch_backend() -> str:
    import torch.distributed as dist

    return str(dist.get_backend())


def _ddp(model: Any, rank: int, size: int, device: Any, hvd: Any, one_bucket: bool = False) -> Any:
    """``model`` in torch's DistributedDataParallel, its process group started at the address
    hora's peers reach rank 0 on, on a port rank 0 found free there (both broadcast by hora)."""
    import torch
    import torch.distributed as dist

    from hora.core.runtime import runtime
    from hora.launch.local import interfaces

    where: tuple[str, int] = ("127.0.0.1", 0)
    transport = runtime().engine.members[0].comm.transport
    mine = getattr(transport, "listen_address", where)[0]
    if rank == 0:
        with socket.socket() as s:
            s.bind((mine, 0))
            where = (mine, s.getsockname()[1])
    addr, port = hvd.broadcast_object(where, 0, name="lab.ddp_address")
    # Gloo's pairs take the address the host name resolves to (often 127.0.0.1): across
    # hosts, the interface hora's own connections use instead, unless the user named one
    iface = next((name for name, addrs in interfaces().items() if mine in addrs), None)
    if iface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{addr}:{port}",
                            rank=rank, world_size=size)  # fmt: skip
    # a communication hook gets all gradients in one bucket: torch's PowerSGD hook over Gloo
    # aborted with a collective size mismatch with the default 25 MB buckets
    return torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if cuda else None, bucket_cap_mb=200 if one_bucket else 25
    )

