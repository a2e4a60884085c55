"""Horovod's local gradient aggregation and worker-local variables in Keras, at np=2.

Like ``test_tensorflow_keras.py``: each Keras world (Keras 3, tf_keras with
``TF_USE_LEGACY_KERAS=1``) is one job whose ranks run every check meant for that world. The
checks: ``backward_passes_per_step`` on tf_keras optimizers (legacy and current) reduces and
applies every Nth pass with local sums in between, averaged or not, dense or sparse, carrying
an infinite gradient without crashing; ``get_gradients`` (a legacy optimizer's, or one a
subclass of a current optimizer defines) returns reduced tensors; ``register_local_var``,
``PartialDistributedOptimizer``, ``PartialDistributedGradientTape`` and
``BroadcastGlobalVariablesCallback(local_variables=)`` keep local variables out of the
reduction and the broadcast.
"""

from __future__ import annotations

import importlib.util
import os
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from harness import run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None,
    reason="tensorflow is not installed (pip install 'hora[tensorflow]')",
)

NP = 2
BOTH = ("keras3", "tf_keras")
TF_KERAS = ("tf_keras",)
CHECKS: dict[str, tuple[Callable[..., None], tuple[str, ...]]] = {}


def check(*worlds: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def register(fn: Callable[..., None]) -> Callable[..., None]:
        CHECKS[fn.__name__] = (fn, worlds)
        return fn

    return register


def sgd_classes(ctx: dict[str, Any]) -> list[Any]:
    """The world's SGD optimizers: tf_keras has a legacy one beside the current one."""
    keras = ctx["keras"]
    return [keras.optimizers.SGD] + ([keras.optimizers.legacy.SGD] if ctx["legacy"] else [])


def variable(ctx: dict[str, Any], value: Any) -> Any:
    """A variable of the world: ``keras.Variable`` on Keras 3, ``tf.Variable`` on tf_keras."""
    if ctx["legacy"]:
        return ctx["tf"].Variable(value, dtype="float32")
    return ctx["keras"].Variable(np.asarray(value, np.float32))


@check(*TF_KERAS)
def check_aggregation_every_nth_pass(ctx: dict[str, Any], r: int, n: int) -> None:
    """Local sums for N-1 passes, reduced and applied on the Nth; iterations count passes."""
    tf, hvd = ctx["tf"], ctx["hvd"]
    passes, lr, c = 4, 0.5, float(r + 1)
    mean_c = (n + 1) / 2  # the average of c over the ranks
    for make in sgd_classes(ctx):
        for average, sparse_as_dense, path in ((False, True, "compute"), (True, False, "tape")):
            opt = hvd.DistributedOptimizer(
                make(learning_rate=lr), backward_passes_per_step=passes,
                average_aggregated_gradients=average, sparse_as_dense=sparse_as_dense,
            )  # fmt: skip
            x, y = tf.Variable([0.0]), tf.Variable([1.0, 2.0])

            def loss(x: Any = x, y: Any = y) -> Any:
                return tf.reduce_sum(c * (x - tf.gather(y, [0])))  # y's gradient is sparse

            @tf.function
            def step(x: Any = x, y: Any = y, opt: Any = opt, path: str = path) -> Any:
                if path == "compute":
                    pairs = opt.compute_gradients(loss, [x, y])
                    opt.apply_gradients(pairs)
                    return pairs[0][0]
                with tf.GradientTape() as tape:
                    value = loss()
                grads = tape.gradient(value, [x, y])
                opt.apply_gradients(zip(grads, [x, y]))
                return tf.zeros([1])

            factor = 1.0 if average else float(passes)
            for k in range(1, 11):
                got = step().numpy()
                cycles = k // passes
                want_x = -lr * cycles * mean_c * factor
                where = f"{make.__module__} {path} average={average} pass {k}"
                np.testing.assert_allclose(x.numpy(), [want_x], rtol=1e-6, err_msg=where)
                np.testing.assert_allclose(y.numpy(), [1.0 - want_x, 2.0], rtol=1e-6,
                                           err_msg=where)  # fmt: skip
                assert int(opt.iterations.numpy()) == k, where
                assert int(opt._agg_helper.counter.numpy()) == k % passes, where
                if path == "compute":  # this rank's own sum, or the reduced sum on the Nth
                    want = mean_c * factor if k % passes == 0 else c * (k % passes)
                    np.testing.assert_allclose(got, [want], rtol=1e-6, err_msg=where)


@check(*TF_KERAS)
def check_aggregation_carries_inf(ctx: dict[str, Any], r: int, n: int) -> None:
    """An infinite gradient reaches the variable; the next cycle starts from clean sums."""
    tf, hvd = ctx["tf"], ctx["hvd"]
    for make, graph in zip(sgd_classes(ctx) * 2, (False, True, True, False)):
        opt = hvd.DistributedOptimizer(make(0.1), backward_passes_per_step=2,
                                       sparse_as_dense=True)  # fmt: skip
        x, count = tf.Variable(0.0), tf.Variable(0)

        def loss(x: Any = x, count: Any = count) -> Any:
            count.assign_add(1)
            return tf.cond(count > 1, lambda: x, lambda: x * float("inf"))

        def step(opt: Any = opt, x: Any = x) -> Any:
            pairs = opt.compute_gradients(loss, [x])
            opt.apply_gradients(pairs)
            return pairs[0][0]

        run = tf.function(step) if graph else step
        grads, xs = [], []
        for _ in range(4):
            grads.append(float(run().numpy()))
            xs.append(float(x.numpy()))
        where = f"{make.__module__} graph={graph}: grads {grads}, x {xs}"
        assert grads[0] == float("inf") and grads[1] == float("inf"), where
        assert grads[2:] == [1.0, 2.0], where  # the sums were reset after the update
        # x moves only on passes 2 and 4; -inf stays -inf (or nan, from the optimizer's own
        # arithmetic: tf_keras' current SGD multiplies its -inf momentum by 0)
        assert xs[0] == 0.0 and np.isneginf(xs[1]) and np.isneginf(xs[2]), where
        assert not np.isfinite(xs[3]), where


@check(*TF_KERAS)
def check_legacy_get_gradients_reduced(ctx: dict[str, Any], r: int, n: int) -> None:
    """``get_gradients`` gives reduced tensors; ``apply_gradients`` does not reduce them again."""
    tf, keras, hvd = ctx["tf"], ctx["keras"], ctx["hvd"]
    opt = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(0.1), op=hvd.Sum)
    v = tf.Variable([1.0, 2.0])

    @tf.function
    def step() -> Any:
        grads = opt.get_gradients(tf.reduce_sum(v * v * float(r + 1)), [v])
        assert all(isinstance(g, tf.Tensor) for g in grads), grads
        opt.apply_gradients(zip(grads, [v]))
        return grads

    (grad,) = step()
    total = sum(range(1, n + 1))  # Sum over the ranks of (r + 1)
    np.testing.assert_allclose(grad.numpy(), [2.0 * total, 4.0 * total], rtol=1e-6)
    np.testing.assert_allclose(v.numpy(), [1.0 - 0.2 * total, 2.0 - 0.4 * total], rtol=1e-6)


@check(*TF_KERAS)
def check_subclass_get_gradients_reduced(ctx: dict[str, Any], r: int, n: int) -> None:
    """A subclass of a current tf_keras optimizer that defines ``get_gradients``: its gradients
    come back reduced, and ``model.fit`` (``compute_gradients``) still trains with it."""
    tf, keras, hvd = ctx["tf"], ctx["keras"], ctx["hvd"]

    class RankGradients(keras.optimizers.SGD):
        def get_gradients(self, loss: Any, params: Any) -> list[Any]:
            return [tf.constant([float(r)]) for _ in params]

    opt = hvd.DistributedOptimizer(RankGradients(1.0))
    v = tf.Variable([0.0])
    (grad,) = opt.get_gradients(None, [v])
    opt.apply_gradients([(grad, v)])
    np.testing.assert_allclose(v.numpy(), [-(n - 1) / 2], rtol=1e-6)  # minus the ranks' mean
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(RankGradients(0.1)), loss="mse")
    model.fit(np.ones((4, 2), np.float32), np.ones((4, 1), np.float32), verbose=0)


@check(*BOTH)
def check_register_local_var_with_aggregation(ctx: dict[str, Any], r: int, n: int) -> None:
    """A local variable's gradient is its own (divided by size with scale_local_gradients),
    summed over N passes like the others."""
    tf, hvd = ctx["tf"], ctx["hvd"]
    passes, lr, c = 2, 0.5, float(r + 1)
    mean_c = (n + 1) / 2
    for make in sgd_classes(ctx):
        for scale in (True, False):
            opt = hvd.DistributedOptimizer(make(lr), backward_passes_per_step=passes,
                                           scale_local_gradients=scale)  # fmt: skip
            mine, shared = variable(ctx, [0.0]), variable(ctx, [0.0])
            opt.register_local_var(mine)
            for _ in range(2 * passes):
                with tf.GradientTape() as tape:
                    value = tf.reduce_sum(c * mine + c * shared)
                grads = tape.gradient(value, [mine, shared])
                opt.apply_gradients(zip(grads, [mine, shared]))
            local_grad = c / n if scale else c
            where = f"{make.__module__} scale_local_gradients={scale}"
            np.testing.assert_allclose(np.asarray(mine), [-lr * 2 * passes * local_grad],
                                       rtol=1e-6, err_msg=where)  # fmt: skip
            np.testing.assert_allclose(np.asarray(shared), [-lr * 2 * passes * mean_c],
                                       rtol=1e-6, err_msg=where)  # fmt: skip


def two_layers(ctx: dict[str, Any]) -> Any:
    keras = ctx["keras"]
    keras.utils.set_random_seed(11)  # the same weights on every rank
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="tanh"),
                             keras.layers.Dense(1)])  # fmt: skip


def batch_of(r: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(40 + r)  # every rank its own data
    return rng.normal(size=(6, 3)).astype(np.float32), rng.normal(size=(6, 1)).astype(np.float32)


def plain_gradients(ctx: dict[str, Any], model: Any, xb: np.ndarray, yb: np.ndarray) -> list[Any]:
    tf = ctx["tf"]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
    return [np.asarray(g) for g in tape.gradient(loss, model.trainable_variables)]


@check(*BOTH)
def check_partial_distributed_optimizer(ctx: dict[str, Any], r: int, n: int) -> None:
    """One ``fit`` step: the local layer moves by its own gradient / size, the other by the
    ranks' average gradient."""
    hvd = ctx["hvd"]
    lr = 0.1
    xb, yb = batch_of(r)
    for make in sgd_classes(ctx):
        model = two_layers(ctx)
        before = [np.asarray(w) for w in model.trainable_variables]
        own = plain_gradients(ctx, model, xb, yb)
        everyone = hvd.allgather_object(own)
        opt = hvd.PartialDistributedOptimizer(make(lr), local_layers=model.layers[0])
        model.compile(optimizer=opt, loss="mse")
        model.fit(xb, yb, batch_size=len(xb), epochs=1, shuffle=False, verbose=0)
        n_local = len(model.layers[0].trainable_variables)
        for i, w in enumerate(model.trainable_variables):
            grad = own[i] / n if i < n_local else np.mean([g[i] for g in everyone], axis=0)
            where = f"{make.__module__} weight {i}"
            np.testing.assert_allclose(np.asarray(w), before[i] - lr * grad, rtol=1e-4,
                                       atol=1e-6, err_msg=where)  # fmt: skip
    with pytest.raises(ValueError, match="local layers"):
        hvd.PartialDistributedOptimizer(sgd_classes(ctx)[0](0.1), local_layers=["dense"])


@check(*BOTH)
def check_partial_distributed_gradient_tape(ctx: dict[str, Any], r: int, n: int) -> None:
    """``PartialDistributedGradientTape`` (inside tf.function) and ``register_local_source``."""
    tf, hvd_tf = ctx["tf"], ctx["hvd_tf"]
    xb, yb = batch_of(r)
    model = two_layers(ctx)
    own = plain_gradients(ctx, model, xb, yb)
    everyone = hvd_tf.allgather_object(own)
    average = [np.mean([g[i] for g in everyone], axis=0) for i in range(len(own))]
    n_local = len(model.layers[0].trainable_variables)

    @tf.function
    def partial() -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
        tape = hvd_tf.PartialDistributedGradientTape(tape, local_layers=[model.layers[0]])
        return tape.gradient(loss, model.trainable_variables)

    for i, g in enumerate(partial()):
        want = own[i] / n if i < n_local else average[i]
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-4, atol=1e-6, err_msg=f"{i}")

    local_var, shared_var = model.trainable_variables[0], model.trainable_variables[-1]
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
    tape = hvd_tf.DistributedGradientTape(tape, scale_local_gradients=False)
    tape.register_local_source(local_var)
    mine, others = tape.get_local_and_global_gradients(loss, [local_var, shared_var])
    assert [s is local_var for s, _ in mine] == [True] and len(others) == 1
    np.testing.assert_allclose(mine[0][1].numpy(), own[0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(others[0][1].numpy(), average[-1], rtol=1e-4, atol=1e-6)


@check(*BOTH)
def check_broadcast_callback_local_variables(ctx: dict[str, Any], r: int, n: int) -> None:
    """Variables in ``local_variables`` keep each rank's value; the rest take the root's."""
    keras, hvd = ctx["keras"], ctx["hvd"]
    root = n - 1
    init = keras.initializers.Constant(float(r))
    model = keras.Sequential([keras.Input((3,))] + [
        keras.layers.Dense(3, kernel_initializer=init, bias_initializer=init) for _ in range(3)
    ])  # fmt: skip
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    local = list(model.layers[0].variables)
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(root, local_variables=local)
    model.fit(np.ones((4, 3), np.float32), np.ones((4, 3), np.float32), batch_size=2, epochs=1,
              verbose=0, callbacks=[callback])  # fmt: skip
    for k, layer in enumerate(model.layers):
        want = float(r) if k == 0 else float(root)
        for w in layer.variables:
            np.testing.assert_allclose(np.asarray(w), want, err_msg=f"layer {k}")
    single = hvd.callbacks.BroadcastGlobalVariablesCallback(root, local_variables=local[0])
    assert len(single._local_vars) == 1
    with pytest.raises(ValueError, match="tf.Variable"):
        hvd.callbacks.BroadcastGlobalVariablesCallback(root, local_variables=["kernel"])


def run_all(rank: int, world: str) -> dict[str, str]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    import hora.tensorflow as hvd_tf
    import hora.tensorflow.keras as hvd

    tf.config.threading.set_intra_op_parallelism_threads(1)
    legacy = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    ctx = {"tf": tf, "keras": tf.keras, "hvd": hvd, "hvd_tf": hvd_tf, "legacy": legacy}
    hvd.init()
    results = {}
    for name, (fn, worlds) in CHECKS.items():
        if world not in worlds:
            continue
        try:
            fn(ctx, rank, hvd.size())
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    hvd.shutdown()
    return results


_BATTERIES: dict[str, list[dict[str, str]] | AssertionError] = {}


def battery(world: str) -> list[dict[str, str]]:
    """Every rank's results for ``world``'s checks: one job per world, run on first use (a
    job that failed as a whole fails each of its checks without running again)."""
    if world == "tf_keras" and importlib.util.find_spec("tf_keras") is None:
        pytest.skip("tf_keras is not installed (pip install 'hora[tensorflow]')")
    if world not in _BATTERIES:
        env = {"TF_USE_LEGACY_KERAS": "1" if world == "tf_keras" else "0"}
        try:
            _BATTERIES[world] = run_ranks(run_all, NP, args=(world,), timeout=200, env=env)
        except AssertionError as e:
            _BATTERIES[world] = e
    got = _BATTERIES[world]
    if isinstance(got, AssertionError):
        raise got
    return got


CASES = [(world, name) for world in BOTH for name, (_, worlds) in sorted(CHECKS.items())
         if world in worlds]  # fmt: skip


@pytest.mark.timeout(260)
@pytest.mark.parametrize(("world", "check_name"), CASES)
def test_keras_local(world: str, check_name: str) -> None:
    for rank, results in enumerate(battery(world)):
        assert results.get(check_name) == "ok", f"{world} rank {rank}:\n{results.get(check_name)}"
