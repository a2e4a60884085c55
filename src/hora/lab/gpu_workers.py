"""The measuring side of ``hora bench allreduce --device cuda``: one process per rank and GPU.

The bench starts these for the CUDA backends (``python -m hora.lab.gpu_workers
<hora-nccl|hora-staged|nccl> <plan.json>``), with the plan and result file of the CPU workers
(:mod:`hora.lab.workers`, whose timing helpers and command line they share).
Rank ``r`` works on ``cuda:<local rank>``. Every backend reduces a float32 CUDA tensor in place
with Sum: ``hvd.allreduce_(t, op=hvd.Sum)`` through :mod:`hora.torch` (on the backend the
variant's name promises, checked: a worker that hora put on another backend fails), or
``dist.all_reduce(t)`` on an NCCL process group.

GPU work is asynchronous: a call returns once its work is queued. So every timed call here ends
with ``torch.cuda.synchronize()``, and a call's time runs from the host's call until the result
is in the tensor; as every call ends that way, the device is idle when the next one starts. The
barrier before each timed batch synchronizes too. The first call of each size is checked against
the expected sum; the timed calls then run on zeros.

Single-threaded script (hora's engine thread aside); nothing here is imported by the rest of
hora.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from hora.lab.gpu import EXPECTED_BACKEND
from hora.lab.workers import Call, Sink, main, time_batch

MakeCall = Callable[[Any, int], Call]


def _checked(t: Any, call: Call, size: int, label: str) -> None:
    """One reduction of ``rank + 1`` everywhere, checked on the device, then ``t`` zeroed."""
    call()
    expected = size * (size + 1) / 2
    wrong = int((t != expected).sum().item())
    if wrong:
        first = t[:4].tolist()
        raise RuntimeError(
            f"{label} allreduce gave {first}... ({wrong} wrong), expected {expected} everywhere"
        )
    t.zero_()


def measure_cuda_sizes(
    plan: dict[str, Any],
    rank: int,
    size: int,
    device: Any,
    make_call: MakeCall,
    barrier: Call,
) -> None:
    """Per size of the plan: one checked call, then the timed ones, each ending in a device
    synchronize; rank 0 writes the rows."""
    import torch

    sink = Sink(plan["out"], rank, plan["label"])
    for nbytes, iters, warmup in zip(plan["sizes"], plan["iters"], plan["warmup"]):
        t = torch.full((nbytes // 4,), float(rank + 1), dtype=torch.float32, device=device)
        reduce = make_call(t, nbytes)

        def call(reduce: Call = reduce) -> None:
            reduce()
            torch.cuda.synchronize(device)

        _checked(t, call, size, plan["label"])
        sink.put("allreduce", nbytes, 1, warmup, time_batch(call, iters, warmup, barrier))
        del t, reduce


def run_hora_cuda(plan: dict[str, Any]) -> None:
    """hora.torch on CUDA tensors, on the backend ``plan["label"]`` names."""
    import torch

    import hora.torch as hvd
    from hora.core.runtime import runtime

    hvd.init()
    try:
        label = plan["label"]
        used, expected = runtime().backend_name, EXPECTED_BACKEND[label]
        if used != expected:
            raise RuntimeError(
                f"{label} needs hora's {expected} backend, but hora chose {used} "
                "(see HOROVOD_GPU_OPERATIONS / HOROVOD_CPU_OPERATIONS in docs/gpu.md)"
            )
        # ranks beyond the GPUs share them (the staged path; NCCL's rows are skipped there)
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)

        def make_call(t: Any, nbytes: int) -> Call:
            name = f"bench.{nbytes}"
            return lambda: hvd.allreduce_(t, op=hvd.Sum, name=name)

        def barrier() -> None:
            hvd.barrier()
            torch.cuda.synchronize(device)

        measure_cuda_sizes(plan, hvd.rank(), hvd.size(), device, make_call, barrier)
    finally:
        hvd.shutdown()


def run_nccl(plan: dict[str, Any]) -> None:
    """torch.distributed's NCCL called directly: ``dist.all_reduce`` on the CUDA tensor."""
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=timedelta(seconds=plan["timeout"]), device_id=device)
    try:

        def make_call(t: Any, nbytes: int) -> Call:
            return lambda: dist.all_reduce(t)

        def barrier() -> None:
            dist.barrier(device_ids=[local])
            torch.cuda.synchronize(device)

        rank, size = dist.get_rank(), dist.get_world_size()
        measure_cuda_sizes(plan, rank, size, device, make_call, barrier)
    finally:
        dist.destroy_process_group()


RUNNERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "hora-nccl": run_hora_cuda,
    "hora-staged": run_hora_cuda,
    "nccl": run_nccl,
}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], RUNNERS, "hora.lab.gpu_workers"))
