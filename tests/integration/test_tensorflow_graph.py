"""hora.tensorflow in graphs: no order of independent collectives may hang, and failures are
TensorFlow's error classes.

One job per world size (2 and 3) runs every ``check_*`` on every rank (real processes, under
the harness's hard timeout, so a deadlock fails the test instead of freezing the run). The
ranks are made to reach their collectives in opposite orders: each op's input waits a
rank-dependent time first, so rank 0 reaches them first to last and the others last to first.
TF1 sessions run with inter-op pools of one and two threads, where an op that held an executor
thread while it waited for its peers could wait forever.
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

SIZES = [2, 3]
DELAY = 0.03  # seconds between one op's input and the next's, per rank


def late(tf: Any, x: Any, i: int, k: int, r: int) -> Any:
    """``x``, produced after a wait that puts op ``i`` of ``k`` at a rank-dependent place."""
    import time

    wait = DELAY * (i if r == 0 else k - 1 - i)

    def slow(a: np.ndarray) -> np.ndarray:
        time.sleep(wait)
        return a

    out = tf.numpy_function(slow, [x], x.dtype, stateful=True)
    out.set_shape(x.shape)
    return out


def rows(r: int, cols: int = 3) -> np.ndarray:
    """Rank r's input: r + 1 rows (so gathers are uneven), values that name the rank."""
    return (np.arange((r + 1) * cols, dtype=np.float32).reshape(r + 1, cols) + 100 * r)


def independent_ops(tf: Any, hvd: Any, r: int, n: int) -> tuple[list[Any], list[Any]]:
    """Eleven independent collectives (and their expected values), fed in a rank order."""
    k = 11
    x = [late(tf, tf.constant(np.full([4], r + i, np.float32)), i, k, r) for i in range(k)]
    g = [late(tf, tf.constant(rows(r)), i, k, r) for i in range(k)]
    full = np.concatenate([rows(q) for q in range(n)])
    base = [np.full([4], q, np.float32) for q in range(n)]
    outs = [
        hvd.allreduce(x[0], op=hvd.Sum),
        hvd.allreduce(x[1], op=hvd.Sum, name="named_sum"),
        hvd.allreduce(x[2]),  # Average
        hvd.allgather(g[3]),
        hvd.broadcast(x[4], root_rank=n - 1),
        hvd.grouped_allreduce([x[5], x[6]], op=hvd.Max),
        hvd.grouped_allgather([g[7], g[8]]),
        hvd.alltoall(tf.tile(x[9][:1], [n])),
        hvd.reducescatter(tf.tile(tf.reshape(x[10], [1, 4]), [n, 1]), op=hvd.Sum),
    ]
    sums = [sum(b + i for b in base) for i in range(k)]
    want = [
        sums[0], sums[1], sums[2] / n, full, np.full([4], n - 1 + 4, np.float32),
        [np.full([4], n - 1 + 5, np.float32), np.full([4], n - 1 + 6, np.float32)],
        [full, full],
        np.array([q + 9 for q in range(n)], np.float32),
        np.tile(sums[10].reshape(1, 4), [1, 1]),
    ]  # fmt: skip
    return outs, want


def close(got: Any, want: Any) -> None:
    if isinstance(want, list):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            close(a, b)
        return
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def session(tf: Any, pool: int) -> Any:
    cfg = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=pool,
                                   intra_op_parallelism_threads=1)  # fmt: skip
    return tf.compat.v1.Session(config=cfg)


def check_v1_independent_ops_in_any_order(tf: Any, hvd: Any, r: int, n: int) -> None:
    for pool in (1, 2):
        with tf.Graph().as_default():
            outs, want = independent_ops(tf, hvd, r, n)
            with session(tf, pool) as s:
                for _ in range(3):  # the same nodes again: same names, cached responses
                    close(s.run(outs), want)


def check_v1_gradients_of_grouped_ops(tf: Any, hvd: Any, r: int, n: int) -> None:
    """The case that hung: the gradients of a grouped allgather (and of every other op)
    evaluated in one run; the ranks build their inputs in opposite orders."""
    k = 5
    for pool in (1, 2):
        with tf.Graph().as_default():
            xs = [late(tf, tf.constant(rows(r) + i), i, k, r) for i in range(k)]
            ys = hvd.grouped_allgather(xs)
            loss = tf.add_n([tf.reduce_sum(y * y) for y in ys])
            sums = hvd.grouped_allreduce([tf.reduce_sum(x) for x in xs], op=hvd.Sum)
            first = hvd.broadcast(tf.reduce_sum(xs[0], 0), root_rank=0)
            grads = tf.gradients(loss, xs)
            with session(tf, pool) as s:
                for _ in range(2):
                    got, got_sums, got_first = s.run([grads, sums, first])
            close(got_sums, [sum(rows(q).sum() + i * rows(q).size for q in range(n))
                             for i in range(k)])  # fmt: skip
            close(got_first, rows(0).sum(0))
            for i in range(k):  # d/dx sum(y^2) = 2y, Average-reduced, this rank's rows
                close(got[i], 2 * (rows(r) + i))


def check_v1_gradients_of_every_op(tf: Any, hvd: Any, r: int, n: int) -> None:
    """tf.gradients through every differentiable collective, all in one run."""
    k = 8
    xs = []
    with tf.Graph().as_default():
        xs = [late(tf, tf.constant(np.ones([2 * n, 2], np.float32)), i, k, r) for i in range(k)]
        ys = [
            hvd.allreduce(xs[0], op=hvd.Sum),
            *hvd.grouped_allreduce([xs[1], xs[2]]),
            hvd.allgather(xs[3]),
            hvd.broadcast(xs[4], root_rank=0),
            hvd.alltoall(xs[5]),
            hvd.reducescatter(xs[6], op=hvd.Sum),
            *hvd.grouped_reducescatter([xs[7]], op=hvd.Average),
        ]
        grads = tf.gradients(tf.add_n([tf.reduce_sum(y) for y in ys]), xs)
        with session(tf, 1) as s:
            got = s.run(grads)
    # Horovod's rules for d(sum of outputs)/d(input), with every rank's outputs summed alike
    want = [n, 1, 1, 1, 1 if r == 0 else 0, 1, n, 1]
    for g, w in zip(got, want):
        close(g, np.full([2 * n, 2], w, np.float32))


def check_v1_broadcast_inplace_returns_what_to_run(tf: Any, hvd: Any, r: int, n: int) -> None:
    """In a TF1 graph broadcast_ returns tensors whose evaluation broadcasts and assigns."""
    with tf.Graph().as_default():
        for resource in (True, False):
            v = tf.compat.v1.Variable(np.full([3], r, np.float32), use_resource=resource)
            w = tf.compat.v1.Variable(np.full([2], 10 + r, np.int32), use_resource=resource)
            outs = hvd.broadcast_([v, w], root_rank=n - 1)
            with session(tf, 1) as s:
                s.run(tf.compat.v1.global_variables_initializer())
                got = s.run(outs)
                close(got, [np.full([3], n - 1), np.full([2], 10 + n - 1)])
                close(s.run([v, w]), [np.full([3], n - 1), np.full([2], 10 + n - 1)])


def check_function_independent_ops(tf: Any, hvd: Any, r: int, n: int) -> None:
    """Inside tf.function the same ops run in program order on every rank."""
    want: list[Any] = []

    def step() -> list[Any]:
        outs, w = independent_ops(tf, hvd, r, n)
        want[:] = w
        return outs

    got = tf.function(step)()
    close(tf.nest.map_structure(np.asarray, got), want)


def check_errors_are_tensorflow_errors(tf: Any, hvd: Any, r: int, n: int) -> None:
    def mismatch() -> Any:  # every rank a different shape
        return hvd.allreduce(tf.ones([r + 1]), name="bad_shape")

    with pytest.raises(tf.errors.FailedPreconditionError, match="(?i)shape") as e:
        mismatch()
    assert isinstance(e.value, hvd.HorovodInternalError)  # both catches work in eager mode
    with pytest.raises(tf.errors.FailedPreconditionError, match="(?i)type"):
        hvd.allreduce(tf.ones([2], tf.float32 if r == 0 else tf.float64))
    with pytest.raises(tf.errors.FailedPreconditionError, match="(?i)root"):
        hvd.broadcast(tf.ones([2]), root_rank=r)
    with pytest.raises(tf.errors.FailedPreconditionError, match="(?i)shape"):
        tf.function(mismatch)()
    with tf.Graph().as_default():
        op = hvd.allgather(tf.ones([2, r + 1]))  # rows may differ; columns may not
        with session(tf, 1) as s, pytest.raises(tf.errors.FailedPreconditionError):
            s.run(op)
    with pytest.raises(tf.errors.InvalidArgumentError):  # splits larger than the rows
        hvd.alltoall(tf.ones([n - 1]), splits=tf.ones([n], tf.int32))
    # after the failures the ranks' automatic names still agree: unnamed ops pair up
    for i in range(3):
        close(hvd.allreduce(tf.fill([2], float(r + i)), op=hvd.Sum),
              np.full([2], sum(q + i for q in range(n))))  # fmt: skip


CHECKS = {
    name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_")
}


def run_all(rank: int) -> dict[str, str]:
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    import hora.tensorflow as hvd

    tf.config.threading.set_intra_op_parallelism_threads(1)
    size = int(os.environ["HORA_SIZE"])
    hvd.init()
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn(tf, hvd, rank, size)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        hvd.barrier()  # a failed check leaves no op of its own behind for the next one
    hvd.shutdown()
    return results


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"np{n}")
def battery(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, str]]]:
    return request.param, run_ranks(run_all, request.param, timeout=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_tensorflow_graph(battery: tuple[int, list[dict[str, str]]], check: str) -> None:
    np_, per_rank = battery
    for rank, results in enumerate(per_rank):
        assert results.get(check) == "ok", f"np={np_} rank {rank}:\n{results.get(check)}"
