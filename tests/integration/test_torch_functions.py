"""broadcast_parameters / broadcast_optimizer_state / objects, and SyncBatchNorm, on real ranks.

Ranks start from different models and optimizer states; every check knows what the root holds
(it can rebuild it from the root's seed) and asserts that every rank ends with exactly that.
SyncBatchNorm is compared with ``BatchNorm`` over the concatenated global batch.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks

SIZES = [2, 3]


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 2)
    )


def trained(seed: int, make_opt: Any, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and optimizer after ``steps`` local steps on seed-specific data."""
    model = make_model(seed)
    opt = make_opt(model.parameters(), seed)
    g = torch.Generator().manual_seed(100 + seed)
    for _ in range(steps):
        opt.zero_grad()
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


def sgd(params: Any, seed: int) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1 * (seed + 1), momentum=0.9, weight_decay=1e-4)


def adam(params: Any, seed: int) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01 * (seed + 1), betas=(0.8, 0.9 + 0.01 * seed))


def rmsprop(params: Any, seed: int) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(params, lr=0.01, momentum=0.5 * seed, centered=True)


def same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert [{k: v for k, v in g.items() if k != "params"} for g in sa["param_groups"]] == [
        {k: v for k, v in g.items() if k != "params"} for g in sb["param_groups"]
    ]
    assert sa["state"].keys() == sb["state"].keys()
    for pid, state in sa["state"].items():
        assert state.keys() == sb["state"][pid].keys(), pid
        for key, value in state.items():
            other = sb["state"][pid][key]
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype, (pid, key)
                torch.testing.assert_close(value, other, atol=0, rtol=0)
            else:
                assert value == other, (pid, key)


def check_broadcast_parameters(hvd: Any, r: int, n: int) -> None:
    root = n - 1
    model, _ = trained(r, sgd, steps=r + 1)  # BatchNorm buffers differ too (int64 counter)
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    want, _ = trained(root, sgd, steps=root + 1)
    for (k, v), w in zip(model.state_dict().items(), want.state_dict().values()):
        torch.testing.assert_close(v, w, atol=0, rtol=0, msg=k)
    other = make_model(r + 10)
    hvd.broadcast_parameters(other.named_parameters(), root_rank=0)
    for p, q in zip(other.parameters(), make_model(10).parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
    plain = [torch.full((3,), float(r))]
    hvd.broadcast_parameters(plain, root_rank=root)
    assert plain[0].tolist() == [float(root)] * 3
    with pytest.raises(ValueError, match="invalid params"):
        hvd.broadcast_parameters(torch.ones(2), 0)


def check_broadcast_optimizer_state(hvd: Any, r: int, n: int) -> None:
    root = n - 1
    for make_opt in (sgd, adam, rmsprop):
        # Rank 0 has never stepped (empty state); the root has stepped several times.
        _, opt = trained(r, make_opt, steps=r)
        hvd.broadcast_optimizer_state(opt, root_rank=root)
        _, want = trained(root, make_opt, steps=root)
        same_state(opt, want)


def check_broadcast_optimizer_state_of_wrapped_optimizer(hvd: Any, r: int, n: int) -> None:
    model, opt = trained(r, adam, steps=r + 1)
    dist = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(dist, root_rank=0)
    _, want = trained(0, adam, steps=1)
    same_state(opt, want)
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match="LBFGS"):
        hvd.broadcast_optimizer_state(lbfgs, root_rank=0)


def check_objects(hvd: Any, r: int, n: int) -> None:
    obj = {"rank": r, "tensor": torch.full((2,), float(r)), "fn": lambda v: v + r}
    got = hvd.broadcast_object(obj, root_rank=n - 1)
    assert got["rank"] == n - 1 and got["tensor"].tolist() == [n - 1.0] * 2
    assert got["fn"](1) == n
    assert hvd.allgather_object(("r", r)) == [("r", k) for k in range(n)]
    assert hvd.broadcast_object(None if r else [1, 2]) == [1, 2]


def check_sync_batch_norm_matches_global_batch_norm(hvd: Any, r: int, n: int) -> None:
    counts = [k + 2 for k in range(n)]  # uneven shards
    g = torch.Generator().manual_seed(5)
    full = torch.randn(sum(counts), 3, 4, generator=g) * 3 + 1
    upstream = torch.randn(full.shape, generator=g)
    start = sum(counts[:r])
    mine = full[start : start + counts[r]].clone().requires_grad_()

    torch.manual_seed(0)
    ref = torch.nn.BatchNorm1d(3)
    torch.manual_seed(0)
    sync = hvd.SyncBatchNorm(3)
    with torch.no_grad():
        for bn in (ref, sync):
            bn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
            bn.bias.copy_(torch.tensor([0.0, -1.0, 3.0]))
    full_in = full.clone().requires_grad_()
    ref_out = ref(full_in)
    (ref_out * upstream).sum().backward()
    out = sync(mine)
    (out * upstream[start : start + counts[r]]).sum().backward()
    close = {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out, ref_out[start : start + counts[r]], **close)
    torch.testing.assert_close(mine.grad, full_in.grad[start : start + counts[r]], **close)
    torch.testing.assert_close(sync.running_mean, ref.running_mean, **close)
    torch.testing.assert_close(sync.running_var, ref.running_var, **close)
    # weight/bias gradients are local; their sum over ranks is the global one.
    total = hvd.allreduce(sync.weight.grad, op=hvd.Sum, name="bn.wgrad")
    torch.testing.assert_close(total, ref.weight.grad, **close)
    sync.eval()
    ref.eval()
    torch.testing.assert_close(sync(mine.detach()), ref(mine.detach()), **close)


CHECKS = {name: fn for name, fn in dict(globals()).items() if name.startswith("check_")}


def run_all(rank: int) -> dict[str, str]:
    import hora.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    size = int(os.environ["HORA_SIZE"])
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn(hvd, rank, size)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        hvd.barrier()
    hvd.shutdown()
    return results


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"np{n}")
def battery(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, str]]]:
    return request.param, run_ranks(run_all, request.param, timeout=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_torch_function(battery: tuple[int, list[dict[str, str]]], check: str) -> None:
    np_, per_rank = battery
    for rank, results in enumerate(per_rank):
        assert results.get(check) == "ok", f"np={np_} rank {rank}:\n{results.get(check)}"
