"""PowerSGD and top-k on real ranks (np=2 and np=3): the NumPy compressors against a NumPy
reference of the whole world, torch training through DistributedOptimizer converging with every
rank holding the same model, and the compression state through an elastic commit/restore/sync
and broadcast_optimizer_state. All checks of a world size run in one spawn."""

from __future__ import annotations

from typing import Any

import pytest

from harness import run_checks, run_ranks


def check_numpy_reference(r: int, n: int) -> None:
    import numpy as np

    from compression_reference import powersgd_step, topk_step
    from hora.frameworks.powersgd import PowerSGD
    from hora.frameworks.topk import TopK

    def grads(rank: int, step: int) -> dict[str, Any]:
        rng = np.random.default_rng([rank, step])
        return {"w": rng.standard_normal((24, 18)).astype(np.float32),
                "b": rng.standard_normal(24).astype(np.float32)}  # fmt: skip

    psgd, topk = PowerSGD(rank=2, start_iter=1), TopK(ratio=0.05, min_elements=100)
    p_err = t_err = [np.zeros((24, 18), np.float32)] * n
    q = None
    for step in range(4):
        everyone = [grads(k, step) for k in range(n)]
        mine, mine_t = grads(r, step), grads(r, step)
        psgd.reduce(mine)
        topk.reduce(mine_t)
        exact_b = np.mean([g["b"] for g in everyone], axis=0)
        np.testing.assert_allclose(mine["b"], exact_b, rtol=1e-5, atol=1e-6)
        ws = [g["w"] for g in everyone]
        if step == 0:  # start_iter=1: exact
            np.testing.assert_allclose(mine["w"], np.mean(ws, axis=0), rtol=1e-5, atol=1e-6)
        else:
            want, p_err, q = powersgd_step(ws, p_err, q, 2, "w")
            np.testing.assert_allclose(mine["w"], want, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(psgd.local["w"]["error"], p_err[r], rtol=1e-4, atol=1e-5)
        want_t, t_err = topk_step(ws, t_err, round(0.05 * 24 * 18))
        np.testing.assert_allclose(mine_t["w"], want_t, rtol=1e-5, atol=1e-6)


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _train(hvd: Any, r: int, n: int, compression: Any, steps: int = 60, **kw: Any) -> Any:
    import torch
    import torch.nn.functional as F

    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=compression, **kw)  # fmt: skip
    g = torch.Generator().manual_seed(7)
    x = torch.randn(96, 20, generator=g)
    y = torch.tanh(x @ torch.randn(20, 4, generator=g))
    xs, ys = x.chunk(n)[r], y.chunk(n)[r]
    bpps = kw.get("backward_passes_per_step", 1)
    for _ in range(steps):
        opt.zero_grad()
        for mx, my in zip(xs.chunk(bpps), ys.chunk(bpps)):
            (F.mse_loss(model(mx), my) / bpps).backward()
        opt.step()
    with torch.no_grad():
        loss = F.mse_loss(model(x), y).item()
    return model, opt, loss


def check_torch_training_converges(r: int, n: int) -> None:
    import torch

    import hora.torch as hvd

    with torch.no_grad():
        start = torch.nn.functional.mse_loss(_model()(torch.zeros(1, 20)), torch.zeros(1, 4))
    _, _, exact = _train(hvd, r, n, hvd.Compression.none)
    runs = {
        "powersgd": _train(hvd, r, n, hvd.Compression.powersgd(rank=1, start_iter=5)),
        "topk": _train(hvd, r, n, hvd.Compression.topk(ratio=0.1, min_elements=64),
                       backward_passes_per_step=2, groups=2),
    }  # fmt: skip
    for name, (model, opt, loss) in runs.items():
        assert opt._compressor.step == 60, name
        assert loss < 1.5 * exact + 0.02, f"{name}: loss {loss} against {exact} uncompressed"
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = hvd.allgather_object(flat, name=f"test.{name}.params")
        for other in everyone:  # every rank steps with the same averaged gradients
            torch.testing.assert_close(other, everyone[0], rtol=0, atol=0)
    assert start.item() >= 0


def check_state_through_elastic_and_broadcast(r: int, n: int) -> None:
    import numpy as np
    import torch

    import hora.torch as hvd
    from compression_reference import assert_powersgd_state_restored

    model, opt, _ = _train(hvd, r, n, hvd.Compression.powersgd(rank=1, start_iter=2), steps=5)
    comp = opt._compressor
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0)
    state.commit()
    committed = comp.state_dict()
    assert committed["step"] == 5 and committed["local"]
    for _ in range(2):  # steps after the commit, then a failure: back to the commit
        opt.zero_grad()
        model(torch.randn(4, 20)).sum().backward()
        opt.step()
    assert comp.step == 7
    state.restore()
    now = comp.state_dict()
    assert now["step"] == 5
    assert_powersgd_state_restored(now, committed)
    # a sync (a new round) gives everyone rank 0's shared state and keeps each rank's memory
    state.sync()
    assert comp.step == 5
    np.testing.assert_array_equal(now["local"]["0.weight"]["error"],
                                  comp.local["0.weight"]["error"])  # fmt: skip
    # a new optimizer (a newcomer's, on every rank but the root) takes the root's factors and
    # step by broadcast
    fresh_model = _model()
    fresh = hvd.DistributedOptimizer(torch.optim.SGD(fresh_model.parameters(), lr=0.1),
                                     named_parameters=fresh_model.named_parameters(),
                                     compression=hvd.Compression.powersgd(rank=1))  # fmt: skip
    newcomer = opt if r == 0 else fresh
    hvd.broadcast_optimizer_state(newcomer, root_rank=0)
    got = newcomer._compressor
    qs = hvd.allgather_object(got.shared["0.weight"]["q"], name="test.q")
    assert got.step == 5 and (r == 0 or got.local == {})
    for q in qs:
        np.testing.assert_array_equal(q, qs[0])
    errors = hvd.allgather_object(comp.local["0.weight"]["error"], name="test.errors")
    assert not np.array_equal(errors[0], errors[1])  # each rank's own memory, not the root's


CHECKS = {f.__name__: f for f in (check_numpy_reference, check_torch_training_converges,
                                  check_state_through_elastic_and_broadcast)}  # fmt: skip


def run_all(rank: int) -> dict[str, str]:
    import hora.torch as hvd

    hvd.init()
    try:
        return run_checks(CHECKS, hvd.rank(), hvd.size())
    finally:
        hvd.shutdown()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"np{n}")
def battery(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, str]]]:
    return request.param, run_ranks(run_all, request.param, timeout=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_compression(battery: tuple[int, list[dict[str, str]]], check: str) -> None:
    np_, per_rank = battery
    for rank, results in enumerate(per_rank):
        assert results.get(check) == "ok", f"np={np_} rank {rank}:\n{results.get(check)}"
