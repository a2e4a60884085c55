"""Train a convolutional network on MNIST with TensorFlow 1 graphs and hora: a
``MonitoredTrainingSession`` with ``BroadcastGlobalVariablesHook`` and ``DistributedOptimizer``
around a ``tf.compat.v1.train`` optimizer (Horovod's TensorFlow 1 MNIST example, on hora).

    hora run -np 2 python examples/tensorflow_mnist.py

Data: the same as examples/tensorflow2_mnist.py (its loader: the MNIST IDX files when
``--data-dir`` holds them, else scikit-learn's digits on a 28x28 canvas). The graph is built
with ``tf.compat.v1`` (placeholders, ``get_variable``, ``tf.nn``); the steps stop at
``--steps`` divided by the number of ranks (``StopAtStepHook``), and only rank 0 writes
checkpoints. The gradients of a step travel in one grouped allreduce inside the train op.
Rank 0 prints ``Step #N\\tLoss: ...`` every 10 steps and the test accuracy at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

import hora.tensorflow as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tensorflow2_mnist import load_data  # noqa: E402  - the TF2 example's data

v1 = tf.compat.v1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="TensorFlow 1 MNIST Example on hora")
    p.add_argument("--batch-size", type=int, default=64, help="batch size per rank (64)")
    p.add_argument("--steps", type=int, default=400,
                   help="training steps in all, divided among the ranks (400)")  # fmt: skip
    p.add_argument("--lr", type=float, default=0.001, help="Adam learning rate per rank")
    p.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                   help="apply gradient predivide factor in optimizer (default: 1.0)")
    p.add_argument("--data-dir", default="./data", help="directory holding the MNIST files")
    p.add_argument("--checkpoint-dir", default="./checkpoints",
                   help="where rank 0 writes checkpoints (./checkpoints)")  # fmt: skip
    p.add_argument("--num-threads", type=int, default=1,
                   help="TensorFlow threads per rank (1; 0 keeps TensorFlow's default)")
    return p.parse_args(argv)


def conv_model(image: tf.Tensor, label: tf.Tensor, training: tf.Tensor) -> tuple[Any, Any]:
    """Horovod's TF1 MNIST network: two 5x5 convolutions with pooling, a dense layer of 1024
    with dropout, 10 logits. Returns (predicted class, loss)."""
    init = v1.glorot_uniform_initializer()
    zeros = v1.zeros_initializer()

    def conv(x: Any, name: str, filters: int) -> Any:
        with v1.variable_scope(name):
            k = v1.get_variable("kernel", [5, 5, int(x.shape[-1]), filters], initializer=init)
            b = v1.get_variable("bias", [filters], initializer=zeros)
            h = tf.nn.relu(tf.nn.conv2d(x, k, strides=1, padding="SAME") + b)
            return tf.nn.max_pool2d(h, ksize=2, strides=2, padding="SAME")

    def dense(x: Any, name: str, units: int) -> Any:
        with v1.variable_scope(name):
            w = v1.get_variable("kernel", [int(x.shape[-1]), units], initializer=init)
            return tf.matmul(x, w) + v1.get_variable("bias", [units], initializer=zeros)

    h = conv(conv(image, "conv_layer1", 32), "conv_layer2", 64)
    h = tf.nn.relu(dense(tf.reshape(h, [-1, 7 * 7 * 64]), "fc1", 1024))
    h = tf.nn.dropout(h, rate=tf.where(training, 0.5, 0.0))
    logits = dense(h, "logits", 10)
    loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=label, logits=logits)
    )
    return tf.argmax(logits, 1), loss


def batches(x: np.ndarray, y: np.ndarray, size: int, seed: int) -> Iterator[tuple[Any, Any]]:
    """Endless shuffled batches of (images, labels)."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(x))
        for start in range(0, len(x) - size + 1, size):
            pick = order[start : start + size]
            yield x[pick], y[pick]


class TestAccuracyHook(v1.train.SessionRunHook):
    """At the end of training: every rank predicts its share of the test set and the correct
    answers are summed over the ranks (one allreduce); rank 0 prints the accuracy."""

    def __init__(self, image: Any, label: Any, predict: Any, test: tuple[Any, Any]) -> None:
        self.image, self.label, self.predict = image, label, predict
        mine = slice(hvd.rank(), None, hvd.size())
        self.x, self.y, self.total = test[0][mine], test[1][mine], len(test[1])
        self.accuracy = float("nan")

    def begin(self) -> None:
        hits = tf.reduce_sum(tf.cast(tf.equal(self.predict, self.label), tf.float32))
        self.correct = hvd.allreduce(hits, op=hvd.Sum, name="test_correct")

    def end(self, session: Any) -> None:
        correct = session.run(self.correct, {self.image: self.x, self.label: self.y})
        self.accuracy = 100.0 * float(correct) / self.total
        if hvd.rank() == 0:
            print(f"Test accuracy: {self.accuracy:.2f}%", flush=True)


def main(args: argparse.Namespace) -> float:
    """Train, then test; returns the test accuracy (percent) over the whole test set."""
    hvd.init()
    (train_x, train_y), test, about = load_data(args.data_dir)
    if hvd.rank() == 0:
        print(f"Dataset: {about}", flush=True)
    mine = slice(hvd.rank(), None, hvd.size())
    train = batches(train_x[mine], train_y[mine], args.batch_size, seed=hvd.rank())

    with tf.Graph().as_default():
        v1.set_random_seed(42 + hvd.rank())  # the ranks start apart; the hook aligns them
        with tf.name_scope("input"):
            image = v1.placeholder(tf.float32, [None, 28, 28, 1], name="image")
            label = v1.placeholder(tf.int64, [None], name="label")
            training = v1.placeholder_with_default(False, [], name="training")
        predict, loss = conv_model(image, label, training)

        # Horovod: scale the learning rate by the number of ranks, and wrap the optimizer.
        opt = v1.train.AdamOptimizer(args.lr * hvd.size())
        opt = hvd.DistributedOptimizer(
            opt, gradient_predivide_factor=args.gradient_predivide_factor
        )
        global_step = v1.train.get_or_create_global_step()
        train_op = opt.minimize(loss, global_step=global_step)

        evaluate = TestAccuracyHook(image, label, predict, test)
        hooks = [
            # Horovod: every rank starts from rank 0's variables (random or restored).
            hvd.BroadcastGlobalVariablesHook(0),
            # Horovod: divide the number of steps by the number of ranks.
            v1.train.StopAtStepHook(last_step=args.steps // hvd.size()),
            evaluate,
        ]
        config = v1.ConfigProto()
        if args.num_threads > 0:
            config.intra_op_parallelism_threads = args.num_threads
            config.inter_op_parallelism_threads = args.num_threads + 1
        # Horovod: only rank 0 writes checkpoints, so that no two ranks write the same files.
        checkpoint_dir = args.checkpoint_dir if hvd.rank() == 0 else None
        with v1.train.MonitoredTrainingSession(
            checkpoint_dir=checkpoint_dir, hooks=hooks, config=config
        ) as mon_sess:
            step = 0
            while not mon_sess.should_stop():
                x, y = next(train)
                _, loss_value = mon_sess.run([train_op, loss], {image: x, label: y, training: True})
                if step % 10 == 0 and hvd.rank() == 0:
                    print(f"Step #{step}\tLoss: {loss_value:.6f}", flush=True)
                step += 1
    return evaluate.accuracy


if __name__ == "__main__":
    main(parse_args())
