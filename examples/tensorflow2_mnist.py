"""Train a small CNN on MNIST with TensorFlow 2 and hora: a custom loop with
``DistributedGradientTape`` (Horovod's TensorFlow 2 MNIST example, run on hora).

    hora run -np 2 python examples/tensorflow2_mnist.py

Data: the MNIST IDX files when ``--data-dir`` holds them (``train-images-idx3-ubyte[.gz]`` and
the other three, directly or under ``MNIST/raw``); otherwise the handwritten digits that
scikit-learn ships (1,797 8x8 images, scaled to 20x20 inside a 28x28 canvas as MNIST's digits
are, the training images at 9 offsets), since nothing can be downloaded here. Rank 0 says which
one it used, prints ``Step #N\tLoss: ...`` every 10 steps and the test accuracy at the end.
The step runs inside ``tf.function``; the gradients of a step travel in one grouped allreduce.
"""

from __future__ import annotations

import argparse
import gzip
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hora.tensorflow as hvd  # noqa: E402

MNIST_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="TensorFlow 2 MNIST Example on hora")
    p.add_argument("--batch-size", type=int, default=64, help="batch size per rank (64)")
    p.add_argument("--steps", type=int, default=400,
                   help="training steps in all, divided among the ranks (400)")  # fmt: skip
    p.add_argument("--lr", type=float, default=0.001, help="Adam learning rate per rank")
    p.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression")
    p.add_argument("--data-dir", default="./data", help="directory holding the MNIST files")
    p.add_argument("--num-threads", type=int, default=1,
                   help="TensorFlow threads per rank (1; 0 keeps TensorFlow's default)")
    return p.parse_args(argv)


def _read_idx(path: str) -> np.ndarray:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _find_mnist(data_dir: str) -> dict[str, str] | None:
    for folder in (data_dir, os.path.join(data_dir, "MNIST", "raw")):
        found = {}
        for key, name in MNIST_FILES.items():
            for ext in ("", ".gz"):
                if os.path.isfile(os.path.join(folder, name + ext)):
                    found[key] = os.path.join(folder, name + ext)
                    break
        if len(found) == len(MNIST_FILES):
            return found
    return None


def load_data(data_dir: str) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray,
                                      np.ndarray], str]:  # fmt: skip
    """((train_x, train_y), (test_x, test_y), description), images NHWC float32 in [0, 1]."""
    files = _find_mnist(data_dir)
    if files is not None:
        a = {k: _read_idx(p) for k, p in files.items()}
        train = (a["train_x"][..., None] / 255.0).astype(np.float32), a["train_y"].astype(np.int64)
        test = (a["test_x"][..., None] / 255.0).astype(np.float32), a["test_y"].astype(np.int64)
        about = f"MNIST from {os.path.dirname(files['train_x'])}"
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        small = digits.images[..., None].astype(np.float32) / 16.0
        glyphs = tf.image.resize(small, (20, 20), method="bilinear").numpy()
        y = digits.target.astype(np.int64)
        order = np.random.default_rng(0).permutation(len(y))
        n_test = len(y) // 5
        test_idx, train_idx = order[:n_test], order[n_test:]

        def canvas(idx: np.ndarray, dy: int, dx: int) -> np.ndarray:
            return np.pad(glyphs[idx], ((0, 0), (dy, 8 - dy), (dx, 8 - dx), (0, 0)))

        shifts = [(dy, dx) for dy in (2, 4, 6) for dx in (2, 4, 6)]
        train = (np.concatenate([canvas(train_idx, dy, dx) for dy, dx in shifts]),
                 np.tile(y[train_idx], len(shifts)))  # fmt: skip
        test = canvas(test_idx, 4, 4), y[test_idx]
        about = (
            f"scikit-learn digits ({len(train_idx)} 8x8 images scaled to 20x20 in a 28x28 "
            f"canvas, training set at {len(shifts)} offsets; no MNIST files in "
            f"{os.path.abspath(data_dir)})"
        )
    return train, test, f"{about}: {len(train[0])} train / {len(test[0])} test images"


def make_model() -> tf.keras.Model:
    """Horovod's TensorFlow 2 MNIST network."""
    layers = tf.keras.layers
    return tf.keras.Sequential([
        tf.keras.Input((28, 28, 1)),
        layers.Conv2D(32, [3, 3], activation="relu"),
        layers.Conv2D(64, [3, 3], activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Dropout(0.25),
        layers.Flatten(),
        layers.Dense(128, activation="relu"),
        layers.Dropout(0.5),
        layers.Dense(10, activation="softmax"),
    ])  # fmt: skip


def main(args: argparse.Namespace) -> float:
    """Train, then test; returns the test accuracy (percent) averaged over the ranks."""
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
    loss_fn = tf.losses.SparseCategoricalCrossentropy()
    opt = tf.keras.optimizers.Adam(args.lr * hvd.size())  # scale the learning rate by size
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    @tf.function
    def training_step(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    steps = args.steps // hvd.size()
    for batch, (images, labels) in enumerate(dataset.take(steps)):
        loss_value = training_step(images, labels)
        if batch == 0:
            # every rank continues from rank 0's weights and optimizer state, once the
            # optimizer's variables exist (after its first step)
            hvd.broadcast_variables(model.variables, root_rank=0)
            variables = opt.variables() if callable(opt.variables) else opt.variables
            hvd.broadcast_variables(variables, root_rank=0)
        if batch % 10 == 0 and hvd.rank() == 0:
            print(f"Step #{batch}\tLoss: {float(loss_value):.6f}", flush=True)

    mine = slice(hvd.rank(), None, hvd.size())
    predictions = model.predict(test_x[mine], batch_size=256, verbose=0).argmax(axis=1)
    correct = hvd.allreduce(tf.constant(float((predictions == test_y[mine]).sum())), op=hvd.Sum)
    accuracy = 100.0 * float(correct) / len(test_y)
    if hvd.rank() == 0:
        print(f"Test accuracy: {accuracy:.2f}%", flush=True)
    return accuracy


if __name__ == "__main__":
    main(parse_args())
