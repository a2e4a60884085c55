"""hora.lab allreduce: option parsing, sizes, iteration plan, availability, ResNet-50 shapes."""

from __future__ import annotations

import argparse
import math
import mmap
import os

import numpy as np
import pytest

from hora.lab import BENCHMARKS, configure, procs
from hora.lab import allreduce as bench
from hora.lab.workers import resnet50_shapes, small_pages


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("4096", 4096),
        ("4K", 4096),
        ("4k", 4096),
        ("64KiB", 65536),
        ("16M", 16 << 20),
        ("16MB", 16 << 20),
        (" 256M ", 256 << 20),
        ("1G", 1 << 30),
    ],
)
def test_parse_size(text: str, nbytes: int) -> None:
    assert bench.parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "K", "4T", "-4K", "4.5K", "abc", "0", "6"])
def test_parse_size_rejects_bad_input(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        bench.parse_size(text)


def test_parse_sizes_sorts_and_dedups() -> None:
    assert bench.parse_sizes("1M,4K,4096,,64K") == [4096, 65536, 1 << 20]
    with pytest.raises(ValueError, match="names no size"):
        bench.parse_sizes(" , ")


def test_default_sizes_are_powers_of_four_from_4k_to_256m() -> None:
    assert bench.DEFAULT_SIZES == [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]


def test_parse_backends() -> None:
    assert bench.parse_backends("MPI, gloo,mpi") == ["mpi", "gloo"]
    with pytest.raises(ValueError, match="choose from hora, hora-tcp, hora-shm-staged, gloo, mpi"):
        bench.parse_backends("hora,nccl")


def test_iterations_shrink_with_size_within_bounds() -> None:
    iters = [bench.default_iters(s) for s in bench.DEFAULT_SIZES]
    assert iters == sorted(iters, reverse=True)
    assert iters[0] == 1000 and iters[-1] == 16
    assert bench.default_iters(1 << 30) == 10
    assert bench.warmup_iters(1000) == 100 and bench.warmup_iters(10) == 2


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    return parser.parse_args(list(argv))


def test_options_become_a_config() -> None:
    cfg = bench.config_from_args(
        _args(
            "--np",
            "3",
            "--sizes",
            "4K,16M",
            "--iters",
            "7",
            "--backends",
            "gloo",
            "--engine-cost",
            "--csv",
            "a.csv",
            "--json",
            "a.json",
            "--plot",
            "a.png",
        )
    )
    assert (cfg.np, cfg.sizes, cfg.iters, cfg.backends) == (3, [4096, 16 << 20], 7, ["gloo"])
    assert (cfg.engine_cost, cfg.csv, cfg.json, cfg.plot) == (True, "a.csv", "a.json", "a.png")
    default = bench.config_from_args(_args())
    assert default.np == 2 and default.sizes == bench.DEFAULT_SIZES
    assert default.backends == ["hora", "gloo", "mpi"] and default.iters is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--np", "0"], "--np must be at least 1"),
        (["--np", "1", "--engine-cost"], "--np 2 or more"),
        (["--iters", "0"], "--iters must be at least 1"),
        (["--timeout", "0"], "--timeout must be positive"),
        (["--repeat", "0"], "--repeat must be at least 1"),
        (["--sizes", "3"], "multiple of 4 bytes"),
    ],
)
def test_bad_options_name_the_problem(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bench.config_from_args(_args(*argv))


def test_command_returns_2_on_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.command(_args("--sizes", "banana")) == 2
    assert "banana" in capsys.readouterr().err


def test_plan_has_one_entry_per_size() -> None:
    cfg = bench.AllreduceBenchConfig(sizes=[4096, 1 << 20], engine_cost=True)
    plan = cfg.plan("/tmp/out.jsonl", "hora")
    assert plan["sizes"] == [4096, 1 << 20]
    assert plan["iters"] == [1000, 1000] and plan["warmup"] == [100, 100]
    assert plan["out"] == "/tmp/out.jsonl" and plan["engine_cost"] is True
    assert plan["label"] == "hora"
    fixed = bench.AllreduceBenchConfig(sizes=[4096], iters=5).plan("x", "hora-tcp")
    assert fixed["iters"] == [5] and fixed["resnet_iters"] == 5


def test_unavailable_backends_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench.shutil, "which", lambda _name: None)
    assert bench.unavailable("mpi") == "mpirun is not on PATH"
    real = bench.importlib.util.find_spec
    monkeypatch.setattr(
        bench.importlib.util, "find_spec", lambda n: None if n in ("torch", "mpi4py") else real(n)
    )
    assert bench.unavailable("gloo") == "torch is not installed"
    assert bench.unavailable("mpi") == "mpi4py is not installed"
    assert bench.unavailable("hora") is None


def test_bench_parser_has_every_benchmark() -> None:
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["allreduce", "--sizes", "4K", "--backends", "gloo"])
    assert args.benchmark == "allreduce" and "allreduce" in BENCHMARKS
    assert bench.config_from_args(args).sizes == [4096]


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmarks_help_ends_with_examples_of_itself(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser(prog="hora bench")
    configure(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([name, "--help"])
    examples = capsys.readouterr().out.split("\nexamples:\n")[1]
    assert f"hora bench {name}" in examples.splitlines()[0]


def test_resnet50_shapes_match_the_real_network() -> None:
    shapes = resnet50_shapes()
    assert len(shapes) == 161
    assert sum(math.prod(s) for s in shapes) == 25_557_032
    assert shapes[0] == (64, 3, 7, 7) and shapes[-2:] == [(1000, 2048), (1000,)]
    assert sum(1 for s in shapes if len(s) == 4) == 53  # 1 stem + 48 block + 4 projection convs


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_small_pages_gives_zeroed_writable_arrays_that_refuse_huge_pages() -> None:
    x = small_pages((3, 1 << 20))  # 12 MiB: NumPy itself would ask for huge pages
    assert x.shape == (3, 1 << 20) and x.dtype == np.float32
    assert not x.any()
    x[...] = 2.0
    assert float(x.sum()) == 2.0 * x.size
    if os.path.exists("/proc/self/smaps") and hasattr(mmap, "MADV_NOHUGEPAGE"):
        assert "nh" in _vm_flags(x.ctypes.data)  # the kernel's mark of MADV_NOHUGEPAGE
    assert small_pages((0,)).size == 0


def test_worker_env_drops_identity_and_keeps_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "HORA_RANK",
        "HOROVOD_SIZE",
        "HORA_SECRET_KEY",
        "RANK",
        "MASTER_PORT",
        "OMPI_COMM_WORLD_RANK",
    ):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HORA_CPU_BIND", "none")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
    env = procs.base_env()
    assert not {
        "HORA_RANK",
        "HOROVOD_SIZE",
        "HORA_SECRET_KEY",
        "RANK",
        "MASTER_PORT",
        "OMPI_COMM_WORLD_RANK",
    } & set(env)
    assert env["HORA_CPU_BIND"] == "none" and env["HOROVOD_FUSION_THRESHOLD"] == "0"
    assert env["OMP_NUM_THREADS"] == "1"
