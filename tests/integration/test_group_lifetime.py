"""Every torch.distributed group hora builds outlives garbage collection before its first op.

A group made from a store written in Python (hora's ``StoreAdapter``) calls that store's
methods from C++ whenever it needs it. NCCL does so lazily, at its first collective and from
its watchdog thread; Gloo does too under torch's ``TORCH_GLOO_LAZY_INIT=1``. If nothing in
Python holds the store by then, its methods are gone ("Tried to call pure virtual function
::c10d::Store::wait") and the op dies. Gloo with lazy init shows on CPU what NCCL does on a
GPU. Here: real ranks for the Gloo backend's groups (the world, a process set made later,
another after that one was removed: np=3, so that each set leaves a rank out), and at np=2 for
the groups of the ``backend="hora"`` torch.distributed backend. The NCCL backend's flat and
two-level (hierarchical) groups are tested in tests/unit/backends/test_two_level.py, as four
ranks in threads with Gloo groups standing in for NCCL's (no GPU here).
"""

from __future__ import annotations

import pytest

from harness import run_ranks

LAZY = {"TORCH_GLOO_LAZY_INIT": "1", "HORA_GLOO_TIMEOUT_SECONDS": "20"}


def _gloo_backend_sets(rank: int) -> list[float]:
    import gc

    import torch

    import hora.torch as hvd

    hvd.init()
    try:
        gc.collect()
        one = torch.tensor([rank + 1.0])
        out = [hvd.allreduce(one, op=hvd.Sum, name="world").item()]
        ps = hvd.add_process_set([0, 1])
        gc.collect()
        if rank < 2:
            out.append(hvd.allreduce(one, op=hvd.Sum, process_set=ps, name="set").item())
        hvd.remove_process_set(ps)
        again = hvd.add_process_set([1, 2])
        gc.collect()
        if rank > 0:
            out.append(hvd.allreduce(one * 10, op=hvd.Sum, process_set=again, name="b").item())
        out.append(hvd.broadcast(one, root_rank=1, name="bcast").item())
        return out
    finally:
        hvd.shutdown()


@pytest.mark.timeout(120)
def test_gloo_backend_groups_survive_gc_before_their_first_op_with_lazy_init() -> None:
    env = {**LAZY, "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_DYNAMIC_PROCESS_SETS": "1"}
    assert run_ranks(_gloo_backend_sets, 3, timeout=90, env=env) == [
        [6.0, 3.0, 2.0], [6.0, 3.0, 50.0, 2.0], [6.0, 50.0, 2.0]
    ]


def _torch_backend_groups(rank: int) -> list[float]:
    import gc

    import torch
    import torch.distributed as dist

    dist.init_process_group("hora")
    try:
        gc.collect()
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        sub = dist.new_group([0, 1])
        gc.collect()
        u = torch.tensor([rank + 1.0])
        dist.all_reduce(u, group=sub)
        return [t.item(), u.item()]
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_torch_distributed_backend_groups_survive_gc_before_their_first_op() -> None:
    assert run_ranks(_torch_backend_groups, 2, timeout=90, env=LAZY) == [[3.0, 3.0]] * 2
