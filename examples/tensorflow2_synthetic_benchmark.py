"""Training throughput on synthetic data: Horovod's TensorFlow 2 synthetic benchmark, on hora.

    hora run -np 2 python examples/tensorflow2_synthetic_benchmark.py --model mlp
    hora run -np 2 python examples/tensorflow2_synthetic_benchmark.py --model mlp --mwms

Models (``--model``): ``resnet50`` and ``mobilenetv2`` (Keras applications with
``weights=None``, 3x224x224 images), ``cnn`` (a small VGG-style CNN, 4.2M parameters, 3x32x32
images: compute-heavy) and ``mlp`` (3072-1024-64-10, 3.2M parameters: communication-heavy).
The train step runs in ``tf.function`` with ``DistributedGradientTape``. ``--mwms`` runs the
same step under TensorFlow's own ``tf.distribute.MultiWorkerMirroredStrategy`` instead, for
comparison in the same job: hora then only gathers each worker's port for ``TF_CONFIG`` and is
shut down before timing starts. Rank 0 prints Horovod's lines (``Iter #i: X img/sec per CPU``,
``Img/sec per CPU: m +-c``, ``Total img/sec on N CPU(s): ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import timeit

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hora.tensorflow as hvd  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="TensorFlow Synthetic Benchmark on hora",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--fp16-allreduce", action="store_true", default=False,
                   help="use fp16 compression during allreduce")  # fmt: skip
    p.add_argument("--model", default="ResNet50",
                   help="model: ResNet50, MobileNetV2, cnn or mlp (case-insensitive)")
    p.add_argument("--batch-size", type=int, default=32, help="input batch size")
    p.add_argument("--num-warmup-batches", type=int, default=10,
                   help="number of warm-up batches that don't count towards benchmark")
    p.add_argument("--num-batches-per-iter", type=int, default=10,
                   help="number of batches per benchmark iteration")
    p.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    p.add_argument("--mwms", action="store_true", default=False,
                   help="use tf.distribute.MultiWorkerMirroredStrategy instead of hora")
    p.add_argument("--num-groups", type=int, default=0,
                   help="reduce the gradients in this many grouped allreduces (0: one), so the "
                        "first can start while the backward pass computes the rest")
    p.add_argument("--num-threads", type=int, default=1,
                   help="TensorFlow threads per rank (0 keeps TensorFlow's default)")
    return p.parse_args(argv)


def small_cnn() -> tf.keras.Model:
    """Four 3x3 conv layers and two dense ones over 32x32 images (4.2M parameters)."""
    L = tf.keras.layers
    return tf.keras.Sequential([
        tf.keras.Input((32, 32, 3)),
        L.Conv2D(64, 3, padding="same", activation="relu"),
        L.Conv2D(128, 3, padding="same", activation="relu"), L.MaxPooling2D(),
        L.Conv2D(256, 3, padding="same", activation="relu"), L.MaxPooling2D(),
        L.Conv2D(256, 3, padding="same", activation="relu"), L.MaxPooling2D(),
        L.Flatten(), L.Dense(800, activation="relu"), L.Dense(10),
    ])  # fmt: skip


def mlp() -> tf.keras.Model:
    """A 3072-1024-64-10 perceptron over flattened 32x32 images (3.2M parameters)."""
    L = tf.keras.layers
    return tf.keras.Sequential([
        tf.keras.Input((32, 32, 3)), L.Flatten(), L.Dense(1024, activation="relu"),
        L.Dense(64, activation="relu"), L.Dense(10),
    ])  # fmt: skip


MODELS = {
    "resnet50": (lambda: tf.keras.applications.ResNet50(weights=None), (224, 224, 3), 1000),
    "mobilenetv2": (lambda: tf.keras.applications.MobileNetV2(weights=None), (224, 224, 3),
                    1000),
    "cnn": (small_cnn, (32, 32, 3), 10),
    "mlp": (mlp, (32, 32, 3), 10),
}


def init_mwms() -> tuple[int, int, tf.distribute.Strategy]:
    """MultiWorkerMirroredStrategy over this job's ranks: each picks a free port, hora gathers
    them into TF_CONFIG, then hora is shut down before any timing."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ports = hvd.allgather_object(port, name="mwms_ports")
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": rank},
    })  # fmt: skip
    hvd.shutdown()
    return rank, size, tf.distribute.MultiWorkerMirroredStrategy()


def main(args: argparse.Namespace) -> None:
    if args.num_threads > 0:
        tf.config.threading.set_intra_op_parallelism_threads(args.num_threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.num_threads)
    key = args.model.lower()
    if key not in MODELS:
        raise SystemExit(f"unknown --model {args.model}: choose from {', '.join(MODELS)}")
    build, shape, classes = MODELS[key]
    if args.mwms:
        rank, size, strategy = init_mwms()
    else:
        hvd.init()
        rank, size, strategy = hvd.rank(), hvd.size(), None
    tf.keras.utils.set_random_seed(0)
    data = tf.random.uniform([args.batch_size, *shape])
    target = tf.random.uniform([args.batch_size], minval=0, maxval=classes, dtype=tf.int64)
    loss_of = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=key in ("cnn", "mlp"), reduction="none"
    )

    if strategy is not None:
        with strategy.scope():
            model = build()
            opt = tf.keras.optimizers.SGD(0.01 * size)

        def replica_step(x: tf.Tensor, y: tf.Tensor) -> None:
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_of(y, model(x, training=True)),
                                                  global_batch_size=args.batch_size * size)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        step = tf.function(lambda: strategy.run(replica_step, args=(data, target)))
    else:
        model = build()
        opt = tf.keras.optimizers.SGD(0.01 * size)
        compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

        @tf.function
        def step() -> None:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_of(target, model(data, training=True)))
            tape = hvd.DistributedGradientTape(tape, compression=compression,
                                               num_groups=args.num_groups)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of CPUs: {size}")
    log(f"Communication: {'tf.distribute MultiWorkerMirroredStrategy' if args.mwms else 'hora'}")
    step()
    if strategy is None:  # every rank continues from rank 0's weights and optimizer state
        hvd.broadcast_variables(list(model.variables) + list(opt.variables), root_rank=0)
    log("Running warmup...")
    timeit.timeit(step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for i in range(args.num_iters):
        elapsed = timeit.timeit(step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / elapsed
        log(f"Iter #{i}: {img_sec:.1f} img/sec per CPU")
        img_secs.append(img_sec)
    mean, conf = float(np.mean(img_secs)), 1.96 * float(np.std(img_secs))
    log(f"Img/sec per CPU: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {size} CPU(s): {size * mean:.1f} +-{size * conf:.1f}")
    if strategy is None:
        hvd.shutdown()


if __name__ == "__main__":
    main(parse_args())
