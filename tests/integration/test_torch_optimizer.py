"""DistributedOptimizer on real ranks: N ranks on 1/N of a batch each end where one process on
the whole batch ends (plain, accumulation, fp16, groups, predivide, Adam, sparse, unused
parameters, Adasum), communication starts during backward, and misuse raises Horovod's errors.

Every rank computes the single-process reference itself (same seed, same data), so each check
compares against local torch arithmetic.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks

SIZES = [2, 3]
ROWS = 12  # divisible by every world size and accumulation count used below


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, 5, generator=g), torch.randn(ROWS, 3, generator=g)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(make_opt: Callable[[Any], torch.optim.Optimizer], steps: int = 3) -> torch.nn.Module:
    model = make_model()
    opt = make_opt(model.parameters())
    x, y = data()
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model


def distributed(
    hvd: Any,
    r: int,
    n: int,
    make_opt: Callable[[Any], torch.optim.Optimizer],
    steps: int = 3,
    bpps: int = 1,
    **kw: Any,
) -> torch.nn.Module:
    model = make_model()
    opt = hvd.DistributedOptimizer(
        make_opt(model.parameters()),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=bpps,
        **kw,
    )
    x, y = (t.chunk(n)[r] for t in data())
    for _ in range(steps):
        opt.zero_grad()
        for mx, my in zip(x.chunk(bpps), y.chunk(bpps)):
            (F.mse_loss(model(mx), my) / bpps).backward()
        opt.step()
    return model


def same_params(a: torch.nn.Module, b: torch.nn.Module, tol: float = 1e-5) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(
            p, q, atol=tol, rtol=tol, msg=lambda m, name=name: f"{name}: {m}"
        )


def check_matches_single_process(hvd: Any, r: int, n: int) -> None:
    same_params(distributed(hvd, r, n, sgd), reference(sgd))


def check_backward_passes_per_step(hvd: Any, r: int, n: int) -> None:
    same_params(distributed(hvd, r, n, sgd, bpps=2), reference(sgd))


def check_fp16_compression(hvd: Any, r: int, n: int) -> None:
    model = distributed(hvd, r, n, sgd, compression=hvd.Compression.fp16)
    same_params(model, reference(sgd), tol=2e-3)


def check_groups(hvd: Any, r: int, n: int) -> None:
    same_params(distributed(hvd, r, n, sgd, groups=2), reference(sgd))
    model = make_model()
    first = list(model.parameters())[:2]
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), groups=[first])
    x, y = (t.chunk(n)[r] for t in data())
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    same_params(model, reference(sgd))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same_params(distributed(hvd, r, n, sgd, num_groups=1), reference(sgd))
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)


def check_add_param_group(hvd: Any, r: int, n: int) -> None:
    model = make_model()
    first, second = model[0], model[2]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9))
    opt.add_param_group({"params": list(second.parameters())})
    x, y = (t.chunk(n)[r] for t in data())
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    same_params(model, reference(sgd))


def check_predivide_and_sum(hvd: Any, r: int, n: int) -> None:
    same_params(distributed(hvd, r, n, sgd, gradient_predivide_factor=2.0), reference(sgd))

    def sgd_scaled(params: Any) -> torch.optim.Optimizer:  # Sum of N shard means = N x mean
        return torch.optim.SGD(params, lr=0.1 / n, momentum=0.9)

    same_params(distributed(hvd, r, n, sgd_scaled, op=hvd.Sum), reference(sgd))


def check_adam(hvd: Any, r: int, n: int) -> None:
    def adam(params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=0.01)

    same_params(distributed(hvd, r, n, adam), reference(adam))


def check_sparse_gradients(hvd: Any, r: int, n: int) -> None:
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.ModuleDict(
            {"emb": torch.nn.Embedding(10, 4, sparse=True), "out": torch.nn.Linear(4, 1)}
        )

    ids = torch.arange(ROWS) % 7
    target = torch.linspace(-1, 1, ROWS).unsqueeze(1)

    def loss(m: torch.nn.Module, i: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(m["out"](m["emb"](i)), t)

    ref = build()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(2):
        ref_opt.zero_grad()
        loss(ref, ids, target).backward()
        ref_opt.step()
    for dense in (False, True):
        model = build()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5),
            named_parameters=model.named_parameters(),
            sparse_as_dense=dense,
        )
        for _ in range(2):
            opt.zero_grad()
            loss(model, ids.chunk(n)[r], target.chunk(n)[r]).backward()
            opt.step()
        same_params(model, ref)


def check_unused_parameter_reduced_as_zero(hvd: Any, r: int, n: int) -> None:
    model = make_model()
    extra = torch.nn.Linear(5, 3)
    params = list(model.parameters()) + list(extra.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=1.0))
    x, y = data()
    before = extra.weight.detach().clone()
    out = model(x.chunk(n)[r])
    if r == 0:  # only rank 0 uses the extra layer
        out = out + extra(x.chunk(n)[r])
    F.mse_loss(out, y.chunk(n)[r]).backward()
    opt.step()
    # Expected: rank 0's gradient averaged with zeros from everyone else. Rebuilding both layers
    # in the same order from the same seed gives the same initial values.
    m0, e0 = make_model(), torch.nn.Linear(5, 3)
    assert torch.equal(e0.weight, before)
    grad_ref = torch.autograd.grad(
        F.mse_loss(m0(x.chunk(n)[0]) + e0(x.chunk(n)[0]), y.chunk(n)[0]), e0.weight
    )[0]
    torch.testing.assert_close(extra.weight.detach(), before - grad_ref / n, atol=1e-5, rtol=1e-5)


def check_reductions_start_during_backward(hvd: Any, r: int, n: int) -> None:
    model = make_model()
    opt = hvd.DistributedOptimizer(
        sgd(model.parameters()), named_parameters=model.named_parameters()
    )
    x, y = (t.chunk(n)[r] for t in data())
    F.mse_loss(model(x), y).backward()
    # Before step(): every gradient's allreduce has already been submitted by its hook.
    assert len(opt._handles) == len(list(model.parameters()))
    opt.step()
    assert not opt._handles


def check_synchronize_skip_and_clip(hvd: Any, r: int, n: int) -> None:
    ref = make_model()
    ref_opt = sgd(ref.parameters())
    x, y = data()
    F.mse_loss(ref(x), y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    ref_opt.step()
    model = make_model()
    opt = hvd.DistributedOptimizer(
        sgd(model.parameters()), named_parameters=model.named_parameters()
    )
    F.mse_loss(model(x.chunk(n)[r]), y.chunk(n)[r]).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()
    same_params(model, ref)
    F.mse_loss(model(x.chunk(n)[r]), y.chunk(n)[r]).backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()


def check_set_backward_passes_per_step(hvd: Any, r: int, n: int) -> None:
    model = make_model()
    opt = hvd.DistributedOptimizer(
        sgd(model.parameters()), named_parameters=model.named_parameters()
    )
    opt.set_backward_passes_per_step(2)
    x, y = (t.chunk(n)[r] for t in data())
    for _ in range(3):
        opt.zero_grad()
        for mx, my in zip(x.chunk(2), y.chunk(2)):
            (F.mse_loss(model(mx), my) / 2).backward()
        opt.step()
    same_params(model, reference(sgd))
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        opt.set_backward_passes_per_step(0)


def check_misuse_errors(hvd: Any, r: int, n: int) -> None:
    model = make_model()
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(
            sgd(model.parameters()), named_parameters=[("a", p) for _, p in named]
        )
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named[:1])
    with pytest.raises(ValueError, match="tuples"):
        hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=[p for _, p in named])
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(sgd(model.parameters()), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(sgd(model.parameters()), op=hvd.Sum, gradient_predivide_factor=2.0)
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named)
    x, y = (t.chunk(n)[r] for t in data())
    F.mse_loss(model(x), y).backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        F.mse_loss(model(x), y).backward()
    opt.synchronize()  # drains what the first pass started; the object is usable again
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def check_adasum(hvd: Any, r: int, n: int) -> None:
    if n & (n - 1):
        return  # Adasum needs a power-of-two number of ranks
    lr = 0.1
    model = distributed(hvd, r, n, lambda p: torch.optim.SGD(p, lr=lr), steps=1, op=hvd.Adasum)
    # Reference: every rank's SGD delta, combined pairwise with the Adasum rule per tensor.
    x, y = data()
    deltas = []
    for k in range(n):
        m = make_model()
        F.mse_loss(m(x.chunk(n)[k]), y.chunk(n)[k]).backward()
        deltas.append([-lr * p.grad for p in m.parameters()])

    def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        dot = (a.double() * b.double()).sum()
        na, nb = (a.double() ** 2).sum(), (b.double() ** 2).sum()
        return ((1 - dot / (2 * na)) * a.double() + (1 - dot / (2 * nb)) * b.double()).float()

    while len(deltas) > 1:
        deltas = [
            [combine(a, b) for a, b in zip(deltas[i], deltas[i + 1])]
            for i in range(0, len(deltas), 2)
        ]
    for p, p0, d in zip(model.parameters(), make_model().parameters(), deltas[0]):
        torch.testing.assert_close(p.detach(), p0.detach() + d, atol=1e-5, rtol=1e-4)


def check_lr_warmup_on_distributed_optimizer(hvd: Any, r: int, n: int) -> None:
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    sched = hvd.LinearScalingWarmup(opt, warmup_epochs=2)
    x, y = (t.chunk(n)[r] for t in data())
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * n)


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
        hvd.barrier()  # a failed check must not leave ranks at different points
    hvd.shutdown()
    return results


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"np{n}")
def battery(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, str]]]:
    return request.param, run_ranks(run_all, request.param, timeout=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_distributed_optimizer(battery: tuple[int, list[dict[str, str]]], check: str) -> None:
    np_, per_rank = battery
    for rank, results in enumerate(per_rank):
        assert results.get(check) == "ok", f"np={np_} rank {rank}:\n{results.get(check)}"
