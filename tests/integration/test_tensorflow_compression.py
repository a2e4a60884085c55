"""PowerSGD and top-k through TensorFlow at np=2: DistributedGradientTape's gradients against the
NumPy reference (eager and in a tf.function), the Keras DistributedOptimizer training to
the same weights on every rank, and the compressors' state through the elastic states'
commit, restore and sync."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

from harness import run_checks, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None,
    reason="tensorflow is not installed (pip install 'hora[tensorflow]')",
)


def _grads(tf: Any, hvd: Any, r: int, compression: Any, graph: bool) -> tuple[Any, Any]:
    """This rank's own gradients and the tape's reduced ones, for two steps."""
    import numpy as np

    tf.keras.utils.set_random_seed(0)
    layer = tf.keras.layers.Dense(16)
    layer.build((None, 8))
    x = tf.constant(np.random.default_rng(r).normal(size=(6, 8)).astype(np.float32))

    def step() -> tuple[Any, Any]:
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_sum(layer(x) ** 2)
        own = tape.gradient(loss, layer.trainable_variables)  # this rank's, not reduced
        reduced = hvd.DistributedGradientTape(tape, compression=compression)
        return own, reduced.gradient(loss, layer.trainable_variables)

    run = tf.function(step) if graph else step
    return [run() for _ in range(2)]


def check_tape_matches_reference(ctx: dict[str, Any], r: int, n: int) -> None:
    import numpy as np

    from compression_reference import powersgd_step

    tf, hvd = ctx["tf"], ctx["hvd_tf"]
    for graph in (False, True):
        steps = _grads(tf, hvd, r, hvd.Compression.powersgd(rank=1, start_iter=0), graph)
        err, q = [np.zeros((8, 16), np.float32)] * n, None
        for own, reduced in steps:
            kernels = hvd.allgather_object(own[0].numpy(), name=f"test.kernel.{graph}")
            biases = hvd.allgather_object(own[1].numpy(), name=f"test.bias.{graph}")
            want, err, q = powersgd_step(kernels, err, q, 1, "0.kernel")
            got = reduced[0].numpy()
            assert np.allclose(got, want, rtol=1e-4, atol=1e-4), (graph, got - want)
            assert np.allclose(reduced[1].numpy(), np.mean(biases, axis=0), atol=1e-5)


def _keras_job(ctx: dict[str, Any], r: int, compression: Any, lr: float, hidden: int,
               rows: int, **dense: Any) -> tuple[Any, Any, Any, Any]:  # fmt: skip
    """A two-layer Keras model compiled with the Keras DistributedOptimizer (SGD) and
    ``compression``, and this rank's data: ``rows`` x 8 inputs and their row sums."""
    import numpy as np

    tf, hvd = ctx["tf"], ctx["hvd"]
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(hidden, **dense),
                                 tf.keras.layers.Dense(1)])  # fmt: skip
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(lr), compression=compression)
    model.compile(optimizer=opt, loss="mse")
    x = np.random.default_rng(r).normal(size=(rows, 8)).astype(np.float32)
    return model, opt, x, x.sum(axis=1, keepdims=True)


def check_keras_optimizer_trains_alike(ctx: dict[str, Any], r: int, n: int) -> None:
    import numpy as np

    hvd = ctx["hvd"]
    model, _, x, y = _keras_job(ctx, r, hvd.Compression.topk(ratio=0.1, min_elements=64), 0.05,
                                32, 64, activation="tanh")  # fmt: skip
    first = model.evaluate(x, y, verbose=0)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0)
    assert model.evaluate(x, y, verbose=0) < first
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    everyone = hvd.allgather_object(weights, name="test.weights")
    np.testing.assert_array_equal(everyone[0], everyone[1])


def check_elastic_states_keep_the_compression(ctx: dict[str, Any], r: int, n: int) -> None:
    """The Keras optimizer's PowerSGD state, and a tape's compressor given as a keyword, go
    through commit, restore and sync with the variables: restore brings back the committed
    factors, error memory and step; sync gives every rank rank 0's factors and step and
    leaves each rank its own error memory."""
    import numpy as np

    from compression_reference import assert_powersgd_state_restored

    tf, hvd = ctx["tf"], ctx["hvd"]
    model, opt, x, y = _keras_job(ctx, r, hvd.Compression.powersgd(rank=1, start_iter=1), 0.01,
                                  16, 32)  # fmt: skip
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # 4 steps
    comp = opt._hora_reducer.compression
    state = hvd.elastic.KerasState(model, epoch=0)
    state.commit()
    committed = comp.state_dict()
    assert committed["step"] == 4 and committed["shared"] and committed["local"], committed
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert comp.step == 8
    state.restore()
    now = comp.state_dict()
    assert now["step"] == 4
    assert_powersgd_state_restored(now, committed)
    # a new round: rank 1's factors become rank 0's, its own error memory stays
    if r == 1:
        for slot in comp.shared.values():
            slot["q"] = slot["q"] + 1.0
        comp.step = 99
    state.sync()
    name = sorted(comp.shared)[0]
    qs = hvd.allgather_object(comp.shared[name]["q"], name="test.keras.q")
    np.testing.assert_array_equal(qs[0], qs[1])
    assert comp.step == 4
    errors = hvd.allgather_object(comp.local[name]["error"], name="test.keras.errors")
    assert not np.array_equal(errors[0], errors[1])  # each rank's own memory
    np.testing.assert_array_equal(comp.local[name]["error"], now["local"][name]["error"])

    # a tape's compressor given as a keyword: held as it is, not copied as a plain value
    tape_comp = ctx["hvd_tf"].Compression.topk(ratio=0.25, min_elements=8)
    layer = tf.keras.layers.Dense(4)
    layer.build((None, 8))
    tstate = ctx["hvd_tf"].elastic.TensorFlowState(layer.variables, compression=tape_comp,
                                                   epoch=3)  # fmt: skip
    assert tstate.compression is tape_comp and tstate.epoch == 3
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(x[:4]) ** 2)
    grads = ctx["hvd_tf"].DistributedGradientTape(tape, compression=tape_comp).gradient(
        loss, layer.trainable_variables)
    assert len(grads) == 2 and tape_comp.step == 1
    tstate.commit()
    kept = tape_comp.state_dict()
    tape_comp.step, tape_comp.local = 7, {}
    tstate.restore()
    assert tape_comp.step == 1 and tape_comp.local.keys() == kept["local"].keys()


CHECKS = {f.__name__: f for f in (check_tape_matches_reference,
                                  check_keras_optimizer_trains_alike,
                                  check_elastic_states_keep_the_compression)}  # fmt: skip


def run_all(rank: int) -> dict[str, str]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    import hora.tensorflow as hvd_tf
    import hora.tensorflow.keras as hvd

    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    try:
        return run_checks(CHECKS, {"tf": tf, "hvd": hvd, "hvd_tf": hvd_tf}, hvd.rank(), hvd.size())
    finally:
        hvd.shutdown()


@pytest.fixture(scope="module")
def battery() -> list[dict[str, str]]:
    return run_ranks(run_all, 2, timeout=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_tensorflow_compression(battery: list[dict[str, str]], check: str) -> None:
    for rank, results in enumerate(battery):
        assert results.get(check) == "ok", f"rank {rank}:\n{results.get(check)}"
