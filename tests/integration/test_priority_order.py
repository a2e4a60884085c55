"""``priority=`` on real ranks: the timeline shows higher-priority tensors executed first.

Rank 0 submits everything before rank 1 (a barrier orders them), a gate tensor first on rank 0
and last on rank 1, so every other tensor is ready while the
gate still waits; the coordinator holds the small ready tensors for the cycle time (here 2 s,
longer than the few milliseconds between rank 1's submissions) and releases all of them in one
cycle when the gate arrives. The dtypes differ so that nothing is fused: each tensor is its own
response, and rank 0's timeline records the responses in the order they ran.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import run_ranks


def _submit(rank: int, use_priority: bool) -> None:
    import numpy as np

    import hora as hvd

    hvd.init()
    tensors = {"a": np.float32, "b": np.float64, "c": np.int32}
    prio = {"a": 1, "b": 2, "c": 3} if use_priority else {}

    def gate() -> object:
        return hvd.allreduce_async(np.ones(3, np.int64), name="gate")

    handles = [gate()] if rank == 0 else []
    if rank == 1:  # rank 0's requests are all at the coordinator before rank 1's come
        hvd.barrier()
    for n, dt in tensors.items():
        handles.append(hvd.allreduce_async(np.ones(3, dt), name=n, priority=prio.get(n, 0)))
    if rank == 1:
        handles.append(gate())
    else:
        hvd.barrier()
    for h in handles:
        hvd.synchronize(h)
    hvd.shutdown()


def _executed(path: Path) -> list[str]:
    """Tensor names in the order their op's closing ``E`` (with dtype and shape) was written."""
    events = json.loads(path.read_text())
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    return [names[e["pid"]] for e in events if e["ph"] == "E" and "dtype" in e.get("args", {})]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("use_priority", "want"),
    [
        (False, ["allreduce.a", "allreduce.b", "allreduce.c", "allreduce.gate"]),
        (True, ["allreduce.c", "allreduce.b", "allreduce.a", "allreduce.gate"]),
    ],
)
def test_timeline_shows_priority_order(tmp_path: Path, use_priority: bool, want: list[str]) -> None:
    timeline = tmp_path / "t.json"
    env = {"HOROVOD_TIMELINE": str(timeline), "HOROVOD_CYCLE_TIME": "2000"}
    run_ranks(_submit, 2, args=(use_priority,), timeout=90, env=env)
    assert _executed(timeline) == want


def _optimizer_step(rank: int, priority: object) -> None:
    import torch

    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4, bias=False) for _ in range(3)))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        priority=priority,
    )
    loss = model(torch.ones(2, 4)).sum()
    if rank == 1:  # rank 0's gradients all wait at the coordinator when rank 1's arrive
        hvd.barrier()
    loss.backward()  # gradients become ready last layer first
    if rank == 0:
        hvd.barrier()
    opt.step()
    hvd.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("priority", "want"),
    [
        (None, ["2.weight", "1.weight", "0.weight"]),
        ("forward", ["0.weight", "1.weight", "2.weight"]),
        ({"1.weight": 9}, ["1.weight", "2.weight", "0.weight"]),
    ],
)
def test_distributed_optimizer_priority(tmp_path: Path, priority: object, want: list[str]) -> None:
    timeline = tmp_path / "t.json"
    env = {"HOROVOD_TIMELINE": str(timeline), "HOROVOD_CYCLE_TIME": "2000"}
    run_ranks(_optimizer_step, 2, args=(priority,), timeout=90, env=env)
    assert _executed(timeline) == [f"allreduce.{n}" for n in want]
