"""The examples' pieces that need no ranks: model sizes, MNIST IDX loading, the digits fallback."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("model", "params"),
    [("resnet50", 25_557_032), ("cnn", 4_246_506), ("mlp", 3_213_002), ("lstm", 2_204_170)],
)
def test_benchmark_models_have_their_stated_sizes_and_run(model, params):
    bench = load("pytorch_synthetic_benchmark")
    build, make_input, classes = bench.MODELS[model]
    net = build()
    assert sum(p.numel() for p in net.parameters()) == params
    assert net(make_input(2)).shape == (2, classes)


def test_benchmark_flags_match_horovods():
    args = load("pytorch_synthetic_benchmark").parse_args([])
    assert (args.model, args.batch_size, args.num_warmup_batches) == ("resnet50", 32, 10)
    assert (args.num_batches_per_iter, args.num_iters, args.ddp) == (10, 10, False)


def test_benchmark_ddp_runs_on_nccl_on_gpus_and_gloo_on_cpus():
    bench = load("pytorch_synthetic_benchmark")
    assert bench.parse_args(["--ddp"]).ddp_backend == "auto"
    assert bench.ddp_backend("auto", use_cuda=True) == "nccl"  # the fair peer on GPUs
    assert bench.ddp_backend("auto", use_cuda=False) == "gloo"
    assert bench.ddp_backend("gloo", use_cuda=True) == "gloo"
    with pytest.raises(SystemExit, match="needs the model on GPUs"):
        bench.ddp_backend("nccl", use_cuda=False)


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_mnist_idx_files_are_used_when_present(tmp_path):
    mnist = load("pytorch_mnist")
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    images = np.arange(5 * 28 * 28).reshape(5, 28, 28) % 256
    write_idx(raw / "train-images-idx3-ubyte.gz", images)
    write_idx(raw / "train-labels-idx1-ubyte.gz", np.arange(5))
    write_idx(raw / "t10k-images-idx3-ubyte.gz", images[:2])
    write_idx(raw / "t10k-labels-idx1-ubyte.gz", np.array([7, 8]))
    train, test, about = mnist.load_data(str(tmp_path))
    assert about.startswith("MNIST") and len(train) == 5 and len(test) == 2
    x, y = train[3]
    assert x.shape == (1, 28, 28) and y.item() == 3
    expected = (images[3, 0, 1] / 255.0 - 0.1307) / 0.3081
    assert x[0, 0, 1].item() == pytest.approx(expected, rel=1e-5)
    assert test[1][1].item() == 8


def test_digits_fallback_when_no_files(tmp_path):
    mnist = load("pytorch_mnist")
    train, test, about = mnist.load_data(str(tmp_path))
    assert "scikit-learn digits" in about
    assert len(test) == 1797 // 5 and len(train) == 9 * (1797 - 1797 // 5)
    assert train[0][0].shape == (1, 28, 28)
    assert set(torch.stack([test[i][1] for i in range(len(test))]).tolist()) == set(range(10))
    net = mnist.Net()
    assert net(torch.stack([train[i][0] for i in range(4)])).shape == (4, 10)


def test_mnist_flags_match_horovods():
    args = load("pytorch_mnist").parse_args([])
    assert (args.batch_size, args.test_batch_size, args.epochs) == (64, 1000, 10)
    assert (args.lr, args.momentum, args.seed, args.log_interval) == (0.01, 0.5, 42, 10)
    assert (args.fp16_allreduce, args.use_adasum, args.gradient_predivide_factor) == (
        False,
        False,
        1.0,
    )
