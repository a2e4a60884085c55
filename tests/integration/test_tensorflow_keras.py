"""Keras on hora, in both Keras worlds: Keras 3 (tf.keras by default) and tf_keras
(``TF_USE_LEGACY_KERAS=1``), at np=2.

Each world is one job whose ranks run every ``check_*``: ``model.fit`` with
``DistributedOptimizer`` and the callbacks (broadcast makes the weights equal, metrics averaged,
warm-up learning rates), two ranks on halves of each batch equal one rank on the whole batch,
a ``load_model`` round trip, the Keras-level collectives (tensors when eager, values in a
TensorFlow 1 session) and Horovod's names and argument checks.
"""

from __future__ import annotations

import importlib.util
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
BATCH = 8  # per rank
STEPS = 4  # per epoch


def data(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(BATCH * n * STEPS, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.1).astype(np.float32)
    return x, y


def my_part(a: np.ndarray, r: int, n: int) -> np.ndarray:
    """Rank r's share of every global batch of BATCH * n rows, in batch order."""
    batches = a.reshape(STEPS, n, BATCH, -1)
    return batches[:, r].reshape(STEPS * BATCH, -1)


def model_of(keras: Any, seed: int) -> Any:
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dense(1)])  # fmt: skip
    return m


def flat(model: Any) -> np.ndarray:
    return np.concatenate([np.asarray(w).ravel() for w in model.get_weights()])


def check_fit_with_callbacks(ctx: dict[str, Any], r: int, n: int) -> None:
    keras, hvd = ctx["keras"], ctx["hvd"]
    x, y = data(n)
    model = model_of(keras, seed=100 + r)  # the ranks start apart
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.05))
    model.compile(optimizer=opt, loss="mse")
    lrs: list[float] = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.05, warmup_epochs=2,
                                                 steps_per_epoch=STEPS),
        # after the warm-up (which ends one batch short of 1x, as Horovod's does), 1x
        hvd.callbacks.LearningRateScheduleCallback(0.05, multiplier=1.0, start_epoch=2),
        Record(),
    ]  # fmt: skip
    # each rank trains on different data, so its own loss differs until averaged
    hist = model.fit(x[r::n] * (1 + r), y[r::n] * (1 + r), batch_size=BATCH, epochs=3,
                     shuffle=False, verbose=0, callbacks=callbacks)  # fmt: skip
    everyone = hvd.allgather_object((flat(model).tolist(), hist.history["loss"], lrs))
    w0, loss0, _ = everyone[0]
    for w, loss, _ in everyone[1:]:
        np.testing.assert_allclose(w, w0, rtol=0, atol=0)
        np.testing.assert_allclose(loss, loss0, rtol=1e-6)
    want = [0.05 / n * ((e + b / STEPS) * (n - 1) / 2 + 1) for e in range(2) for b in range(STEPS)]
    np.testing.assert_allclose(lrs[: 2 * STEPS], want, rtol=1e-5)
    np.testing.assert_allclose(lrs[2 * STEPS :], [0.05] * STEPS, rtol=1e-5)
    assert np.isclose(hist.history["lr"][-1], 0.05)


def check_halves_equal_whole(ctx: dict[str, Any], r: int, n: int) -> None:
    keras, hvd = ctx["keras"], ctx["hvd"]
    x, y = data(n)
    ref = model_of(keras, seed=7)
    ref.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.5), loss="mse")
    ref.fit(x, y, batch_size=BATCH * n, epochs=2, shuffle=False, verbose=0)
    model = model_of(keras, seed=7)
    opt = keras.optimizers.SGD(learning_rate=0.05, momentum=0.5)
    model.compile(optimizer=hvd.DistributedOptimizer(opt), loss="mse")
    model.fit(my_part(x, r, n), my_part(y, r, n), batch_size=BATCH, epochs=2, shuffle=False,
              verbose=0)  # fmt: skip
    np.testing.assert_allclose(flat(model), flat(ref), rtol=1e-4, atol=1e-5)


def check_load_model_round_trip(ctx: dict[str, Any], r: int, n: int) -> None:
    keras, hvd, legacy = ctx["keras"], ctx["hvd"], ctx["legacy"]
    x, y = data(n)
    model = model_of(keras, seed=3)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    model.fit(x[r::n], y[r::n], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    path = hvd.broadcast_object(tempfile.mkdtemp() if r == 0 else None)
    path = os.path.join(path, "model.h5" if legacy else "model.keras")
    if r == 0:
        model.save(path)
    hvd.allgather_object(None)  # wait for the file
    loaded = hvd.load_model(path)
    opt = loaded.optimizer
    assert type(opt).__name__ == "Adam" and hasattr(opt, "_hora_reducer"), type(opt).__mro__
    assert int(np.asarray(opt.iterations)) == STEPS
    np.testing.assert_allclose(flat(loaded), flat(model), rtol=1e-6)
    loaded.fit(x[r::n] * (r + 1), y[r::n], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    everyone = hvd.allgather_object(flat(loaded).tolist())
    np.testing.assert_allclose(everyone[1], everyone[0], rtol=0, atol=0)


def check_tape_and_keras_model(ctx: dict[str, Any], r: int, n: int) -> None:
    """A custom loop: DistributedGradientTape inside tf.function with a Keras model."""
    keras, tf, hvd_tf = ctx["keras"], ctx["tf"], ctx["hvd_tf"]
    x, y = data(n)
    model = model_of(keras, seed=50 + r)
    opt = keras.optimizers.SGD(0.05)
    hvd_tf.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def step(xb: Any, yb: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
        tape = hvd_tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for k in range(STEPS):
        step(tf.constant(x[k * BATCH + r :: 100][:BATCH] * (r + 1)), tf.constant(y[:BATCH]))
    everyone = hvd_tf.allgather_object(flat(model).tolist())
    np.testing.assert_allclose(everyone[1], everyone[0], rtol=0, atol=0)


def check_backward_passes_per_step(ctx: dict[str, Any], r: int, n: int) -> None:
    """N=2 in fit: every 2 batches, the sum of their gradients (tf_keras: local sums reduced
    every 2nd pass; Keras 3: its gradient accumulation), for each SGD of the world."""
    keras, hvd = ctx["keras"], ctx["hvd"]
    x, y = data(n)
    # the reference: one rank, two global batches at a time at twice the learning rate (the
    # same update as the sum of the two batches' mean gradients)
    ref = model_of(keras, seed=9)
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.fit(x, y, batch_size=2 * BATCH * n, epochs=1, shuffle=False, verbose=0)
    makers = [keras.optimizers.SGD] + ([keras.optimizers.legacy.SGD] if ctx["legacy"] else [])
    for make in makers:
        model = model_of(keras, seed=9)
        opt = hvd.DistributedOptimizer(make(0.05), backward_passes_per_step=2)
        model.compile(optimizer=opt, loss="mse")
        model.fit(my_part(x, r, n), my_part(y, r, n), batch_size=BATCH, epochs=1, shuffle=False,
                  verbose=0)  # fmt: skip
        np.testing.assert_allclose(flat(model), flat(ref), rtol=1e-4, atol=1e-5,
                                   err_msg=make.__module__)  # fmt: skip
        if ctx["legacy"]:  # as in Horovod, every pass counts
            assert int(np.asarray(opt.iterations)) == STEPS


def check_standalone_keras_module(ctx: dict[str, Any], r: int, n: int) -> None:
    """``hora.keras`` with ``import keras`` (Keras 3 in both worlds)."""
    import keras

    import hora.keras as hvd_k

    model = model_of(keras, seed=20 + r)
    model.compile(optimizer=hvd_k.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    x, y = data(n)
    model.fit(x[r::n], y[r::n], batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
              callbacks=[hvd_k.callbacks.BroadcastGlobalVariablesCallback(0)])  # fmt: skip
    everyone = hvd_k.allreduce(flat(model), op=hvd_k.Max) - hvd_k.allreduce(flat(model),
                                                                          op=hvd_k.Min)
    assert float(np.abs(everyone).max()) == 0.0


def check_sync_batch_normalization(ctx: dict[str, Any], r: int, n: int) -> None:
    """Global-batch statistics, ranks of uneven batches: equal to BatchNormalization (and its
    gradient) on the concatenated batch."""
    keras, tf, hvd_tf = ctx["keras"], ctx["tf"], ctx["hvd_tf"]
    rng = np.random.default_rng(5)
    xs = [rng.normal(size=(k + 2, 3)).astype(np.float32) * (k + 1) for k in range(n)]
    ws = [rng.normal(size=(k + 2, 3)).astype(np.float32) for k in range(n)]
    start = sum(len(x) for x in xs[:r])

    def run(layer: Any, x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = layer(xt, training=True)
            loss = tf.reduce_sum(y * w)
        return y.numpy(), tape.gradient(loss, xt).numpy()

    ref = keras.layers.BatchNormalization(momentum=0.5)
    want_y, want_g = run(ref, np.concatenate(xs), np.concatenate(ws))
    layer = hvd_tf.SyncBatchNormalization(momentum=0.5)
    y, g = run(layer, xs[r], ws[r])
    mine = slice(start, start + len(xs[r]))
    np.testing.assert_allclose(y, want_y[mine], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(g, want_g[mine], rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(np.asarray(layer.moving_mean), np.asarray(ref.moving_mean),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    y2 = tf.function(lambda x: layer(x, training=True))(tf.constant(xs[r]))
    np.testing.assert_allclose(y2.numpy(), want_y[mine], rtol=1e-4, atol=1e-4)


def check_best_model_checkpoint(ctx: dict[str, Any], r: int, n: int) -> None:
    keras, hvd = ctx["keras"], ctx["hvd"]
    x, y = data(n)
    model = model_of(keras, seed=4)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    path = os.path.join(tempfile.mkdtemp(), "best.keras")
    callbacks = [hvd.callbacks.BestModelCheckpoint(monitor="loss", filepath=path)] if r == 0 else []
    model.fit(x[r::n], y[r::n], batch_size=BATCH, epochs=2, verbose=0, callbacks=callbacks)
    if r == 0:
        assert os.path.isfile(path)
        assert callbacks[0].save_best_only


def check_tensorflow_distributed_optimizer(ctx: dict[str, Any], r: int, n: int) -> None:
    """``hora.tensorflow.DistributedOptimizer`` (Horovod's TF signature) wraps Keras
    optimizers and refuses what is no optimizer (TensorFlow 1 ones: test_tensorflow_v1.py)."""
    keras, tf, hvd_tf = ctx["keras"], ctx["tf"], ctx["hvd_tf"]
    opt = hvd_tf.DistributedOptimizer(keras.optimizers.SGD(0.1), None, False, "", "",
                                      hvd_tf.Compression.none, False, 1, hvd_tf.Sum)  # fmt: skip
    v = tf.Variable([1.0, 1.0])
    opt.apply_gradients([(tf.constant([float(r), 1.0]), v)])
    want = 1.0 - 0.1 * np.array([sum(range(n)), n])
    np.testing.assert_allclose(v.numpy(), want, rtol=1e-6)
    with pytest.raises(ValueError, match="Keras optimizer"):
        hvd_tf.DistributedOptimizer(object())


def check_keras_level_collectives(ctx: dict[str, Any], r: int, n: int) -> None:
    """Horovod's Keras-level collectives return the result tensor when eager, and in a
    TensorFlow 1 graph the value run in the Keras session (where broadcast_global_variables
    works; eagerly it raises RuntimeError)."""
    import hora.keras as hvd_k

    tf, hvd = ctx["tf"], ctx["hvd"]
    for mod in (hvd, hvd_k):
        got = {
            "allreduce": mod.allreduce([float(r), 2.0], name=f"{mod.__name__}.ar"),
            "allgather": mod.allgather([[float(r)]]),
            "broadcast": mod.broadcast([float(r)], root_rank=n - 1),
            "reducescatter": mod.reducescatter([[1.0]] * n, op=mod.Sum),
        }
        for what, value in got.items():
            assert isinstance(value, tf.Tensor), (mod.__name__, what, type(value))
        np.testing.assert_allclose(got["allreduce"].numpy(), [(n - 1) / 2, 2.0])
        assert got["allgather"].numpy().tolist() == [[float(k)] for k in range(n)]
        assert got["broadcast"].numpy().tolist() == [n - 1.0]
        assert got["reducescatter"].numpy().tolist() == [[float(n)]]
        with pytest.raises(RuntimeError, match="eager"):
            mod.broadcast_global_variables(0)
    if ctx["legacy"]:  # tf_keras has a TensorFlow 1 session (Keras 3 has none)
        with tf.Graph().as_default():
            v = tf.compat.v1.Variable([float(r)])
            session = tf.compat.v1.keras.backend.get_session()
            session.run(v.initializer)
            out = hvd.allreduce([float(r)], name="graph.ar")
            assert isinstance(out, np.ndarray) and out.tolist() == [(n - 1) / 2], out
            hvd.broadcast_global_variables(n - 1)
            assert session.run(v).tolist() == [n - 1.0]


def check_horovod_namespace_and_arguments(ctx: dict[str, Any], r: int, n: int) -> None:
    """Horovod's names in both Keras modules, and DistributedOptimizer's argument checks."""
    import inspect

    import hora
    import hora.keras as hvd_k
    import hora.tensorflow

    keras, hvd = ctx["keras"], ctx["hvd"]
    for mod in (hvd, hvd_k):
        for name in ("ccl_built", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled",
                     "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
                     "rocm_built"):  # fmt: skip
            assert getattr(mod, name) is getattr(hora.tensorflow, name), (mod.__name__, name)
        assert mod.mpi_enabled() == hora.mpi_enabled()
        assert callable(mod.start_timeline) and callable(mod.stop_timeline)
        assert "legacy_opts" in inspect.signature(mod.load_model).parameters
        with pytest.raises(ValueError, match="Average and Sum"):
            mod.DistributedOptimizer(keras.optimizers.SGD(0.1), op=mod.Adasum)
    with pytest.raises(ValueError, match="Average and Sum"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Max)
    with pytest.raises(ValueError, match="groups"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), groups=0)
    with pytest.warns(DeprecationWarning, match="num_groups"):
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), num_groups=2)
    assert opt._hora_reducer.num_groups == 2


CHECKS = {name: fn for name, fn in dict(globals()).items() if name.startswith("check_")}


def run_all(rank: int) -> dict[str, str]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    import hora.tensorflow as hvd_tf
    import hora.tensorflow.keras as hvd

    tf.config.threading.set_intra_op_parallelism_threads(1)
    legacy = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    ctx = {"tf": tf, "keras": tf.keras, "hvd": hvd, "hvd_tf": hvd_tf, "legacy": legacy}
    hvd.init()
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn(ctx, rank, hvd.size())
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    hvd.shutdown()
    return results


def _tf_keras_installed() -> bool:
    return importlib.util.find_spec("tf_keras") is not None


@pytest.fixture(scope="module", params=["keras3", "tf_keras"])
def battery(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, str]]]:
    if request.param == "tf_keras" and not _tf_keras_installed():
        pytest.skip("tf_keras is not installed (pip install 'hora[tensorflow]')")
    env = {"TF_USE_LEGACY_KERAS": "1" if request.param == "tf_keras" else "0"}
    return request.param, run_ranks(run_all, NP, timeout=200, env=env)


@pytest.mark.timeout(260)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_keras(battery: tuple[str, list[dict[str, str]]], check: str) -> None:
    world, per_rank = battery
    for rank, results in enumerate(per_rank):
        assert results.get(check) == "ok", f"{world} rank {rank}:\n{results.get(check)}"
