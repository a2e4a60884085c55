"""What one hora collective costs in each TensorFlow mode: eager, tf.function, a TF1 session.

Run: ``hora run -np 2 python examples/tensorflow_bridge_cost.py``. Rank 0 prints, per tensor
size, the best and median of 5 rounds of 40 float32 allreduces in each mode (microseconds per
allreduce). In a TF1 session a collective is three nodes (submit, tf.data reader, check; see
docs/tensorflow.md), which this shows against the one node of tf.function and the direct call
of eager mode.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

import hora.tensorflow as hvd


def best_and_median(fn: Callable[[], Any], n: int = 40, rounds: int = 5) -> tuple[float, float]:
    for _ in range(5):
        fn()
    per_op = []
    for _ in range(rounds):
        hvd.barrier()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        per_op.append((time.perf_counter() - start) / n * 1e6)
    return min(per_op), float(np.median(per_op))


def main() -> None:
    hvd.init()
    for elems in (100, 1_000_000):
        x = tf.ones([elems])
        eager = best_and_median(lambda x=x: hvd.allreduce(x, name="eager").numpy())
        step = tf.function(lambda x=x: hvd.allreduce(x, name="function"))
        function = best_and_median(lambda step=step: step().numpy())
        with tf.Graph().as_default():
            op = hvd.allreduce(tf.ones([elems]), name="session")
            with tf.compat.v1.Session() as s:
                session = best_and_median(lambda s=s, op=op: s.run(op))
        if hvd.rank() == 0:
            cells = "  ".join(f"{k} {b:8.0f} / {m:8.0f} us" for k, (b, m) in
                              (("eager", eager), ("tf.function", function),
                               ("TF1 session", session)))  # fmt: skip
            print(f"{elems:>9} elements  {cells}  (best / median of 5 rounds)", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
