"""Every hora.torch collective, forward and backward, against values computed locally.

One job per world size runs every ``check_*`` on every rank (real processes over the native TCP
backend); each check knows every rank's inputs, computes the expected output and gradient with
plain torch, runs the op and compares. Failures are reported per check.
"""

from __future__ import annotations

import traceback
import warnings
from typing import Any

import pytest
import torch

from harness import run_ranks

SIZES = [2, 3]


def x_of(rank: int, rows: int = 4, cols: int = 3, dtype: torch.dtype = torch.float32):
    return (torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols) + 10 * rank).to(
        dtype
    )


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


def check_allreduce_ops_and_grads(hvd: Any, r: int, n: int) -> None:
    xs = [x_of(k) for k in range(n)]
    stacked = torch.stack(xs)
    wants = {
        hvd.Sum: stacked.sum(0),
        hvd.Average: stacked.mean(0),
        hvd.Min: stacked.min(0).values,
        hvd.Max: stacked.max(0).values,
        hvd.Product: stacked.prod(0),
    }
    for op, want in wants.items():
        close(hvd.allreduce(xs[r], op=op, name=f"ar.{op}"), want, 1e-4)
    # Backward: the upstream gradient on rank k is (k + 1); it is reduced with the same op.
    x = xs[r].clone().requires_grad_()
    (hvd.allreduce(x, op=hvd.Sum, name="ar.grad.sum") * (r + 1)).sum().backward()
    close(x.grad, torch.full_like(x, sum(k + 1 for k in range(n))))
    x.grad = None
    (hvd.allreduce(x, name="ar.grad.avg") * (r + 1)).sum().backward()
    close(x.grad, torch.full_like(x, sum(k + 1 for k in range(n)) / n))
    scaled = hvd.allreduce(xs[r], op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    close(scaled, stacked.sum(0) * 1.5)
    ints = hvd.allreduce(torch.arange(5, dtype=torch.int32) * (r + 1), op=hvd.Sum)
    assert ints.dtype == torch.int32
    close(ints, torch.arange(5) * sum(k + 1 for k in range(n)))


def check_allreduce_async_inplace_and_handles(hvd: Any, r: int, n: int) -> None:
    t = x_of(r)
    h = hvd.allreduce_async_(t, op=hvd.Sum, name="inplace")
    out = hvd.synchronize(int(h))  # Horovod's int handles work too
    assert out is t
    close(t, sum(x_of(k) for k in range(n)))
    h = hvd.allreduce_async(x_of(r), name="async")
    while not hvd.poll(h):
        pass
    hid = int(h)
    close(hvd.synchronize(hid), sum(x_of(k) for k in range(n)) / n)
    assert hvd.synchronize(hid) is None  # already synchronized: an unknown handle
    t = x_of(r)
    assert hvd.allreduce_(t, op=hvd.Max) is t
    close(t, x_of(n - 1))


def check_average_argument_rule(hvd: Any, r: int, n: int) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summed = hvd.allreduce(x_of(r), average=False, name="avg.false")
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    close(summed, sum(x_of(k) for k in range(n)))
    with pytest.raises(ValueError, match="supersedes"):
        hvd.allreduce(x_of(r), average=True, op=hvd.Sum)


def check_grouped_allreduce(hvd: Any, r: int, n: int) -> None:
    a, b = x_of(r), x_of(r, 2, 5, torch.float64)
    outs = hvd.grouped_allreduce([a, b], op=hvd.Sum, name="grp")
    close(outs[0], sum(x_of(k) for k in range(n)))
    close(outs[1], sum(x_of(k, 2, 5) for k in range(n)))
    assert outs[1].dtype == torch.float64
    a.requires_grad_()
    b.requires_grad_()
    ga, gb = hvd.grouped_allreduce([a, b], name="grp.grad")
    (ga.sum() * (r + 1) + gb.sum()).backward()
    close(a.grad, torch.full_like(a, sum(k + 1 for k in range(n)) / n))
    close(b.grad, torch.ones_like(b))
    c, d = x_of(r), x_of(r, 3, 2)
    assert hvd.grouped_allreduce_([c, d], op=hvd.Sum) == [c, d]
    close(d, sum(x_of(k, 3, 2) for k in range(n)))
    h = hvd.grouped_allreduce_async([x_of(r)], name="grp.async")
    close(hvd.synchronize(h)[0], sum(x_of(k) for k in range(n)) / n)


def check_compression_and_bfloat16(hvd: Any, r: int, n: int) -> None:
    want = sum(x_of(k) for k in range(n)) / n
    out = hvd.allreduce(x_of(r), compression=hvd.Compression.fp16, name="fp16")
    assert out.dtype == torch.float32
    close(out, want, 1e-2)
    out = hvd.allreduce(x_of(r), compression=hvd.Compression.bf16, name="bf16c")
    close(out, want, 0.5)
    bf = hvd.allreduce(x_of(r, dtype=torch.bfloat16), op=hvd.Sum, name="bf16")
    assert bf.dtype == torch.bfloat16
    close(bf, sum(x_of(k) for k in range(n)), 0.5)
    gathered = hvd.allgather(x_of(r, 1, 3, torch.bfloat16), name="bf16.gather")
    close(gathered, torch.cat([x_of(k, 1, 3) for k in range(n)]), 0.5)
    mixed = hvd.grouped_allreduce([x_of(r, dtype=torch.bfloat16), x_of(r)], op=hvd.Sum)
    close(mixed[0], sum(x_of(k) for k in range(n)), 0.5)
    assert mixed[0].dtype == torch.bfloat16 and mixed[1].dtype == torch.float32


def check_allgather_and_grad(hvd: Any, r: int, n: int) -> None:
    parts = [x_of(k, k + 1, 2) for k in range(n)]  # dim 0 differs per rank
    x = parts[r].clone().requires_grad_()
    out = hvd.allgather(x, name="ag")
    close(out, torch.cat(parts))
    weight = torch.arange(out.numel(), dtype=torch.float32).reshape(out.shape) * (r + 1)
    (out * weight).sum().backward()
    offset = sum(k + 1 for k in range(r))
    mean_scale = sum(k + 1 for k in range(n)) / n  # Average-allreduce of the upstream grads
    base = torch.arange(out.numel(), dtype=torch.float32).reshape(out.shape)
    close(x.grad, base[offset : offset + r + 1] * mean_scale)
    h = hvd.allgather_async(torch.tensor([r]), name="ag.async")
    assert hvd.synchronize(h).tolist() == list(range(n))


def check_grouped_allgather(hvd: Any, r: int, n: int) -> None:
    a = x_of(r, 1, 2).requires_grad_()
    b = x_of(r, r + 1, 3).requires_grad_()
    ga, gb = hvd.grouped_allgather([a, b], name="gag")
    close(ga, torch.cat([x_of(k, 1, 2) for k in range(n)]))
    close(gb, torch.cat([x_of(k, k + 1, 3) for k in range(n)]))
    (ga.sum() + 2 * gb.sum()).backward()
    close(a.grad, torch.ones_like(a))
    close(b.grad, torch.full_like(b, 2.0))


def check_broadcast_and_grad(hvd: Any, r: int, n: int) -> None:
    root = n - 1
    x = x_of(r).requires_grad_()
    out = hvd.broadcast(x, root, name="bc")
    close(out, x_of(root))
    (out * (r + 1)).sum().backward()
    want = sum(k + 1 for k in range(n)) / n if r == root else 0.0
    close(x.grad, torch.full_like(x, want))
    t = x_of(r)
    assert hvd.broadcast_(t, 0, name="bc_") is t
    close(t, x_of(0))
    t = x_of(r, dtype=torch.int64)
    hvd.synchronize(hvd.broadcast_async_(t, root, name="bc.async_"))
    close(t, x_of(root))
    with pytest.raises(ValueError, match="root rank"):
        hvd.broadcast(x_of(r), n + 5)


def check_alltoall_and_grad(hvd: Any, r: int, n: int) -> None:
    # Rank k sends (j + 1) rows to rank j; row values encode (sender, row).
    splits = [j + 1 for j in range(n)]
    rows = sum(splits)
    x = (torch.arange(rows, dtype=torch.float32) + 100 * r).reshape(rows, 1).repeat(1, 2)
    x.requires_grad_()
    out, received = hvd.alltoall(x, splits=torch.tensor(splits, dtype=torch.int32), name="a2a")
    assert received.dtype == torch.int32 and received.tolist() == [r + 1] * n
    start = sum(splits[:r])
    want = torch.cat(
        [(torch.arange(start, start + r + 1, dtype=torch.float32) + 100 * k) for k in range(n)]
    )
    close(out[:, 0], want)
    (out * (r + 1)).sum().backward()  # rows I sent to rank j come back scaled by (j + 1)
    scale = torch.cat([torch.full((j + 1,), float(j + 1)) for j in range(n)])
    close(x.grad, scale.reshape(rows, 1).repeat(1, 2))
    even = hvd.alltoall(torch.arange(2 * n, dtype=torch.float32) + 10 * r, name="a2a.even")
    want = torch.cat(
        [torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + 10 * k for k in range(n)]
    )
    close(even, want)
    out, received = hvd.synchronize(hvd.alltoall_async(torch.ones(n, 2), name="a2a.async"))
    assert out.shape == (n, 2) and received.tolist() == [1] * n


def check_reducescatter_and_grad(hvd: Any, r: int, n: int) -> None:
    rows = 2 * n + 1  # uneven: the first rank gets one row more
    xs = [x_of(k, rows, 2) for k in range(n)]
    counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    start = sum(counts[:r])
    for op, want in ((hvd.Sum, sum(xs)), (hvd.Average, sum(xs) / n)):
        x = xs[r].clone().requires_grad_()
        out = hvd.reducescatter(x, op=op, name=f"rs.{op}")
        close(out, want[start : start + counts[r]])
        (out * (r + 1)).sum().backward()
        up = torch.cat([torch.full((counts[k], 2), float(k + 1)) for k in range(n)])
        close(x.grad, up * (n if op == hvd.Sum else 1))
    h = hvd.reducescatter_async(xs[r], name="rs.async", op=hvd.Sum)
    close(hvd.synchronize(h), sum(xs)[start : start + counts[r]])
    a, b = hvd.grouped_reducescatter([xs[r], xs[r] * 2], op=hvd.Sum, name="grs")
    close(b, 2 * sum(xs)[start : start + counts[r]])
    with pytest.raises(ValueError):
        hvd.reducescatter(torch.tensor(1.0))


def check_sparse_allreduce(hvd: Any, r: int, n: int) -> None:
    def sparse_of(k: int) -> torch.Tensor:
        return torch.sparse_coo_tensor([[k, k + 1], [0, 2]], [1.0 + k, 2.0], (n + 2, 3))

    for op, div in ((hvd.Sum, 1), (hvd.Average, n)):
        got = hvd.sparse_allreduce_async(sparse_of(r), f"sp.{op}", op)()
        want = sum(sparse_of(k).to_dense() for k in range(n)) / div
        close(got.to_dense(), want)


def check_control_and_errors(hvd: Any, r: int, n: int) -> None:
    hvd.barrier()
    last = hvd.join()
    assert 0 <= last < n
    with pytest.raises(TypeError, match="not supported"):
        hvd.allreduce(torch.ones(2, dtype=torch.complex64))
    # A non-contiguous tensor is staged through a contiguous copy, in place too.
    t = x_of(r, 3, 4).t()
    close(hvd.allreduce(t, op=hvd.Sum, name="noncontig"), sum(x_of(k, 3, 4) for k in range(n)).t())
    hvd.allreduce_(t, op=hvd.Sum, name="noncontig_")
    close(t, sum(x_of(k, 3, 4) for k in range(n)).t())
    # Duplicate pending names: rank 0's first "dup" cannot finish before the other ranks
    # submit theirs, which they do only after the "gate" allreduce that rank 0 joins later.
    if r == 0:
        h = hvd.allreduce_async(torch.ones(1), name="dup")
        with pytest.raises(ValueError, match="same name"):
            hvd.allreduce_async(torch.ones(1), name="dup")
        hvd.allreduce(torch.ones(1), name="gate")
    else:
        hvd.allreduce(torch.ones(1), name="gate")
        h = hvd.allreduce_async(torch.ones(1), name="dup")
    hvd.synchronize(h)
    # Mismatched shapes fail on every rank with HorovodInternalError.
    with pytest.raises(hvd.HorovodInternalError):
        hvd.allreduce(torch.ones(r + 1), name="mismatch")


def check_process_set(hvd: Any, r: int, n: int) -> None:
    ps = hvd.add_process_set([0, n - 1] if n > 2 else [1])
    if r in ps.ranks:
        out = hvd.allreduce(x_of(r), op=hvd.Sum, name="ps", process_set=ps)
        close(out, sum(x_of(k) for k in ps.ranks))
        g = hvd.allgather(torch.tensor([r]), process_set=ps)
        assert g.tolist() == ps.ranks
    hvd.barrier()


CHECKS = {name: fn for name, fn in dict(globals()).items() if name.startswith("check_")}


def run_all(rank: int) -> dict[str, str]:
    import hora.torch as hvd

    torch.set_num_threads(1)
    size = int(__import__("os").environ["HORA_SIZE"])
    hvd.init(process_sets="dynamic")
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn(hvd, rank, size)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    hvd.shutdown()
    return results


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"np{n}")
def battery(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, str]]]:
    return request.param, run_ranks(run_all, request.param, timeout=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_torch_op(battery: tuple[int, list[dict[str, str]]], check: str) -> None:
    np_, per_rank = battery
    for rank, results in enumerate(per_rank):
        assert results.get(check) == "ok", f"np={np_} rank {rank}:\n{results.get(check)}"
