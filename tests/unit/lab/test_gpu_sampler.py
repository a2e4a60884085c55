"""The GPU side of hora bench scaling on machines without a GPU: the utilisation sampler and the
environment report against a FAKE nvidia-smi (a script first on PATH that prints canned CSV),
the --device option, the workers' backend variables, and the GPU columns of the tables and CSV.
A short real GPU run skips without a GPU."""

from __future__ import annotations

import argparse
import csv
import functools
import io
import os
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hora.lab import bench_report, envreport, gpu, gpu_sampler, scaling
from hora.lab.gpu_sampler import GpuSampler, Sample
from hora.lab.progress import Progress
from hora.lab.scaling import Placement
from hora.lab.train_worker import DEFAULT_GPU_BATCH, TrainSpec

HAS_GPU = torch.cuda.is_available()
NEEDS_GPU = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (torch sees none)")
NO_GPU_ONLY = pytest.mark.skipif(HAS_GPU, reason="checks the answer of machines without a GPU")

FAKE_NVIDIA_SMI = f"""#!{sys.executable}
# FAKE nvidia-smi for hora's tests: prints canned output, never touches a GPU.
import pathlib
import sys

here = pathlib.Path(__file__).parent
with open(here / "calls.log", "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
args = sys.argv[1:]
if args[:1] == ["topo"]:
    print("\\tGPU0\\tGPU1\\tCPU Affinity\\nGPU0\\t X \\tNV18\\t0-15\\nGPU1\\tNV18\\t X \\t0-15")
elif "--query-gpu=name" in args:
    print("NVIDIA Fake GPU A\\nNVIDIA Fake GPU B")
elif any(a.startswith("--query-gpu=name,") for a in args):
    print("NVIDIA Fake GPU, 555.42.06, 81559 MiB")
    print("NVIDIA Fake GPU, 555.42.06, 81559 MiB")
else:
    sys.stdout.write((here / "query.txt").read_text())
"""


class FakeSmi:
    """A fake nvidia-smi first on PATH; ``answer`` sets what its utilisation query prints."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir()
        script = folder / "nvidia-smi"
        script.write_text(FAKE_NVIDIA_SMI)
        script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        self.answer("0, 50, 1024\n1, 100, 4096\n2, [N/A], [N/A]\n")

    def answer(self, text: str) -> None:
        tmp = self.folder / "query.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.folder / "query.txt")

    def calls(self) -> list[str]:
        log = self.folder / "calls.log"
        return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSmi:
    fake = FakeSmi(tmp_path / "fake-nvidia-smi")
    monkeypatch.setenv("PATH", f"{fake.folder}{os.pathsep}{os.environ['PATH']}")
    return fake


def _until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Wait for ``condition`` (the test's hard timeout is the real limit)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("condition not reached")
        time.sleep(0.02)


def test_parse_query_skips_unreadable_lines() -> None:
    text = "0, 87, 1234\n1, [N/A], 5\nbad line\n\n2, 3, [Not Supported]\n3,10,20\n"
    assert gpu_sampler.parse_query(text) == {0: (87.0, 1234.0), 3: (10.0, 20.0)}


def test_summary_prefers_the_timed_samples() -> None:
    idle = Sample(False, {0: (0.0, 500.0)})
    busy = [Sample(True, {0: (80.0, 900.0), 1: (60.0, 700.0)}), Sample(True, {0: (100.0, 950.0)})]
    summary = gpu_sampler.summarize([idle, *busy], "nvidia-smi")
    assert summary == {
        "gpu_util_mean_pct": 85.0, "gpu_util_max_pct": 100.0, "gpu_mem_max_mib": 950.0,
        "gpu_samples": 2, "gpu_sampled": "timed steps", "gpu_source": "nvidia-smi",
    }  # fmt: skip
    whole = gpu_sampler.summarize([idle], "nvml")
    assert whole is not None and whole["gpu_sampled"] == "whole run"
    assert gpu_sampler.summarize([], "nvml") is None
    with pytest.raises(ValueError, match="interval"):
        GpuSampler(interval=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("indices", "mean", "peak", "memory"), [([0], 50.0, 50.0, 1024.0), (None, 75.0, 100.0, 4096.0)]
)
def test_sampler_polls_the_fake_nvidia_smi(
    fake_smi: FakeSmi, indices: list[int] | None, mean: float, peak: float, memory: float
) -> None:
    sampler = GpuSampler(indices, interval=0.05, source="nvidia-smi").start()
    _until(lambda: sampler.count() >= 3)
    summary = sampler.stop()
    assert summary is not None
    assert (summary["gpu_util_mean_pct"], summary["gpu_util_max_pct"]) == (mean, peak)
    assert summary["gpu_mem_max_mib"] == memory and summary["gpu_samples"] >= 3
    assert (summary["gpu_source"], summary["gpu_sampled"]) == ("nvidia-smi", "timed steps")
    assert fake_smi.calls()[0] == "--query-gpu=index,utilization.gpu,memory.used " + (
        "--format=csv,noheader,nounits"
    )
    count = len(fake_smi.calls())
    time.sleep(0.2)  # stopped: no more calls (no timing asserted, only that polling ended)
    assert len(fake_smi.calls()) == count


@pytest.mark.timeout(60)
def test_only_samples_of_the_timed_steps_count(fake_smi: FakeSmi) -> None:
    fake_smi.answer("0, 5, 100\n")
    timed = {"on": False}
    with GpuSampler([0], interval=0.05, timed=lambda: timed["on"], source="nvidia-smi") as s:
        _until(lambda: s.count() >= 2)
        fake_smi.answer("0, 90, 2000\n")  # the answer changes before the window opens
        timed["on"] = True
        seen = s.count()
        _until(lambda: s.count() >= seen + 3)
    assert s.summary is not None and s.summary["gpu_sampled"] == "timed steps"
    assert s.summary["gpu_util_mean_pct"] == 90.0 and s.summary["gpu_mem_max_mib"] == 2000.0


@pytest.mark.timeout(60)
def test_without_nvidia_smi_nothing_is_sampled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvidia-smi
    sampler = GpuSampler(source="nvidia-smi").start()
    assert sampler.stop() is None and sampler.count() == 0
    with pytest.raises(ValueError, match="choose from auto, nvml, nvidia-smi"):
        GpuSampler(source="dcgm").start()


@pytest.mark.timeout(60)
def test_environment_rows_come_from_the_fake_nvidia_smi(fake_smi: FakeSmi) -> None:
    model, driver, links = envreport.gpus()
    assert model == "2 x NVIDIA Fake GPU (81559 MiB)" and driver == "555.42.06"
    assert links == "NV18 (NVLink, 18 links): 1 pair"
    headers, body = envreport.environment_table(
        [{"gpu": model, "gpu_driver": driver, "cuda": "12.4", "nccl": "2.21.5"}]
    )
    shown = {row[1]: row[2] for row in body}
    assert shown["GPU model and count"] == model and shown["GPU driver"] == driver
    assert shown["CUDA"] == "12.4" and shown["NCCL"] == "2.21.5"


def test_gpu_names_come_from_the_fake_nvidia_smi(
    fake_smi: FakeSmi, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu.describe() == "1 x NVIDIA Fake GPU A, 1 x NVIDIA Fake GPU B"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setattr(gpu, "device_count", lambda: 1)
    assert gpu.describe() == "1 x NVIDIA Fake GPU B" and gpu.visible_indices(1) == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234abcd")
    assert gpu.visible_indices(1) is None
    monkeypatch.setattr(gpu, "device_count", lambda: 0)
    assert gpu.describe() == "no GPU"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    scaling.configure(parser)
    return parser.parse_args(list(argv))


@NO_GPU_ONLY
def test_device_auto_trains_on_the_cpu_and_cuda_is_refused_without_a_gpu() -> None:
    config = scaling.config_from_args(_args())
    assert config.device == "cpu" and config.spec("cnn").device == "cpu"
    with pytest.raises(ValueError, match=f"--device cuda {gpu.NO_GPU}"):
        scaling.config_from_args(_args("--device", "cuda"))
    reason = scaling.unavailable("nccl", "cpu")
    assert reason is not None and reason.startswith(gpu.NO_GPU)


def test_device_option_and_gpu_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    config = scaling.config_from_args(_args("--device", "cpu"))
    assert config.device == "cpu" and config.batch("resnet50") == 2
    monkeypatch.setattr(gpu, "no_gpu_reason", lambda: None)  # as if torch saw a GPU
    config = scaling.config_from_args(_args("--model", "resnet50"))
    assert config.device == "cuda" and config.batch("resnet50") == DEFAULT_GPU_BATCH["resnet50"]
    assert config.spec("resnet50").device == "cuda"
    fixed = scaling.config_from_args(_args("--device", "cuda", "--batch-size", "8"))
    assert fixed.batch("cnn") == 8
    with pytest.raises(SystemExit):
        _args("--device", "tpu")
    with pytest.raises(ValueError, match="device 'tpu'"):
        TrainSpec("cnn", 1, 1, 0, device="tpu")


def test_cuda_workers_run_the_backend_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOROVOD_GPU_OPERATIONS", "MPI")
    monkeypatch.setenv("HORA_CPU_OPERATIONS", "gloo")
    nccl = scaling._worker_env("nccl", "cuda")
    assert nccl["HOROVOD_GPU_OPERATIONS"] == "NCCL" and "HORA_CPU_OPERATIONS" not in nccl
    native = scaling._worker_env("native", "cuda")
    assert native["HOROVOD_CPU_OPERATIONS"] == "native"
    assert "HOROVOD_GPU_OPERATIONS" not in native
    assert "HOROVOD_CPU_OPERATIONS" not in scaling._worker_env("gloo", "cuda")
    cpu = scaling._worker_env("native", "cpu")  # on the CPU as before: the caller's variables
    assert cpu["HOROVOD_GPU_OPERATIONS"] == "MPI" and cpu["OMP_NUM_THREADS"] == "1"


def _fake_rank(steps: int) -> dict[str, Any]:
    phases = {f"{p}_s": [0.01] * steps for p in ("data", "compute", "wait", "update")}
    return {"rank": 0, "backend": "native", "params": 10, "grad_bytes": 40, **phases}


@pytest.mark.timeout(120)
def test_a_cuda_configuration_gets_the_sampled_gpu_columns(
    fake_smi: FakeSmi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_configuration's plumbing: the training launch is replaced by one that stays in its
    timed steps until the fake nvidia-smi has answered a few times."""
    config = scaling.ScalingConfig(models=["mlp"], backends=["native"], nps=[1], steps=4)
    config.device = "cuda"  # as if torch saw a GPU
    monkeypatch.setattr(gpu, "device_count", lambda: 1)
    monkeypatch.setattr(scaling, "GpuSampler", functools.partial(GpuSampler, source="nvidia-smi"))
    fake_smi.answer("0, 70, 3000\n1, 10, 10\n")  # GPU 1 is not used by one process

    def launch(config: scaling.ScalingConfig, spec: TrainSpec, backend: str, place: Any) -> Any:
        assert spec.device == "cuda" and spec.progress_path
        Path(spec.progress_path).write_text(f"{spec.warmup + 1} {spec.warmup + spec.steps}\n")
        _until(lambda: len(fake_smi.calls()) >= 3)
        return [_fake_rank(spec.steps)]

    monkeypatch.setattr(scaling, "_launch", launch)
    progress = Progress(io.StringIO(), 1)
    row = scaling.run_configuration(config, "mlp", "native", Placement(1, 1), str(tmp_path),
                                    progress)  # fmt: skip
    assert row["device"] == "cuda" and row["gpu_sampled"] == "timed steps"
    assert (row["gpu_util_mean_pct"], row["gpu_util_max_pct"]) == (70.0, 70.0)
    assert row["gpu_mem_max_mib"] == 3000.0
    assert f"GPU 70% (max 70%, {row['gpu_samples']} samples)" in scaling._done_line(row, None)
    with pytest.raises(RuntimeError, match="nccl needs one GPU per process: 2 processes, 1 GPU"):
        scaling.run_configuration(config, "mlp", "nccl", Placement(1, 2), str(tmp_path), progress)


def _row(backend: str, per: int, **gpu_fields: Any) -> dict[str, Any]:
    return {
        "model": "cnn", "backend": backend, "servers": 1, "per_server": per, "np": per,
        "hosts": ["localhost"], "batch_size": 16, "steps": 5, "warmup": 1, "step_mean_s": 0.1,
        "step_std_s": 0.01, "step_p50_s": 0.1, "step_p90_s": 0.11, "data_s": 0.0,
        "compute_s": 0.08, "wait_s": 0.01, "update_s": 0.01, "comm_share": 0.1,
        "throughput": 160.0 * per, "params": 10, "grad_bytes": 40, "wall_s": 3.0, **gpu_fields,
    }  # fmt: skip


def test_gpu_columns_appear_only_when_a_gpu_was_sampled() -> None:
    plain = [_row("native", 1), _row("native", 2)]
    headers, body = bench_report.intra_table(plain, "cnn")
    assert headers == bench_report.LAB_HEADERS and all(len(r) == len(headers) for r in body)
    assert list(csv.DictReader(io.StringIO(bench_report.to_csv(plain))))[0].keys() == set(
        bench_report.CSV_COLUMNS
    )
    sampled = [
        _row("nccl", 1, device="cuda", gpu_util_mean_pct=91.4, gpu_util_max_pct=99.0,
             gpu_mem_max_mib=5120.0, gpu_samples=24, gpu_sampled="timed steps"),
        _row("native", 1),
        # a run whose timed steps were over before a reading: the figure rests on start-up too
        _row("gloo", 2, device="cuda", gpu_util_mean_pct=4.0, gpu_util_max_pct=84.0,
             gpu_mem_max_mib=900.0, gpu_samples=3, gpu_sampled="whole run"),
    ]  # fmt: skip
    headers, body = bench_report.intra_table(sampled, "cnn")
    assert headers[-3:] == ["GPU util mean / max", "GPU util samples", "GPU memory max (MiB)"]
    assert body[0][-3:] == ["91% / 99%", "24", "5120"] and body[1][-3:] == ["-", "-", "-"]
    assert body[2][-3:] == ["4% / 84%", "3 (whole run, too few)", "900"]
    rows = list(csv.DictReader(io.StringIO(bench_report.to_csv(sampled))))
    assert rows[0]["gpu_util_mean_pct"] == "91.4" and rows[0]["gpu_sampled"] == "timed steps"
    assert rows[0]["gpu_samples"] == "24"
    assert rows[1]["gpu_util_mean_pct"] == ""
    meta = {"device": "cuda", "gpu": "1 x NVIDIA Fake GPU", "steps": 5, "warmup": 1}
    assert "on CUDA (1 x NVIDIA Fake GPU)" in bench_report.headline(meta)
    assert "GPU util" in bench_report.headline(meta)
    assert "CUDA" not in bench_report.headline({"steps": 5})


def test_a_ddp_row_names_the_torch_backend_it_ran_on() -> None:
    """On GPUs DDP's fair peer runs on NCCL: the tables say which backend DDP used."""
    rows = [_row("ddp", 1, ddp_backend="nccl"), _row("ddp", 2, ddp_backend="gloo")]
    _, body = bench_report.intra_table(rows, "cnn")
    assert [r[0] for r in body] == ["ddp (nccl)", "ddp (gloo)"]


@NEEDS_GPU
@pytest.mark.timeout(600)
def test_short_scaling_run_on_the_gpu_samples_it(tmp_path: Path) -> None:
    config = scaling.ScalingConfig(
        models=["mlp"], backends=["native", "nccl"], nps=[1], steps=5, warmup=2,
        device="cuda", timeout=300, out=str(tmp_path),
    )  # fmt: skip
    result = scaling.run_scaling(config, io.StringIO())
    assert result.failed == [] and result.skipped == {}
    assert {r["backend"] for r in result.rows} == {"native", "nccl"}
    for row in result.rows:
        assert row["device"] == "cuda" and row["backend_used"] == row["backend"]
        if gpu_sampler._open("auto") is not None:
            assert 0 <= row["gpu_util_mean_pct"] <= row["gpu_util_max_pct"] <= 100
    assert "GPU" in (tmp_path / "tables.md").read_text()
