"""Horovod scripts that must behave on hora.torch as they do on Horovod, on real ranks.

Each check is one usage pattern from a Horovod script: unnamed ops of different kinds in flight
together, sparse gradients with SparseAdam (with and without ``sparse_as_dense``), the
exception classes Horovod scripts catch, the gradients ``broadcast_optimizer_state`` leaves
behind, Horovod's warning text for ``step()`` after ``synchronize()``, the return
convention of ``alltoall`` in both APIs, and the optimizer's ``_parameter_names``.
"""

from __future__ import annotations

import os
import traceback
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from harness import run_ranks

SIZES = [2]
ROWS = 8  # divisible by every world size used here


def check_unnamed_ops_of_different_kinds_in_flight(hvd: Any, r: int, n: int) -> None:
    handles = [
        hvd.broadcast_async(torch.full((3,), float(r)), root_rank=0),
        hvd.allgather_async(torch.full((2,), float(r))),
        hvd.allgather_async(torch.full((1,), float(r))),
        hvd.allreduce_async(torch.ones(2), op=hvd.Sum),
        hvd.alltoall_async(torch.arange(float(n))),
        hvd.reducescatter_async(torch.ones(n), op=hvd.Sum),
    ]
    hvd.barrier()
    bc, ag2, ag1, ar, a2a, rs = (hvd.synchronize(h) for h in handles)
    assert bc.tolist() == [0.0] * 3
    assert ag2.tolist() == [float(k) for k in range(n) for _ in range(2)]
    assert ag1.tolist() == [float(k) for k in range(n)]
    assert ar.tolist() == [float(n)] * 2
    assert a2a[0].tolist() == [float(r)] * n
    assert rs.tolist() == [float(n)]


def _embedding(seed: int = 0) -> torch.nn.Embedding:
    torch.manual_seed(seed)
    return torch.nn.Embedding(10, 4, sparse=True)


def _ids_and_targets() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 10, (ROWS,), generator=g), torch.randn(ROWS, 4, generator=g)


def check_sparse_gradients_with_sparse_adam(hvd: Any, r: int, n: int) -> None:
    ids, target = _ids_and_targets()
    ref = _embedding()
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    for _ in range(3):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(ids), target).backward()
        ref_opt.step()
    for dense in (False, True):
        model = _embedding()
        opt = hvd.DistributedOptimizer(
            torch.optim.SparseAdam(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            sparse_as_dense=dense,
        )
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        for _ in range(3):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(ids.chunk(n)[r]), target.chunk(n)[r])
            loss.backward()
            opt.step()
            assert model.weight.grad is not None and model.weight.grad.is_sparse, dense
        torch.testing.assert_close(model.weight, ref.weight, atol=1e-5, rtol=1e-5)


def check_not_supported_errors_are_runtime_errors(hvd: Any, r: int, n: int) -> None:
    import hora

    attempts = [
        lambda: hvd.reducescatter(torch.ones(n), op=hvd.Adasum),
        lambda: hvd.reducescatter_async(torch.ones(n), op=hvd.Adasum),
        lambda: hvd.grouped_reducescatter([torch.ones(n)], op=hvd.Adasum),
        lambda: hora.reducescatter(np.ones(n), op=hora.Adasum),
    ]
    for attempt in attempts:
        with pytest.raises(RuntimeError, match="Adasum") as caught:
            attempt()
        assert isinstance(caught.value, NotImplementedError)
        assert not isinstance(caught.value, hvd.HorovodInternalError)  # elastic must not retry
    # Horovod: ValueError('Tensor type ... is not supported.')
    with pytest.raises(ValueError, match="not supported"):
        hvd.allreduce(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="not supported"):
        hora.allreduce(np.ones(2, dtype=np.complex64))


def check_broadcast_optimizer_state_leaves_zero_grads(hvd: Any, r: int, n: int) -> None:
    torch.manual_seed(r)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model[1].bias.requires_grad_(False)
    model[1].weight.grad = torch.full_like(model[1].weight, 5.0)  # a gradient already there
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9, weight_decay=0.5)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b), "broadcast_optimizer_state moved a parameter"
    w0, b0, w1, b1 = model.parameters()
    assert torch.equal(w0.grad, torch.zeros_like(w0)) and torch.equal(b0.grad, torch.zeros_like(b0))
    assert torch.equal(w1.grad, torch.full_like(w1, 5.0)), "an existing gradient was replaced"
    assert b1.grad is None, "a parameter that does not require grad got a gradient"
    emb = _embedding()
    hvd.broadcast_optimizer_state(torch.optim.SparseAdam(emb.parameters()), root_rank=0)
    assert emb.weight.grad is not None and emb.weight.grad.is_sparse
    assert emb.weight.grad.to_dense().abs().sum() == 0


def check_step_after_synchronize_warns_horovod_text(hvd: Any, r: int, n: int) -> None:
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    model(torch.ones(2, 3)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    texts = [str(w.message) for w in caught]
    horovod = (
        "optimizer.step() called without optimizer.skip_synchronize() context after "
        "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
        "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
        "your code."
    )
    assert any(t.startswith(horovod) for t in texts), texts


def check_alltoall_return_convention(hvd: Any, r: int, n: int) -> None:
    import hora

    even = np.arange(2.0 * n) + 100 * r
    out = hora.alltoall(even, name="conv.np.even")
    assert isinstance(out, np.ndarray), type(out)
    assert out.tolist() == [100.0 * s + 2 * r + k for s in range(n) for k in range(2)]
    out, received = hora.alltoall(even, splits=[2] * n, name="conv.np.splits")
    assert received.tolist() == [2] * n
    t = hvd.alltoall(torch.arange(2.0 * n), name="conv.torch.even")
    assert isinstance(t, torch.Tensor)
    t, received = hvd.alltoall(torch.arange(2.0 * n), splits=[2] * n, name="conv.torch.splits")
    assert received.tolist() == [2] * n
    # the async forms give the pair either way, as Horovod's synchronize does
    out, received = hora.synchronize(hora.alltoall_async(even, name="conv.np.async"))
    assert received.tolist() == [2] * n


def check_optimizer_parameter_names_are_horovods_private_mapping(hvd: Any, r: int,
                                                                    n: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters()}]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    names = opt._parameter_names  # param -> name, without named_parameters
    assert set(names) == set(model.parameters()) and len(set(names.values())) == 4, names
    assert all(ps == set(names.values()) for ps in hvd.allgather_object(set(names.values())))
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())  # fmt: skip
    assert {named._parameter_names[p]: p for p in model.parameters()} == dict(
        model.named_parameters())


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
def test_horovod_script(battery: tuple[int, list[dict[str, str]]], check: str) -> None:
    np_, per_rank = battery
    for rank, results in enumerate(per_rank):
        assert results.get(check) == "ok", f"np={np_} rank {rank}:\n{results.get(check)}"
