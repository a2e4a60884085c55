"""hora bench allreduce --device cuda: options, backends, worker environments, the report at
one rank, the no-GPU path for real; and the short GPU run, which skips without a GPU."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hora.lab import allreduce as bench
from hora.lab import gpu, gpu_workers, report

HAS_GPU = torch.cuda.is_available()
NEEDS_GPU = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (torch sees none)")
NO_GPU_ONLY = pytest.mark.skipif(HAS_GPU, reason="checks the answer of machines without a GPU")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    return parser.parse_args(list(argv))


def test_cpu_stays_the_default() -> None:
    cfg = bench.config_from_args(_args())
    assert (cfg.device, cfg.np, cfg.backends) == ("cpu", 2, ["hora", "gloo", "mpi"])
    assert cfg.plan("/o", "hora")["device"] == "cpu"
    assert bench.config_from_args(_args("--np", "1")).np == 1  # a world of one's own cost
    with pytest.raises(ValueError, match="--np must be at least 1"):
        bench.config_from_args(_args("--np", "0"))
    with pytest.raises(ValueError, match="choose from hora, hora-tcp, hora-shm-staged, gloo, mpi$"):
        bench.config_from_args(_args("--backends", "nccl"))


@pytest.mark.parametrize(("gpus", "np_"), [(0, 1), (1, 1), (4, 4)])
def test_device_cuda_runs_the_cuda_backends_one_rank_per_gpu(
    monkeypatch: pytest.MonkeyPatch, gpus: int, np_: int
) -> None:
    monkeypatch.setattr(gpu, "device_count", lambda: gpus)
    cfg = bench.config_from_args(_args("--device", "cuda", "--sizes", "4K"))
    assert (cfg.device, cfg.np, cfg.sizes) == ("cuda", np_, [4096])
    assert cfg.backends == ["hora-nccl", "hora-staged", "nccl"] == list(gpu.CUDA_BACKENDS)
    assert cfg.plan("/o", "nccl")["device"] == "cuda"
    one = bench.config_from_args(_args("--device", "cuda", "--np", "1", "--backends", "NCCL"))
    assert (one.np, one.backends) == (1, ["nccl"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backends", "gloo"], "choose from hora-nccl, hora-staged, nccl with --device cuda"),
        (["--engine-cost"], "--engine-cost times hora's engine on host buffers"),
        (["--np", "0"], "--np must be at least 1"),
    ],
)
def test_bad_cuda_options_are_named(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bench.config_from_args(_args("--device", "cuda", *argv))


def test_unknown_device_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _args("--device", "tpu")
    assert "invalid choice: 'tpu'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--device 'tpu'"):
        bench.AllreduceBenchConfig(device="tpu")
    with pytest.raises(ValueError, match="--device cuda runs hora-nccl, hora-staged, nccl"):
        bench.AllreduceBenchConfig(device="cuda", np=1, backends=["hora"])


def test_help_teaches_the_cuda_bench() -> None:
    from hora.lab import configure

    parser = argparse.ArgumentParser(prog="hora bench")
    configure(parser)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices["allreduce"].format_help()
    assert "hora bench allreduce --device cuda" in text and "--device {cpu,cuda}" in text


def test_backend_choice_of_the_caller_does_not_reach_cuda_variants() -> None:
    env = {
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HORA_CONTROLLER": "mpi",
        "HOROVOD_GPU_ALLREDUCE": "MPI",
        "HORA_GPU_OPERATIONS": "mpi",
        "HOROVOD_FUSION_THRESHOLD": "0",
    }
    assert gpu.without_backend_choice(env) == {"HOROVOD_FUSION_THRESHOLD": "0"}


def test_cuda_workers_get_their_backend_and_identity(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """_spawn's environments, captured instead of starting processes."""
    started: list[tuple[list[str], dict[str, str]]] = []

    def capture(cmd: list[str], env: dict[str, str], log: str) -> Any:
        started.append((cmd, env))

    monkeypatch.setattr(bench, "start", capture)
    monkeypatch.setenv("HOROVOD_CPU_OPERATIONS", "gloo")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
    for backend in gpu.CUDA_BACKENDS:
        extra = bench.HORA_VARIANTS.get(backend, {})
        bench._spawn(backend, 2, "/p.json", str(tmp_path), extra)
    nccl_hora, staged, nccl = (started[i * 2 : i * 2 + 2] for i in range(3))
    for cmd, env in nccl_hora:
        assert env["HOROVOD_GPU_OPERATIONS"] == "NCCL" and "HOROVOD_CPU_OPERATIONS" not in env
        assert cmd[-2:] == ["hora-nccl", "/p.json"] and env["HOROVOD_FUSION_THRESHOLD"] == "0"
    assert [e["HORA_LOCAL_RANK"] for _, e in nccl_hora] == ["0", "1"]
    for _, env in staged:
        assert env["HOROVOD_CPU_OPERATIONS"] == "native"
        assert "HOROVOD_GPU_OPERATIONS" not in env
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for _, e in nccl] == [
        ("0", "0", "2"),
        ("1", "1", "2"),
    ]
    assert nccl[0][1]["MASTER_ADDR"] == "127.0.0.1"
    # the CUDA workers run from their own module, which has a runner for each
    assert all(cmd[2] == "hora.lab.gpu_workers" for cmd, _ in nccl_hora + staged + nccl)
    assert set(gpu_workers.RUNNERS) == set(gpu.CUDA_BACKENDS)


def test_short_of_devices_says_how_many(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "device_count", lambda: 1)
    assert gpu.short_of_devices(1) is None
    reason = gpu.short_of_devices(2)
    assert reason is not None and "needs 2 GPUs" in reason and "give --np 1" in reason
    assert gpu.short_of_devices(2, "hora-nccl") == reason
    assert gpu.short_of_devices(2, "hora-staged") is None  # two ranks share the one GPU
    monkeypatch.setattr(gpu, "device_count", lambda: 0)
    assert gpu.short_of_devices(2, "hora-staged") is not None
    with pytest.raises(ValueError, match="not a CUDA backend"):
        gpu.unavailable("gloo")


@NO_GPU_ONLY
def test_without_a_gpu_every_cuda_backend_says_why() -> None:
    for backend in gpu.CUDA_BACKENDS:
        reason = bench.unavailable(backend)
        assert reason is not None and reason.startswith(gpu.NO_GPU)
    assert gpu.device_count() == 0 and gpu.describe() == "no GPU"


def _rows(np_: int) -> list[report.Row]:
    raw = [
        {"backend": b, "case": "allreduce", "size_bytes": 1 << 20, "tensors": 1, "iters": 5,
         "warmup": 2, "median_s": t, "p90_s": t, "min_s": t, "mean_s": t}
        for b, t in (("hora-nccl", 0.001), ("hora-staged", 0.004), ("nccl", 0.002))
    ]  # fmt: skip
    return report.with_bandwidth(raw, np_)


def test_table_at_one_rank_shows_algbw_and_compares_medians() -> None:
    table = report.allreduce_table(_rows(1)).splitlines()
    assert table[0].split() == [
        "size", "backend", "iters", "p50", "ms", "p90", "ms", "busbw", "GB/s", "algbw", "GB/s",
        "vs", "nccl",
    ]  # fmt: skip
    by_backend = {line.split()[0 if i else 2]: line for i, line in enumerate(table[2:])}
    assert by_backend["hora-nccl"].split()[-1] == "2.00x"
    assert by_backend["hora-staged"].split()[-1] == "0.50x"
    assert "algbw" not in report.allreduce_table(_rows(2))
    assert report.allreduce_table(_rows(2)).splitlines()[2].split()[-1] == "2.00x"


def test_title_names_the_gpus() -> None:
    meta = {"np": 2, "host": "h (16 CPUs)", "device": "cuda", "gpu": "2 x NVIDIA H100"}
    result = bench.BenchResult(meta, _rows(2), {"nccl": "no NCCL"})
    assert result.title() == (
        "allreduce float32 Sum of CUDA tensors, np=2, 2 x NVIDIA H100, h (16 CPUs)"
    )
    text = bench.render(result)
    assert "torch.cuda.synchronize()" in text and "skipped nccl: no NCCL" in text


@pytest.mark.timeout(120)
def test_device_cuda_without_a_gpu_reports_every_backend_skipped(tmp_path: Path) -> None:
    """For real, with the GPUs hidden (CUDA_VISIBLE_DEVICES empty) so any machine has none."""
    out_json = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "hora.lab", "allreduce", "--device", "cuda", "--sizes", "4K"]
    cmd += ["--iters", "2", "--timeout", "60", "--json", str(out_json)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for backend in gpu.CUDA_BACKENDS:
        assert f"skipped {backend}: {gpu.NO_GPU}" in proc.stdout
        assert f"[{backend}] skipped: {gpu.NO_GPU}" in proc.stderr
    assert "starting" not in proc.stderr  # no worker was started
    doc = json.loads(out_json.read_text())
    assert doc["rows"] == [] and set(doc["skipped"]) == set(gpu.CUDA_BACKENDS)
    assert doc["meta"]["device"] == "cuda" and doc["meta"]["gpu"] == "no GPU"
    assert proc.stdout.startswith("allreduce float32 Sum of CUDA tensors, np=1, no GPU")


@NEEDS_GPU
@pytest.mark.timeout(300)
def test_short_cuda_run_measures_every_backend(tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "hora.lab", "allreduce", "--device", "cuda", "--np", "1"]
    cmd += ["--sizes", "4K,1M", "--iters", "5", "--timeout", "240", "--json", str(out_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out_json.read_text())
    assert doc["skipped"] == {}, doc["skipped"]
    rows = {(r["backend"], r["size_bytes"]) for r in doc["rows"]}
    assert rows == {(b, s) for b in gpu.CUDA_BACKENDS for s in (4096, 1 << 20)}
    assert torch.cuda.get_device_name(0) in proc.stdout.splitlines()[0]
