"""Blocking ``torch.distributed`` calls on ``backend="hora"``: run by the caller's thread.

``dist.all_reduce(t)`` (``async_op=False``) goes as hora.torch's blocking forms go: where hora's
direct mode lets it, the calling thread runs the op's round itself instead of handing it to the
engine's thread and waiting for it to come back. These tests run real ranks and check that it
does (the engine counts the rounds callers ran), that it gives the same bits as the async path
on every collective it serves, that a loop after a training pattern still reaches that path,
and that failures still reach every rank: a shape mismatch raises on every rank, a rank that
dies makes the others' blocking call raise, naming it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from harness import run_ranks, spawn_ranks


def _start() -> Any:
    import torch.distributed as dist

    import hora.torch.distributed  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group(backend="hora")
    from hora.core import runtime

    return runtime.runtime().engine


def same_bits(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    engine = _start()
    n = dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    base = torch.randn(1000, generator=gen, dtype=torch.float32) * 1e3

    def calls(async_op: bool) -> list[torch.Tensor]:
        out = []
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
            t = base.clone()
            w = dist.all_reduce(t, op=op, async_op=async_op)
            if async_op:
                w.wait()
            out.append(t)
        t = base.clone()
        w = dist.broadcast(t, src=n - 1, async_op=async_op)
        if async_op:
            w.wait()
        out.append(t)
        g = torch.zeros(n * 1000)
        w = dist.all_gather_into_tensor(g, base, async_op=async_op)
        if async_op:
            w.wait()
        out.append(g)
        o = torch.zeros(1000 // n * n // n)
        w = dist.reduce_scatter_tensor(o, base[: o.numel() * n].clone(), async_op=async_op)
        if async_op:
            w.wait()
        out.append(o)
        return out

    for _ in range(8):  # the pattern is learnt, the set goes to direct mode
        calls(True)
        calls(False)
    before = engine._inline_runs
    blocking = calls(False)
    ran_here = engine._inline_runs - before
    asynchronous = calls(True)
    # a loop of one call after that pattern: still the caller's
    before = engine._inline_runs
    t = base.clone()
    for _ in range(40):
        dist.all_reduce(t[:10])
    loop_here = engine._inline_runs - before
    # one tensor reduced again and again: remembered as hora.torch.allreduce_ remembers it;
    # then a new tensor of its kind each call (a metric made anew each step), the same call
    v = base[:10].clone()
    express = engine.stats["express"]
    for _ in range(40):
        v.copy_(base[:10])
        dist.all_reduce(v)
    anew, fresh_ok = engine.stats["express"], True
    for _ in range(40):
        fresh = base[:10].clone()
        dist.all_reduce(fresh)
        fresh_ok = fresh_ok and torch.equal(fresh, v)
    again = (anew - express, engine.stats["express"] - anew, fresh_ok)
    # the Work of a blocking call, as a direct caller of the group gets it
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    u = base.clone()
    work = dist.distributed_c10d._get_default_group().allreduce([u], opts)
    got = work.get_future().wait()
    dist.destroy_process_group()
    return {
        "equal": [torch.equal(a, b) for a, b in zip(blocking, asynchronous)],
        "sum": blocking[0],
        "ran_here": ran_here,
        "loop_here": loop_here,
        "again": again,
        "again_sum": torch.equal(v, blocking[0][:10]),
        "work": (work.is_completed(), work.wait(), got[0] is u),
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 3])
def test_a_blocking_call_runs_in_the_callers_thread_with_the_async_bits(n: int) -> None:
    per_rank = run_ranks(same_bits, n, timeout=150)
    want = sum(torch.randn(1000, generator=torch.Generator().manual_seed(r)) * 1e3
               for r in range(n))  # fmt: skip
    for rank, res in enumerate(per_rank):
        assert all(res["equal"]), f"rank {rank}: blocking and async differ: {res['equal']}"
        torch.testing.assert_close(res["sum"], want)
        # every call of the battery but the first ones of a round ran in the caller's thread
        assert res["ran_here"] > 0, f"rank {rank}: no blocking call ran in its caller's thread"
        assert res["loop_here"] > 0, f"rank {rank}: the loop never ran in the caller's thread"
        assert res["work"] == (True, True, True), res["work"]
        assert res["again"][0] >= 35 and res["again"][1] >= 35, res["again"]
        assert res["again"][2] and res["again_sum"], res["again"]


def failures(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    _start()
    out: dict[str, Any] = {}
    t = torch.ones(4)
    for _ in range(20):  # steady: the set is in direct mode, calls run in this thread
        dist.all_reduce(t)
    try:
        dist.all_reduce(torch.ones(5 + rank))  # one shape on each rank
        out["mismatch"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["mismatch"] = (type(e).__name__, str(e))
    t = torch.ones(4)
    for _ in range(20):
        t.fill_(1.0)
        dist.all_reduce(t)
    out["after"] = t.tolist()
    if rank == 1:
        os._exit(3)  # dies between two blocking calls of the loop
    try:
        for _ in range(1000):
            dist.all_reduce(t)
        out["lost"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["lost"] = (type(e).__name__, str(e))
    return out


@pytest.mark.timeout(150)
def test_blocking_calls_still_fail_on_every_rank() -> None:
    results = spawn_ranks(failures, 3, timeout=120)
    assert results[1].returncode == 3, results[1].stderr[-2000:]
    for res in (results[0], results[2]):
        assert res.ok, f"rank {res.rank}: {res.status}\n{res.value}\n{res.stderr[-3000:]}"
        kind, text = res.value["mismatch"]
        assert kind == "DistBackendError" and "hora backend: allreduce" in text, text
        assert "shape" in text, text
        assert res.value["after"] == [3.0] * 4
        kind, text = res.value["lost"]
        assert kind == "DistBackendError" and "hora backend: allreduce" in text, text
        assert "rank 1" in text, text
