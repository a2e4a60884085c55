"""What CPU binding does to the rest of a training process (docs/settings.md, "CPU binding").

Run under the launcher, once per setting, and compare rank 0's RESULT lines:

    HORA_CPU_BIND=auto hora run -np 2 python scripts/cpu_bind_bench.py
    HORA_CPU_BIND=none hora run -np 2 python scripts/cpu_bind_bench.py
    HORA_CPU_BIND=crowded hora run -np 4 python scripts/cpu_bind_bench.py   # ranks > cores
    HORA_CPU_BIND=none hora run -np 4 python scripts/cpu_bind_bench.py
    HORA_CPU_OPERATIONS=gloo HORA_CPU_BIND=auto hora run -np 2 python scripts/cpu_bind_bench.py

After ``hvd.init()`` (where the binding happens) it times: a 4 KiB hora allreduce; a 4 KiB and a
4 MiB torch.distributed Gloo allreduce; one pass of a DataLoader with two worker processes over
CPU-heavy samples; a small CNN's and an MLP's (784-1024-1024-10, batch 64) training step under
DistributedOptimizer with the number of torch threads init() left (its share of the cores unless
OMP_NUM_THREADS says otherwise); 50 async 64 KiB allreduces in flight together. Times in ms, the
DataLoader pass in s.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import hora.torch as hvd


def per_call_ms(fn: Callable[[], object], iters: int = 300, warmup: int = 30) -> float:
    for _ in range(warmup):
        fn()
    hvd.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int) -> torch.Tensor:
        a = torch.randn(64, 64)
        for _ in range(8):
            a = torch.tanh(a @ a.T / 64)
        return a.sum()


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict[str, object] = {
        "rank": rank,
        "affinity": sorted(os.sched_getaffinity(0)),
        "bind": os.environ.get("HORA_CPU_BIND", "default"),
        "ops": os.environ.get("HORA_CPU_OPERATIONS", "native"),
        "torch_threads": torch.get_num_threads(),
    }
    x = torch.ones(1024)
    out["hora_4k_ms"] = per_call_ms(lambda: hvd.allreduce_(x, name="lat"))

    port = int(hvd.broadcast_object(29500 + os.getpid() % 1000, 0, name="port"))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    small, big = torch.ones(1024), torch.ones(1 << 20)
    out["torchdist_4k_ms"] = per_call_ms(lambda: dist.all_reduce(small))
    out["torchdist_4m_ms"] = per_call_ms(lambda: dist.all_reduce(big), iters=20, warmup=3)

    hvd.barrier()
    start = time.perf_counter()
    for _ in torch.utils.data.DataLoader(Samples(), batch_size=16, num_workers=2):
        pass
    out["dataloader_2workers_s"] = time.perf_counter() - start

    hvd.barrier()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 24 * 24, 10),
    )
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    xb, yb = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()

    out["cnn_step_ms"] = per_call_ms(step, iters=30, warmup=5)

    mlp = torch.nn.Sequential(
        torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(), torch.nn.Linear(1024, 10),
    )
    mopt = hvd.DistributedOptimizer(
        torch.optim.SGD(mlp.parameters(), lr=0.01), named_parameters=mlp.named_parameters()
    )
    xm, ym = torch.randn(64, 784), torch.randint(0, 10, (64,))

    def mlp_step() -> None:
        mopt.zero_grad()
        torch.nn.functional.cross_entropy(mlp(xm), ym).backward()
        mopt.step()

    out["mlp_step_ms"] = per_call_ms(mlp_step, iters=100, warmup=10)
    burst = [torch.ones(16 << 10) for _ in range(50)]  # 50 tensors of 64 KiB

    def fused() -> None:
        handles = [hvd.allreduce_async_(t, name=f"burst.{i}") for i, t in enumerate(burst)]
        for h in handles:
            hvd.synchronize(h)

    out["burst_50x64k_ms"] = per_call_ms(fused, iters=100, warmup=10)
    dist.destroy_process_group()
    print("RESULT", json.dumps(out), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
