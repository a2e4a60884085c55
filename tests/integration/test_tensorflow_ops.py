"""Every hora.tensorflow collective, forward and gradient, eager and inside tf.function.

One job per world size runs every ``check_*`` on every rank (real processes); each check knows
every rank's inputs, computes the expected output and gradient locally with NumPy, runs the op
and compares. TensorFlow is imported once per rank per job (its import is slow).
"""

from __future__ import annotations

import importlib.util
import traceback
from typing import Any

import numpy as np
import pytest

from harness import run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None,
    reason="tensorflow is not installed (pip install 'hora[tensorflow]')",
)

SIZES = [1, 2, 3]


def x_of(rank: int, rows: int = 4, cols: int = 3) -> np.ndarray:
    return (np.arange(rows * cols, dtype=np.float64).reshape(rows, cols) + 10 * rank).astype(
        np.float32
    )


def close(got: Any, want: Any, tol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               atol=tol, rtol=tol)  # fmt: skip


def both_modes(tf: Any, fn: Any) -> list[Any]:
    """``fn()`` run eagerly and inside a tf.function, as NumPy values."""
    eager = tf.nest.map_structure(np.asarray, fn())
    graph = tf.nest.map_structure(np.asarray, tf.function(fn)())
    return [eager, graph]


def check_allreduce_ops_and_grads(tf: Any, hvd: Any, r: int, n: int) -> None:
    xs = [x_of(k) for k in range(n)]
    st = np.stack(xs)
    wants = {hvd.Sum: st.sum(0), hvd.Average: st.mean(0), hvd.Min: st.min(0),
             hvd.Max: st.max(0), hvd.Product: st.prod(0)}  # fmt: skip
    for op, want in wants.items():
        for got in both_modes(tf, lambda op=op: hvd.allreduce(tf.constant(xs[r]), op=op)):
            close(got, want, 1e-3)
    v = tf.Variable(xs[r])
    for got in both_modes(tf, lambda: hvd.allreduce(v, op=hvd.Sum, prescale_factor=0.5,
                                                    postscale_factor=3.0)):  # fmt: skip
        close(got, st.sum(0) * 1.5)
    for got in both_modes(tf, lambda: hvd.allreduce(tf.constant(xs[r]),
                                                    compression=hvd.Compression.fp16)):
        assert got.dtype == np.float32
        close(got, st.mean(0), 1e-2)
    ints = hvd.allreduce(tf.range(5, dtype=tf.int32) * (r + 1), op=hvd.Sum)
    assert ints.dtype == tf.int32
    close(ints, np.arange(5) * sum(k + 1 for k in range(n)))

    # Gradient: the upstream gradient on rank k is (k + 1); it is reduced with the same op.
    def grads() -> list[Any]:
        x = tf.constant(xs[r])
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            s = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum) * (r + 1))
            a = tf.reduce_sum(hvd.allreduce(x) * (r + 1))
        return [tape.gradient(s, x), tape.gradient(a, x)]

    total = sum(k + 1 for k in range(n))
    for g_sum, g_avg in both_modes(tf, grads):
        close(g_sum, np.full_like(xs[r], total))
        close(g_avg, np.full_like(xs[r], total / n))


def check_average_argument_rule(tf: Any, hvd: Any, r: int, n: int) -> None:
    with pytest.warns(DeprecationWarning):
        got = hvd.allreduce(tf.constant(x_of(r)), average=False)
    close(got, sum(x_of(k) for k in range(n)))
    with pytest.raises(ValueError, match="supersedes"):
        hvd.allreduce(tf.constant(x_of(r)), average=True, op=hvd.Sum)


def check_grouped_allreduce(tf: Any, hvd: Any, r: int, n: int) -> None:
    def fn() -> Any:
        a, b = tf.constant(x_of(r)), tf.constant(x_of(r, 2, 5))
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            outs = hvd.grouped_allreduce([a, b], op=hvd.Sum)
            loss = tf.reduce_sum(outs[0]) + 2 * tf.reduce_sum(outs[1])
        return outs, tape.gradient(loss, [a, b])

    for (oa, ob), (ga, gb) in both_modes(tf, fn):
        close(oa, sum(x_of(k) for k in range(n)))
        close(ob, sum(x_of(k, 2, 5) for k in range(n)))
        close(ga, np.full((4, 3), n))
        close(gb, np.full((2, 5), 2 * n))


def check_allgather_uneven_and_grad(tf: Any, hvd: Any, r: int, n: int) -> None:
    parts = [np.full((k + 1, 2), k, np.float32) for k in range(n)]
    want = np.concatenate(parts)

    def fn() -> Any:
        x = tf.constant(parts[r])
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = hvd.allgather(x)
            # rank k weights row i of the gathered tensor by (i + 1) * (k + 1)
            w = tf.reshape(tf.range(1, tf.shape(y)[0] + 1, dtype=tf.float32), [-1, 1])
            loss = tf.reduce_sum(y * w * (r + 1))
        return y, tape.gradient(loss, x)

    offset = sum(k + 1 for k in range(r))
    avg = sum(k + 1 for k in range(n)) / n
    rows = np.arange(offset + 1, offset + r + 2, dtype=np.float64).reshape(-1, 1)
    for y, g in both_modes(tf, fn):
        close(y, want)
        close(g, np.broadcast_to(rows * avg, (r + 1, 2)))
    a, b = hvd.grouped_allgather([tf.constant(parts[r]), tf.constant([r], tf.int64)])
    close(a, want)
    assert np.asarray(b).tolist() == list(range(n))


def check_broadcast_and_grad(tf: Any, hvd: Any, r: int, n: int) -> None:
    root = n - 1

    def fn() -> Any:
        x = tf.constant(x_of(r))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = hvd.broadcast(x, root)
            loss = tf.reduce_sum(y) * (r + 1)
        return y, tape.gradient(loss, x)

    for y, g in both_modes(tf, fn):
        close(y, x_of(root))
        want = sum(k + 1 for k in range(n)) / n if r == root else 0.0
        close(g, np.full((4, 3), want))
    v = tf.Variable(x_of(r))
    assert hvd.broadcast_(v, root) is v
    close(v.numpy(), x_of(root))
    with pytest.raises(ValueError, match="root rank"):
        hvd.broadcast(tf.constant(1.0), n + 5)


def check_alltoall_splits_and_grad(tf: Any, hvd: Any, r: int, n: int) -> None:
    # rank k sends (k + j + 1) rows to rank j, each row valued 100k + j
    def send(k: int) -> np.ndarray:
        return np.concatenate([np.full((k + j + 1, 2), 100 * k + j, np.float32)
                               for j in range(n)])  # fmt: skip

    splits = [r + j + 1 for j in range(n)]

    def fn() -> Any:
        x = tf.constant(send(r))
        with tf.GradientTape() as tape:
            tape.watch(x)
            out, received = hvd.alltoall(x, splits=splits)
            loss = tf.reduce_sum(out * out)
        return out, received, tape.gradient(loss, x)

    want = np.concatenate([np.full((k + r + 1, 2), 100 * k + r, np.float32) for k in range(n)])
    for out, received, g in both_modes(tf, fn):
        close(out, want)
        assert received.tolist() == [k + r + 1 for k in range(n)]
        close(g, 2 * send(r))  # every row comes back to where it came from
    even = hvd.alltoall(tf.constant(np.arange(2 * n, dtype=np.int32) + 10 * r))
    assert np.asarray(even).tolist() == [v for k in range(n) for v in (10 * k + 2 * r,
                                                                        10 * k + 2 * r + 1)]


def check_reducescatter_and_grad(tf: Any, hvd: Any, r: int, n: int) -> None:
    rows = 2 * n + 1
    xs = [x_of(k, rows, 2) for k in range(n)]
    total = sum(xs)
    sizes = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    start = sum(sizes[:r])

    def fn() -> Any:
        x = tf.constant(xs[r])
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = hvd.reducescatter(x, op=hvd.Sum)
            loss = tf.reduce_sum(y)
        return y, tape.gradient(loss, x)

    for y, g in both_modes(tf, fn):
        close(y, total[start : start + sizes[r]])
        close(g, np.full((rows, 2), n))  # Horovod's rule: allgather, times size for Sum

    def scaled() -> Any:
        x = tf.constant(xs[r])
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(hvd.reducescatter(x, op=hvd.Average, prescale_factor=0.5,
                                                   postscale_factor=3.0))  # fmt: skip
        return tape.gradient(loss, x)

    for g in both_modes(tf, scaled):
        close(g, np.full((rows, 2), 1.5))  # and times the scale factors
    avg = hvd.reducescatter(tf.constant(xs[r]))
    close(avg, (total / n)[start : start + sizes[r]])
    a, b = hvd.grouped_reducescatter([tf.constant(xs[r]), tf.constant(xs[r] * 2)], op=hvd.Sum)
    close(a, total[start : start + sizes[r]])
    close(b, 2 * total[start : start + sizes[r]])


def check_sparse_indexed_slices(tf: Any, hvd: Any, r: int, n: int) -> None:
    emb = tf.Variable(np.ones((6, 2), np.float32))

    def grad_of() -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, [r, r + 1]))
        return tape.gradient(loss, emb)

    g = grad_of()
    assert isinstance(g, tf.IndexedSlices)
    reduced = hvd.allreduce(g, op=hvd.Sum)
    assert isinstance(reduced, tf.IndexedSlices)
    assert sorted(np.asarray(reduced.indices).tolist()) == sorted(
        i for k in range(n) for i in (k, k + 1))
    want = np.zeros((6, 2))
    for k in range(n):
        want[[k, k + 1]] += 1.0 / n
    for sparse_as_dense in (False, True):
        def tape_grad(sad: bool = sparse_as_dense) -> Any:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.gather(emb, [r, r + 1]))
            tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sad)
            return tf.convert_to_tensor(tape.gradient(loss, emb))

        for got in both_modes(tf, tape_grad):
            close(got, want)

    def predivided() -> Any:  # gathering needs no predivision: the factors cancel out
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, [r, r + 1]))
        tape = hvd.DistributedGradientTape(tape, gradient_predivide_factor=2.0)
        return tf.convert_to_tensor(tape.gradient(loss, emb))

    for got in both_modes(tf, predivided):
        close(got, want)
    # Horovod's rules: an Average divides the gathered values (integers become floats) ...
    ints = tf.IndexedSlices(tf.fill([1, 2], tf.constant(2 * n, tf.uint8)), tf.constant([r]))
    avg = hvd.allreduce(ints, op=hvd.Average)
    assert avg.values.dtype.is_floating, avg.values.dtype
    close(avg.values, np.full((n, 2), 2.0))
    # ... and other ops and scale factors are refused, on every rank alike
    for kw in ({"op": hvd.Min}, {"op": hvd.Max}, {"op": hvd.Product}, {"op": hvd.Adasum},
               {"op": hvd.Sum, "prescale_factor": 0.5}, {"postscale_factor": 2.0}):
        with pytest.raises(NotImplementedError):
            hvd.allreduce(g, **kw)
        with pytest.raises(NotImplementedError):
            hvd.grouped_allreduce([tf.ones([2]), g], **kw)


def check_barrier_join_objects_and_topology(tf: Any, hvd: Any, r: int, n: int) -> None:
    hvd.barrier()
    tf.function(lambda: hvd.barrier())()
    assert 0 <= int(hvd.join()) < n
    assert hvd.allgather_object({"rank": r}) == [{"rank": k} for k in range(n)]
    root = n - 1
    assert hvd.broadcast_object({"v": r} if r == root else None, root_rank=root) == {"v": root}
    assert int(hvd.rank_op()) == r and int(hvd.size_op()) == n
    assert int(tf.function(hvd.rank_op)()) == r
    assert int(hvd.local_size_op()) == hvd.local_size()
    assert int(hvd.process_set_included_op()) == 1


def check_process_set(tf: Any, hvd: Any, r: int, n: int) -> None:
    if n == 1:
        return  # a one-rank job has no proper subset
    ps = hvd.add_process_set([0, n - 1] if n > 2 else [1])
    if r in ps.ranks:
        for got in both_modes(tf, lambda: hvd.allreduce(tf.constant(x_of(r)), op=hvd.Sum,
                                                        process_set=ps)):  # fmt: skip
            close(got, sum(x_of(k) for k in ps.ranks))
        g = hvd.allgather(tf.constant([r]), process_set=ps)
        assert np.asarray(g).tolist() == ps.ranks
        k = ps.size()

        def scattered() -> Any:  # the gradient is gathered over the set, times its size
            x = tf.ones([2 * k, 2])
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(hvd.reducescatter(x, op=hvd.Sum, process_set=ps))
            return tape.gradient(loss, x)

        for got in both_modes(tf, scattered):
            close(got, np.full((2 * k, 2), k))

    def tape_grad() -> Any:  # members average, a rank outside keeps its own gradient
        x = tf.constant(float(r))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = x * x
        return hvd.DistributedGradientTape(tape, process_set=ps).gradient(y, [x])[0]

    for got in both_modes(tf, tape_grad):
        want = 2.0 * sum(ps.ranks) / len(ps.ranks) if r in ps.ranks else 2.0 * r
        close(got, want)
    hvd.barrier()


def check_errors_on_every_rank(tf: Any, hvd: Any, r: int, n: int) -> None:
    with pytest.raises(TypeError, match="not supported"):
        hvd.allreduce(tf.constant(["a"]))
    if n == 1:
        return  # one rank cannot disagree with itself
    with pytest.raises(hvd.HorovodInternalError):
        hvd.allreduce(tf.ones([r + 1]), name="mismatch")
    with pytest.raises(tf.errors.OpError, match="(?i)shape|mismatch"):
        tf.function(lambda: hvd.allreduce(tf.ones([r + 1]), name="mismatch.graph"))()
    with pytest.raises(TypeError, match="not supported"):
        hvd.allreduce(tf.constant(["a"]))
    hvd.barrier()


def check_variables_and_tape_step(tf: Any, hvd: Any, r: int, n: int) -> None:
    """DistributedGradientTape: n ranks on 1/n of a batch each equal one rank on the batch."""
    rng = np.random.default_rng(0)
    data_x = rng.normal(size=(6 * n, 4)).astype(np.float32)
    data_y = rng.normal(size=(6 * n, 1)).astype(np.float32)
    w0 = rng.normal(size=(4, 1)).astype(np.float32)

    def train(x: np.ndarray, y: np.ndarray, distributed: bool, compiled: bool) -> np.ndarray:
        w = tf.Variable(w0 + (r if distributed else 0))  # ranks start apart
        b = tf.Variable(np.zeros((1,), np.float32))
        if distributed:
            hvd.broadcast_variables([w, b], root_rank=0)

        def step(xb: Any, yb: Any) -> None:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((tf.matmul(xb, w) + b - yb) ** 2)
            if distributed:
                tape = hvd.DistributedGradientTape(tape)
            gw, gb = tape.gradient(loss, [w, b])
            w.assign_sub(0.1 * gw)
            b.assign_sub(0.1 * gb)

        run = tf.function(step) if compiled else step
        for _ in range(3):
            run(tf.constant(x), tf.constant(y))
        return np.concatenate([w.numpy().ravel(), b.numpy()])

    ref = train(data_x, data_y, False, False)
    mine = slice(6 * r, 6 * (r + 1))
    for compiled in (False, True):
        got = train(data_x[mine], data_y[mine], True, compiled)
        close(got, ref, 1e-5)
        everyone = hvd.allgather_object(got.tolist())
        assert all(e == everyone[0] for e in everyone), everyone


def check_tape_options(tf: Any, hvd: Any, r: int, n: int) -> None:
    """Groups, num_groups, gradient_predivide_factor, fp16 and Sum give the expected gradients;
    a bad combination raises at once."""
    a = tf.Variable(np.ones((2, 2), np.float32))
    b = tf.Variable(np.ones((3,), np.float32))
    c = tf.Variable(np.ones((), np.float32))
    mean = sum(k + 1 for k in range(n)) / n
    options: list[dict[str, Any]] = [
        {"num_groups": 2}, {"groups": [[a, c]]}, {"groups": 3},
        {"gradient_predivide_factor": 2.0}, {"compression": hvd.Compression.fp16},
        {"op": hvd.Sum},
    ]  # fmt: skip
    for kw in options:
        def grads(kw: dict[str, Any] = kw) -> Any:
            with tf.GradientTape() as tape:
                loss = (r + 1) * (tf.reduce_sum(a) + 2 * tf.reduce_sum(b) + 3 * c)
            return hvd.DistributedGradientTape(tape, **kw).gradient(loss, [a, b, c])

        want = mean * (n if kw.get("op") == hvd.Sum else 1)
        for ga, gb, gc in both_modes(tf, grads):
            close(ga, np.full((2, 2), want), 1e-3)
            close(gb, np.full((3,), 2 * want), 1e-3)
            close(gc, 3 * want, 1e-3)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        with tf.GradientTape() as tape:
            pass
        hvd.DistributedGradientTape(tape, op=hvd.Sum, gradient_predivide_factor=2.0)


def check_adasum(tf: Any, hvd: Any, r: int, n: int) -> None:
    if n & (n - 1):
        with pytest.raises((ValueError, hvd.HorovodInternalError), match="power"):
            hvd.allreduce(tf.ones([4]), op=hvd.Adasum)
        return
    same = hvd.allreduce(tf.constant([1.0, 2.0, 3.0, 4.0]), op=hvd.Adasum)
    close(same, [1.0, 2.0, 3.0, 4.0])  # equal vectors: Adasum gives the vector itself
    basis = np.eye(n, 4, dtype=np.float32)[r]
    close(hvd.allreduce(tf.constant(basis), op=hvd.Adasum), np.eye(n, 4).sum(0))  # orthogonal
    with pytest.raises(TypeError, match="floating"):
        hvd.allreduce(tf.constant([1, 2]), op=hvd.Adasum)


CHECKS = {name: fn for name, fn in dict(globals()).items() if name.startswith("check_")}


def run_all(rank: int) -> dict[str, str]:
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    import hora.tensorflow as hvd

    tf.config.threading.set_intra_op_parallelism_threads(1)
    size = int(os.environ["HORA_SIZE"])
    hvd.init(process_sets="dynamic")
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn(tf, hvd, rank, size)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    hvd.shutdown()
    return results


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"np{n}")
def battery(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, str]]]:
    return request.param, run_ranks(run_all, request.param, timeout=170)


@pytest.mark.timeout(220)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_tensorflow_op(battery: tuple[int, list[dict[str, str]]], check: str) -> None:
    np_, per_rank = battery
    for rank, results in enumerate(per_rank):
        assert results.get(check) == "ok", f"np={np_} rank {rank}:\n{results.get(check)}"
