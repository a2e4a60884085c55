"""TensorFlow 1 graphs and sessions on hora (``tf.compat.v1``), at np=2.

One job whose ranks run every ``check_*``, each in a graph of its own: the
``BroadcastGlobalVariablesHook`` in a ``MonitoredTrainingSession`` makes every rank's variables
the root's, ``broadcast_global_variables``/``broadcast_variables`` return ops that do the same,
the TensorFlow 1 ``DistributedOptimizer`` (two ranks on halves of each batch end where one rank
on the whole batches ends; ``compute_gradients`` returns reduced gradients; local gradient
aggregation; local variables), and Horovod's argument checks.
"""

from __future__ import annotations

import importlib.util
import math
import os
import tempfile
import traceback
from typing import Any

import numpy as np
import pytest

from harness import run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None,
    reason="tensorflow is not installed (pip install 'hora[tensorflow]')",
)

NP = 2
BATCH = 6  # rows per rank and step
STEPS = 3


def session(tf: Any) -> Any:
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=2)  # fmt: skip
    return tf.compat.v1.Session(config=config)


def check_hook_makes_variables_equal(ctx: dict[str, Any], r: int, n: int) -> None:
    tf, hvd = ctx["tf"], ctx["hvd"]
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.fill([3, 2], 1.0 + r))
        step = tf.compat.v1.train.get_or_create_global_step()
        k = tf.compat.v1.get_variable("k", initializer=tf.constant([10 * r, 7], tf.int32))
        hooks = [hvd.BroadcastGlobalVariablesHook(0)]
        root = 1 if n > 1 else 0
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            got_w, got_k, got_step = sess.run([w, k, step])
        np.testing.assert_array_equal(got_w, np.full((3, 2), 1.0))
        np.testing.assert_array_equal(got_k, [0, 7])
        assert got_step == 0
        # another root, another graph: the hook builds its op in the session's graph
        with tf.Graph().as_default():
            v = tf.compat.v1.get_variable("v", initializer=tf.constant([float(r)]))
            hook = hvd.BroadcastGlobalVariablesHook(root_rank=root, device="")
            with tf.compat.v1.train.MonitoredTrainingSession(hooks=[hook]) as sess:
                np.testing.assert_array_equal(sess.run(v), [float(root)])


def check_broadcast_global_variables_op(ctx: dict[str, Any], r: int, n: int) -> None:
    tf, hvd = ctx["tf"], ctx["hvd"]
    with pytest.raises(RuntimeError, match="does not support eager execution"):
        hvd.broadcast_global_variables(0)  # eager here
    with tf.Graph().as_default():
        a = tf.compat.v1.get_variable("a", initializer=tf.constant(np.arange(5.0) * (r + 1)))
        b = tf.compat.v1.get_variable("b", initializer=tf.constant([r + 3], tf.int64))
        op = hvd.broadcast_global_variables(0)
        assert isinstance(op, tf.Operation), type(op)
        with session(tf) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(op)
            got_a, got_b = sess.run([a, b])
        np.testing.assert_array_equal(got_a, np.arange(5.0))
        np.testing.assert_array_equal(got_b, [3])
    with tf.Graph().as_default():
        c = tf.Variable([float(r), 2.0 * r])
        op = hvd.broadcast_variables([c], root_rank=n - 1)
        assert isinstance(op, tf.Operation), type(op)
        with session(tf) as sess:
            sess.run(c.initializer)
            sess.run(op)
            np.testing.assert_array_equal(sess.run(c), [n - 1.0, 2.0 * (n - 1)])


def _data(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(STEPS, n * BATCH, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.3).astype(np.float32)
    return x, y


def _train(tf: Any, x: np.ndarray, y: np.ndarray, wrap: Any) -> list[np.ndarray]:
    """A two-layer network trained by ``wrap(optimizer).minimize``, one batch per step."""
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(11)
        xs = tf.compat.v1.placeholder(tf.float32, [None, 4])
        ys = tf.compat.v1.placeholder(tf.float32, [None, 1])
        init = tf.compat.v1.glorot_uniform_initializer(seed=5)
        w1 = tf.compat.v1.get_variable("w1", [4, 8], initializer=init)
        b1 = tf.compat.v1.get_variable("b1", [8], initializer=tf.compat.v1.zeros_initializer())
        w2 = tf.compat.v1.get_variable("w2", [8, 1], initializer=init)
        loss = tf.reduce_mean((tf.matmul(tf.tanh(tf.matmul(xs, w1) + b1), w2) - ys) ** 2)
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = wrap(tf.compat.v1.train.MomentumOptimizer(0.05, momentum=0.5))
        train = opt.minimize(loss, global_step=step)
        with session(tf) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for k in range(len(x)):
                sess.run(train, {xs: x[k], ys: y[k]})
            assert sess.run(step) == len(x)
            return sess.run([w1, b1, w2])


def check_optimizer_halves_equal_whole(ctx: dict[str, Any], r: int, n: int) -> None:
    tf, hvd = ctx["tf"], ctx["hvd"]
    x, y = _data(n)
    want = _train(tf, x, y, lambda opt: opt)
    mine = slice(r * BATCH, (r + 1) * BATCH)
    got = _train(tf, x[:, mine], y[:, mine], hvd.DistributedOptimizer)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def check_compute_gradients_are_reduced(ctx: dict[str, Any], r: int, n: int) -> None:
    tf, hvd = ctx["tf"], ctx["hvd"]
    with tf.Graph().as_default():
        w = tf.Variable([1.0, 2.0, 3.0])
        u = tf.Variable(5.0)  # no gradient: stays None
        x = tf.constant([float(r), 1.0, 2.0 * r])
        loss = tf.reduce_sum(w * x)
        sgd = tf.compat.v1.train.GradientDescentOptimizer(0.5)
        avg = hvd.DistributedOptimizer(sgd)
        assert isinstance(avg, tf.compat.v1.train.Optimizer)
        assert avg.get_name() == "DistributedGradientDescentOptimizer"
        pairs = avg.compute_gradients(loss, var_list=[w, u])
        assert pairs[1] == (None, u) and pairs[0][1] is w
        total = hvd.DistributedOptimizer(sgd, name="summed", op=hvd.Sum)
        assert total.get_name() == "summed"
        summed = total.compute_gradients(loss, var_list=[w])[0][0]
        pre = hvd.DistributedOptimizer(sgd, gradient_predivide_factor=2.0)
        predivided = pre.compute_gradients(loss, var_list=[w])[0][0]
        update = avg.apply_gradients(pairs[:1])
        with session(tf) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            ranks = np.arange(n, dtype=np.float32)
            mean = np.array([ranks.mean(), 1.0, 2.0 * ranks.mean()], np.float32)
            np.testing.assert_allclose(sess.run(pairs[0][0]), mean, rtol=1e-6)
            np.testing.assert_allclose(sess.run(summed), mean * n, rtol=1e-6)
            np.testing.assert_allclose(sess.run(predivided), mean, rtol=1e-6)
            sess.run(update)
            np.testing.assert_allclose(sess.run(w), [1.0, 2.0, 3.0] - 0.5 * mean, rtol=1e-6)


def check_local_variables_and_groups(ctx: dict[str, Any], r: int, n: int) -> None:
    tf, hvd = ctx["tf"], ctx["hvd"]
    with tf.Graph().as_default():
        a, b, c = tf.Variable(1.0), tf.Variable(1.0), tf.Variable(1.0)
        loss = (a + b + c) * float(r + 1)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                       groups=[[a, c]])  # fmt: skip
        opt.register_local_var(b)
        grads = [g for g, _ in opt.compute_gradients(loss, var_list=[a, b, c])]
        with session(tf) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            ga, gb, gc = sess.run(grads)
    mean = (n + 1) / 2
    assert (ga, gc) == (mean, mean)
    assert gb == pytest.approx((r + 1) / n)  # kept local, divided by the size


def _aggregated(passes: int, step: int, n: int) -> float:
    """The variable after ``step`` + 1 steps where rank r's gradient is always r: each
    completed window of ``passes`` steps adds the ranks' average of their sums over the window,
    divided by ``passes`` (average_aggregated_gradients): the mean rank."""
    return math.floor((step + 1) / passes) * (sum(range(n)) / n)


def check_backward_passes_per_step(ctx: dict[str, Any], r: int, n: int) -> None:
    tf, hvd = ctx["tf"], ctx["hvd"]
    with pytest.raises(ValueError, match="eager execution"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                 backward_passes_per_step=2)  # fmt: skip
    with tf.Graph().as_default():
        v = tf.Variable([0.0])

        class Fixed(tf.compat.v1.train.Optimizer):
            def compute_gradients(self, *args: Any, **kwargs: Any) -> Any:
                return [(tf.constant([float(r)]), v)]

            def _apply_dense(self, grad: Any, var: Any) -> Any:
                return var.assign_add(grad)

            _resource_apply_dense = _apply_dense

        passes = 4
        opt = hvd.DistributedOptimizer(Fixed(False, "fixed"), backward_passes_per_step=passes,
                                       average_aggregated_gradients=True)  # fmt: skip
        pairs = opt.compute_gradients()
        step = tf.compat.v1.get_variable("step", initializer=tf.constant(0, tf.int64),
                                         trainable=False)  # fmt: skip
        with tf.control_dependencies([g for g, _ in pairs]):
            before = step + 0
        with tf.control_dependencies([before]):
            update = opt.apply_gradients(pairs, global_step=step)
        with session(tf) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(tf.compat.v1.local_variables_initializer())
            seen = []
            for k in range(10):
                s, _ = sess.run((before, update))
                seen.append(int(s))
                assert sess.run(v)[0] == pytest.approx(_aggregated(passes, k, n)), k
            assert seen == list(range(10))


def check_argument_rules(ctx: dict[str, Any], r: int, n: int) -> None:
    tf, hvd = ctx["tf"], ctx["hvd"]
    sgd = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="groups"):
        hvd.DistributedOptimizer(sgd, groups=0)
    with pytest.warns(DeprecationWarning, match="num_groups"):
        hvd.DistributedOptimizer(sgd, num_groups=2)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.DistributedOptimizer(sgd, op=hvd.Adasum)
    with pytest.raises(ValueError, match="Keras optimizer or a tf.compat.v1.train.Optimizer"):
        hvd.DistributedOptimizer(object())


def check_checkpoint_restored_on_root_reaches_everyone(ctx: dict[str, Any], r: int,
                                                       n: int) -> None:  # fmt: skip
    """Rank 0 alone restores a checkpoint; the hook hands its values to the other ranks."""
    tf, hvd = ctx["tf"], ctx["hvd"]
    folder = hvd.broadcast_object(tempfile.mkdtemp() if r == 0 else None)
    if r == 0:
        with tf.Graph().as_default():
            w = tf.compat.v1.get_variable("w", initializer=tf.constant([42.0, 43.0]))
            tf.compat.v1.train.get_or_create_global_step()
            with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=folder) as sess:
                sess.run(w)
    hvd.allgather_object(None)  # the checkpoint is written
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.constant([float(r), 0.0]))
        tf.compat.v1.train.get_or_create_global_step()
        hooks = [hvd.BroadcastGlobalVariablesHook(0)]
        ckpt = folder if r == 0 else None
        with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=ckpt, hooks=hooks,
                                                         save_checkpoint_secs=None) as sess:
            np.testing.assert_array_equal(sess.run(w), [42.0, 43.0])
    if r == 0:
        assert os.path.isfile(os.path.join(folder, "checkpoint"))


CHECKS = {name: fn for name, fn in dict(globals()).items() if name.startswith("check_")}


def run_all(rank: int) -> dict[str, str]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    import hora.tensorflow as hvd

    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
    ctx = {"tf": tf, "hvd": hvd}
    hvd.init()
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn(ctx, rank, hvd.size())
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        hvd.allgather_object(name)  # the ranks leave each check together
    hvd.shutdown()
    return results


@pytest.fixture(scope="module")
def battery() -> list[dict[str, str]]:
    return run_ranks(run_all, NP, timeout=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_tensorflow_v1(battery: list[dict[str, str]], check: str) -> None:
    for rank, results in enumerate(battery):
        assert results.get(check) == "ok", f"rank {rank}:\n{results.get(check)}"
