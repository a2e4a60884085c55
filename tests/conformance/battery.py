"""The collective semantics, written once: every check runs on every rank of a real job.

Each ``check_*`` receives the ``hora`` module, this rank and the world size, computes the
expected result locally with NumPy from the known inputs of every rank, runs the collective and
asserts. ``run_battery`` runs them all in one job and reports per check, so one failure does
not hide the others. Imported inside worker processes only.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

DTYPES = [
    "uint8",
    "int8",
    "uint16",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "bool",
]
N = 37  # odd, not a multiple of any world size tested


def _np_dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _input(rank: int, dtype: str, n: int = N, op: str = "sum") -> np.ndarray:
    base = (np.arange(n) % 5) + rank + 1
    if dtype == "bool":
        return ((np.arange(n) + rank) % 2).astype(bool)
    if op == "product":
        base = (np.arange(n) + rank) % 2 + 1
    return base.astype(_np_dtype(dtype))


def _expect_reduce(size: int, dtype: str, op: str) -> np.ndarray:
    xs = [_input(r, dtype, op=op).astype(np.float64) for r in range(size)]
    if op in ("sum", "average"):
        out = np.sum(xs, axis=0)
    elif op == "min":
        out = np.min(xs, axis=0)
    elif op == "max":
        out = np.max(xs, axis=0)
    else:
        out = np.prod(xs, axis=0)
    if dtype == "bool":
        return (out != 0) if op in ("sum", "max") else np.all(xs, axis=0)
    if op == "average":
        out = out * (1.0 / size)
        if dtype not in ("float16", "bfloat16", "float32", "float64"):
            out = np.trunc(out)
    return out


def _close(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    got64 = np.asarray(got).astype(np.float64)
    tol = {"float16": 1e-2, "bfloat16": 3e-2}.get(dtype, 1e-6)
    assert got64.shape == want.shape, (got64.shape, want.shape)
    np.testing.assert_allclose(got64, np.asarray(want, dtype=np.float64), rtol=tol, atol=tol)


def check_allreduce_all_dtypes_ops(hvd: Any, rank: int, size: int) -> None:
    ops = {
        "sum": hvd.Sum,
        "average": hvd.Average,
        "min": hvd.Min,
        "max": hvd.Max,
        "product": hvd.Product,
    }
    for dtype in DTYPES:
        for opname, op in ops.items():
            if dtype == "bool" and opname == "average":
                continue
            x = _input(rank, dtype, op=opname)
            got = hvd.allreduce(x, op=op, name=f"ar.{dtype}.{opname}")
            assert got.dtype == x.dtype, (dtype, opname, got.dtype)
            _close(got, _expect_reduce(size, dtype, opname), dtype)


def check_allreduce_scaling_and_shapes(hvd: Any, rank: int, size: int) -> None:
    x = np.full((3, 4), rank + 1.0, dtype=np.float32)
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    _close(got, np.full((3, 4), sum(r + 1.0 for r in range(size))), "float32")
    assert got.shape == (3, 4)
    s = hvd.allreduce(np.float64(rank), op=hvd.Sum, name="scalar")
    assert float(s) == sum(range(size))
    big = np.arange(300_001, dtype=np.float64) * (rank + 1)
    _close(
        hvd.allreduce(big, op=hvd.Sum, name="big"),
        np.arange(300_001, dtype=np.float64) * sum(r + 1 for r in range(size)),
        "float64",
    )
    empty = hvd.allreduce(np.zeros(0, dtype=np.float32), name="empty")
    assert empty.shape == (0,)
    default = hvd.allreduce(np.full(4, float(rank)), name="default-average")
    _close(default, np.full(4, sum(range(size)) / size), "float64")


def check_inplace_async_grouped(hvd: Any, rank: int, size: int) -> None:
    x = np.full(10, rank + 1, dtype=np.int32)
    same = hvd.allreduce_(x, op=hvd.Sum, name="inplace")
    assert same is x or np.shares_memory(same, x)
    assert (x == sum(range(1, size + 1))).all()
    hs = [
        hvd.allreduce_async(np.full(5, float(i + rank)), op=hvd.Sum, name=f"async{i}")
        for i in range(6)
    ]
    for i, h in enumerate(reversed(hs)):
        i = 5 - i
        _close(hvd.synchronize(h), np.full(5, float(size * i + sum(range(size)))), "float64")
    assert hvd.poll(hs[0]) and hs[0].done()
    xs = [np.full(k + 1, float(rank * k), dtype=np.float32) for k in range(5)]
    got = hvd.grouped_allreduce(xs, op=hvd.Sum, name="grp")
    assert len(got) == 5
    for k, g in enumerate(got):
        _close(g, np.full(k + 1, float(k * sum(range(size)))), "float32")
    # one dtype per tensor: bfloat16 bits in uint16 storage beside float32
    import ml_dtypes

    bits = np.array([1.0, 2.0], dtype=ml_dtypes.bfloat16).view(np.uint16)
    ra, rb = hvd.grouped_allreduce(
        [bits, np.ones(3, np.float32)], op=hvd.Sum, dtype=["bfloat16", None], name="grp.mixed"
    )
    want = np.array([size, 2.0 * size], dtype=ml_dtypes.bfloat16).view(np.uint16)
    assert ra.tolist() == want.tolist() and rb.tolist() == [float(size)] * 3
    h = hvd.grouped_allreduce_async([np.ones(3), np.ones(2)], op=hvd.Sum)
    got = hvd.synchronize(h)
    assert [g.tolist() for g in got] == [[float(size)] * 3, [float(size)] * 2]


def check_allgather_uneven(hvd: Any, rank: int, size: int) -> None:
    for dtype in DTYPES:
        x = np.stack([_input(rank, dtype, 3)] * (rank + 1))  # rank + 1 rows of 3
        got = hvd.allgather(x, name=f"ag.{dtype}")
        want = np.concatenate([np.stack([_input(r, dtype, 3)] * (r + 1)) for r in range(size)])
        assert got.dtype == x.dtype
        _close(got, want.astype(np.float64), dtype)
    zero = np.zeros((0 if rank == 0 else 2, 2), dtype=np.float32)
    got = hvd.allgather(zero, name="ag.zero")
    assert got.shape == (2 * (size - 1), 2)
    xs = [np.full((rank + 1,), float(rank)), np.full((2,), float(rank))]
    g1, g2 = hvd.grouped_allgather(xs, name="ag.grouped")
    assert g1.tolist() == [float(r) for r in range(size) for _ in range(r + 1)]
    assert g2.tolist() == [float(r) for r in range(size) for _ in range(2)]


def check_broadcast(hvd: Any, rank: int, size: int) -> None:
    for root in range(size):
        for dtype in DTYPES:
            x = _input(rank, dtype, 11)
            got = hvd.broadcast(x, root, name=f"bc.{dtype}.{root}")
            _close(got, _input(root, dtype, 11).astype(np.float64), dtype)
    y = np.full(4, float(rank))
    hvd.broadcast_(y, size - 1, name="bc.inplace")
    assert (y == size - 1).all()


def check_alltoall(hvd: Any, rank: int, size: int) -> None:
    # rank r sends (r + d) % 3 rows to destination d; row values encode (source, dest)
    splits = np.array([(rank + d) % 3 for d in range(size)], dtype=np.int32)
    rows = [np.full((int(splits[d]), 2), rank * 100 + d, dtype=np.int64) for d in range(size)]
    x = np.concatenate(rows) if rows else np.zeros((0, 2), np.int64)
    out, recv = hvd.alltoall(x, splits=splits, name="a2a")
    want_splits = [(s + rank) % 3 for s in range(size)]
    assert recv.tolist() == want_splits, (recv, want_splits)
    want = np.concatenate([np.full((want_splits[s], 2), s * 100 + rank) for s in range(size)])
    assert (out == want).all()
    even = np.arange(size * 2, dtype=np.float32) + rank * 1000
    out = hvd.alltoall(even, name="a2a.even")  # no splits: the output alone, as in Horovod
    assert out.tolist() == [float(s * 1000 + rank * 2 + k) for s in range(size) for k in range(2)]


def check_reducescatter(hvd: Any, rank: int, size: int) -> None:
    for rows in (size * 2, size * 2 + 1, 1):
        x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + rank
        got = hvd.reducescatter(x, op=hvd.Sum, name=f"rs.{rows}")
        full = sum(np.arange(rows * 3, dtype=np.float64).reshape(rows, 3) + r for r in range(size))
        counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
        start = sum(counts[:rank])
        _close(got, full[start : start + counts[rank]], "float32")
    avg = hvd.reducescatter(np.full((size, 2), float(rank)), name="rs.avg")
    _close(avg, np.full((1, 2), sum(range(size)) / size), "float64")
    a, b = hvd.grouped_reducescatter([np.ones((size, 1)), np.ones((size * 2, 1))], op=hvd.Sum)
    assert a.tolist() == [[float(size)]] and b.tolist() == [[float(size)]] * 2


def check_adasum(hvd: Any, rank: int, size: int) -> None:
    if size & (size - 1):
        try:  # refused at once, as Horovod does, with an error Horovod scripts catch
            hvd.allreduce(np.ones(4), op=hvd.Adasum, name="adasum.bad")
        except NotImplementedError as e:
            assert isinstance(e, RuntimeError) and "power-of-two" in str(e)
            return
        raise AssertionError("Adasum on a non-power-of-two world did not fail")
    rng = np.random.default_rng(7)
    vecs = [rng.standard_normal(64) for _ in range(size)]

    def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        dot, na, nb = a @ b, a @ a, b @ b
        ca = 1 - dot / (2 * na) if na else 1.0
        cb = 1 - dot / (2 * nb) if nb else 1.0
        return ca * a + cb * b

    level = list(vecs)
    while len(level) > 1:
        level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    got = hvd.allreduce(vecs[rank].copy(), op=hvd.Adasum, name="adasum")
    np.testing.assert_allclose(got, level[0], rtol=1e-9, atol=1e-9)


def check_objects_and_barrier(hvd: Any, rank: int, size: int) -> None:
    obj = hvd.broadcast_object({"rank": rank, "x": [1, 2]} if rank == 0 else None, 0)
    assert obj == {"rank": 0, "x": [1, 2]}
    objs = hvd.allgather_object(("r", rank, "y" * rank))
    assert objs == [("r", r, "y" * r) for r in range(size)]
    for _ in range(3):
        hvd.barrier()


def check_join(hvd: Any, rank: int, size: int) -> None:
    # The last rank does one allreduce more than the others, which join early.
    steps = 2 if rank < size - 1 else 3
    for i in range(steps):
        got = hvd.allreduce(np.full(3, 1.0), op=hvd.Sum, name=f"join.step{i}")
        want = float(size) if i < 2 else 1.0  # joined ranks contribute zeros
        assert got.tolist() == [want] * 3, (i, got)
    last = hvd.join()
    assert last == size - 1, last


def check_mismatch_errors(hvd: Any, rank: int, size: int) -> None:
    if size == 1:
        return
    cases = [
        (
            lambda: hvd.allreduce(np.ones(3, np.float32 if rank else np.float64), name="mm.dtype"),
            "Mismatched data types",
        ),
        (
            lambda: hvd.allreduce(np.ones(3 + rank), name="mm.shape"),
            "Mismatched ALLREDUCE tensor shapes",
        ),
        (
            lambda: (
                hvd.allreduce(np.ones(2), name="mm.op")
                if rank
                else hvd.allgather(np.ones(2), name="mm.op")
            ),
            "Mismatched operations",
        ),
        (
            lambda: hvd.broadcast(np.ones(2), rank % 2, name="mm.root"),
            "Mismatched BROADCAST root ranks",
        ),
        (
            lambda: hvd.allreduce(np.ones(2), op=hvd.Sum if rank else hvd.Max, name="mm.redop"),
            "Mismatched reduction operation",
        ),
        (
            lambda: hvd.allreduce(np.ones(2), prescale_factor=1.0 + rank, name="mm.scale"),
            "Mismatched prescale and/or postscale factors",
        ),
        (
            lambda: hvd.allgather(np.ones((2, 2 + rank)), name="mm.agdim"),
            "Mismatched ALLGATHER tensor shapes",
        ),
    ]
    for fn, text in cases:
        try:
            fn()
        except hvd.HorovodInternalError as e:
            assert isinstance(e, RuntimeError) and text in str(e), str(e)
            assert "rank 0" in str(e) and "rank 1" in str(e), str(e)
        else:
            raise AssertionError(f"no error for {text}")
    # the job is still usable afterwards
    assert hvd.allreduce(np.ones(2), op=hvd.Sum, name="mm.after").tolist() == [size] * 2


def check_eager_errors(hvd: Any, rank: int, size: int) -> None:
    import time

    for first in range(min(size, 2) if size > 1 else 0):
        # The other ranks hold back, so the first submission is still pending when the
        # same name comes again.
        hvd.barrier()
        if rank != first:
            time.sleep(0.3)
        h = hvd.allreduce_async(np.ones(4), name=f"dup{first}")
        pair = [np.ones(2), np.ones(3)]
        hg = hvd.grouped_allreduce_async(pair, op=hvd.Sum, name=f"dupg{first}")
        if rank == first:
            for again, arg, again_name in (
                (hvd.allreduce_async, np.ones(4), f"dup{first}"),
                (hvd.grouped_allreduce_async, pair, f"dupg{first}"),
            ):
                try:
                    again(arg, op=hvd.Sum, name=again_name)
                except ValueError as e:
                    assert "same name" in str(e)
                else:
                    raise AssertionError("duplicate name was accepted")
        hvd.synchronize(h)
        hvd.synchronize(hg)
        # once the handle is done, every name of the group is free again
        out = hvd.grouped_allreduce(pair, op=hvd.Sum, name=f"dupg{first}")
        assert [o.tolist() for o in out] == [[size] * 2, [size] * 3]
    for bad, exc in [
        (lambda: hvd.allreduce(np.ones((4, 4))[:, 1]), ValueError),
        (lambda: hvd.allreduce(np.ones(2, dtype=np.complex64)), TypeError),
        (lambda: hvd.allreduce(np.ones(2, dtype=np.complex64)), ValueError),  # Horovod's type
        (lambda: hvd.reducescatter(np.ones(size), op=hvd.Adasum), NotImplementedError),
        (lambda: hvd.grouped_reducescatter([np.ones(size)], op=hvd.Adasum), RuntimeError),
        (lambda: hvd.allreduce(np.ones(2), op=17), ValueError),
        (lambda: hvd.allreduce(np.ones(2), op=hvd.Sum, average=True), ValueError),
        (lambda: hvd.broadcast(np.ones(2), size), ValueError),
        (lambda: hvd.alltoall(np.ones(size + 1), splits=[1] * size), ValueError),
        (lambda: hvd.reducescatter(np.float32(1.0)), ValueError),
    ]:
        try:
            bad()
        except exc:
            pass
        else:
            raise AssertionError(f"{bad} did not raise {exc.__name__}")


def check_topology(hvd: Any, rank: int, size: int) -> None:
    assert hvd.rank() == rank and hvd.size() == size
    assert hvd.is_initialized()
    assert 0 <= hvd.local_rank() < hvd.local_size()
    assert hvd.global_process_set.size() == size and hvd.global_process_set.rank() == rank


CHECKS: dict[str, Callable[[Any, int, int], None]] = {
    name[len("check_") :]: fn for name, fn in globals().items() if name.startswith("check_")
}


def run_battery(rank: int, names: list[str] | None = None) -> dict[str, str]:
    import hora as hvd

    hvd.init()
    size = hvd.size()
    out: dict[str, str] = {}
    for name, fn in CHECKS.items():
        if names is not None and name not in names:
            continue
        try:
            fn(hvd, rank, size)
            out[name] = "ok"
        except BaseException:
            out[name] = traceback.format_exc()
            if not hvd.is_initialized():
                break
    hvd.shutdown()
    return out
