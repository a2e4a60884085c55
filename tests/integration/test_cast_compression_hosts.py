"""fp16 and bf16 cast only where bytes cross hosts (``hora.frameworks.ops.compression_for``).

Real ranks, torch and TensorFlow. A job whose ranks all share one host reduces uncompressed:
``hvd.allreduce(x, compression=fp16)``, a grouped allreduce and ``DistributedOptimizer``'s
gradients come out with the bits of the uncompressed reduction. A job the launcher spreads over
two hosts (here ``HORA_LOCAL_SIZE=1`` at np=2), or one host with
``HORA_COMPRESS_ON_ONE_HOST=1``, casts: the bits are those of the reduction of the 16-bit casts.
The inputs are chosen so that the two differ (0.1 is not a 16-bit float).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from harness import run_ranks


def _torch_bits(rank: int) -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    hvd.init()
    x = torch.arange(64, dtype=torch.float32) * 0.013 + 0.1 * (rank + 1)
    plain = hvd.allreduce(x, op=hvd.Sum, name="plain")
    cast = hvd.allreduce(x.to(torch.float16), op=hvd.Sum, name="cast").float()
    wide = x.double()
    out = {
        "differ": not torch.equal(plain, cast),
        "op": _which(hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16, name="op"),
                     plain, cast),
        "grouped": _which(hvd.grouped_allreduce([x], op=hvd.Sum, name="grp",
                                                compression=hvd.Compression.fp16)[0],
                          plain, cast),
        "bf16": _which(hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.bf16,
                                     name="bf"), plain,
                       hvd.allreduce(x.to(torch.bfloat16), op=hvd.Sum, name="bfc").float()),
        # a float64 tensor casts too; an int tensor never does
        "f64": _which(hvd.allreduce(wide, op=hvd.Sum, compression=hvd.Compression.fp16,
                                    name="f64"), hvd.allreduce(wide, op=hvd.Sum, name="f64p"),
                      hvd.allreduce(wide.half(), op=hvd.Sum, name="f64c").double()),
    }
    # DistributedOptimizer: the same model on every rank, different data
    model = torch.nn.Linear(16, 4, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.arange(64, dtype=torch.float32).reshape(4, 16) * 0.01)
    data = torch.full((2, 16), 0.1 * (rank + 1)) + torch.arange(16) * 0.007
    model(data).square().sum().backward()
    local = model.weight.grad.clone()
    model.weight.grad = None
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16)
    model(data).square().sum().backward()
    opt.synchronize()
    out["optimizer"] = _which(model.weight.grad, hvd.allreduce(local, name="g.plain"),
                              hvd.allreduce(local.half(), name="g.cast").float())
    hvd.shutdown()
    return out


def _which(got: Any, plain: Any, cast: Any) -> str:
    """'plain' or 'cast': whose bits ``got`` (a CPU tensor or an array) has (both if they
    agree, else neither)."""
    import numpy as np

    same = (np.array_equal(np.asarray(got), np.asarray(plain)),
            np.array_equal(np.asarray(got), np.asarray(cast)))  # fmt: skip
    names = {(True, False): "plain", (False, True): "cast", (True, True): "both"}
    return names.get(same, "neither")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("local_size", "env", "want"),
    [(None, {}, "plain"), (1, {}, "cast"), (None, {"HORA_COMPRESS_ON_ONE_HOST": "1"}, "cast")],
    ids=["one-host", "two-hosts", "one-host-forced"],
)
def test_torch_casts_only_across_hosts(local_size: int | None, env: dict[str, str],
                                       want: str) -> None:  # fmt: skip
    for out in run_ranks(_torch_bits, 2, timeout=100, env=env, local_size=local_size):
        assert out.pop("differ"), "the inputs must tell the casts from the plain sums"
        assert out == dict.fromkeys(out, want), out


def _tf_bits(rank: int) -> dict[str, Any]:
    import numpy as np
    import tensorflow as tf

    import hora.tensorflow as hvd

    hvd.init()
    x = tf.constant(np.arange(64, dtype=np.float32) * 0.013 + 0.1 * (rank + 1))
    plain = hvd.allreduce(x, op=hvd.Sum, name="plain").numpy()
    cast = tf.cast(hvd.allreduce(tf.cast(x, tf.float16), op=hvd.Sum, name="cast"),
                   tf.float32).numpy()
    got = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16, name="op").numpy()
    with tf.GradientTape() as tape:
        v = tf.Variable(x)
        loss = tf.reduce_sum(v * v)
    tape = hvd.DistributedGradientTape(tape, op=hvd.Sum, compression=hvd.Compression.fp16)
    grad = tape.gradient(loss, v).numpy()
    local = 2 * x
    gplain = hvd.allreduce(local, op=hvd.Sum, name="g.plain").numpy()
    gcast = tf.cast(hvd.allreduce(tf.cast(local, tf.float16), op=hvd.Sum, name="g.cast"),
                    tf.float32).numpy()
    hvd.shutdown()
    return {"differ": not np.array_equal(plain, cast), "op": _which(got, plain, cast),
            "tape": _which(grad, gplain, gcast)}


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow")
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("local_size", "want"), [(None, "plain"), (1, "cast")], ids=["one-host", "two-hosts"]
)
def test_tensorflow_casts_only_across_hosts(local_size: int | None, want: str) -> None:
    for out in run_ranks(_tf_bits, 2, timeout=160, local_size=local_size):
        assert out.pop("differ"), "the inputs must tell the casts from the plain sums"
        assert out == dict.fromkeys(out, want), out
