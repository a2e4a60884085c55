"""Train a small CNN on MNIST with Keras ``model.fit`` and hora: ``DistributedOptimizer`` and
Horovod's callbacks (Horovod's TensorFlow 2 Keras MNIST example, run on hora).

    hora run -np 2 python examples/tensorflow2_keras_mnist.py

Works with Keras 3 (``tf.keras`` by default) and with tf_keras (``TF_USE_LEGACY_KERAS=1``).
Data as in ``tensorflow2_mnist.py``: the MNIST files in ``--data-dir``, else scikit-learn's
digits. The learning rate is scaled by the number of ranks and warmed up over the first epoch;
metrics are averaged over the ranks; rank 0 alone prints progress and saves checkpoints.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf  # noqa: E402
from tensorflow2_mnist import load_data, make_model  # noqa: E402

import hora.tensorflow.keras as hvd  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="TensorFlow 2 Keras MNIST Example on hora")
    p.add_argument("--batch-size", type=int, default=64, help="batch size per rank (64)")
    p.add_argument("--epochs", type=int, default=4, help="epochs (4)")
    p.add_argument("--steps-per-epoch", type=int, default=100,
                   help="steps per epoch in all, divided among the ranks (100)")  # fmt: skip
    p.add_argument("--lr", type=float, default=0.001, help="Adam learning rate per rank")
    p.add_argument("--warmup-epochs", type=int, default=1, help="learning-rate warm-up (1)")
    p.add_argument("--data-dir", default="./data", help="directory holding the MNIST files")
    p.add_argument("--checkpoint-dir", default=None,
                   help="rank 0 saves a checkpoint here after each epoch (default: none)")
    p.add_argument("--num-threads", type=int, default=1,
                   help="TensorFlow threads per rank (1; 0 keeps TensorFlow's default)")
    return p.parse_args(argv)


def main(args: argparse.Namespace) -> float:
    """Train and evaluate; returns the test accuracy (percent) averaged over the ranks."""
    hvd.init()
    if args.num_threads > 0:
        tf.config.threading.set_intra_op_parallelism_threads(args.num_threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.num_threads)
    tf.keras.utils.set_random_seed(42 + hvd.rank())
    (train_x, train_y), (test_x, test_y), about = load_data(args.data_dir)
    if hvd.rank() == 0:
        print(f"Dataset: {about}", flush=True)
    dataset = (
        tf.data.Dataset.from_tensor_slices((train_x, train_y))
        .shard(hvd.size(), hvd.rank())
        .repeat()
        .shuffle(10000, seed=hvd.rank())
        .batch(args.batch_size)
    )
    model = make_model()
    scaled_lr = args.lr * hvd.size()
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(scaled_lr))
    model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt,
                  metrics=["accuracy"])  # fmt: skip
    callbacks = [
        # rank 0's initial weights and optimizer state everywhere
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # metrics averaged over the ranks (before anything reads them)
        hvd.callbacks.MetricAverageCallback(),
        # lr/size ramping up to lr: large effective batches start gently
        hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs, verbose=1
        ),
        hvd.callbacks.LearningRateScheduleCallback(
            initial_lr=scaled_lr, multiplier=1.0, start_epoch=args.warmup_epochs
        ),
    ]
    if hvd.rank() == 0 and args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        path = os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(path))
    model.fit(dataset, steps_per_epoch=args.steps_per_epoch // hvd.size(),
              callbacks=callbacks, epochs=args.epochs,
              verbose=2 if hvd.rank() == 0 else 0)  # fmt: skip
    mine = slice(hvd.rank(), None, hvd.size())
    _, accuracy = model.evaluate(test_x[mine], test_y[mine], batch_size=256, verbose=0)
    accuracy = 100.0 * float(hvd.allreduce(accuracy, name="test_accuracy"))
    if hvd.rank() == 0:
        print(f"Test accuracy: {accuracy:.2f}%", flush=True)
    return accuracy


if __name__ == "__main__":
    main(parse_args())
