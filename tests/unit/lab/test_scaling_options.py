"""hora bench scaling's options, placements, backend availability, progress output, training
spec validation and the environment report's parsing (no processes started)."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest

from hora.lab import envreport, gpu, scaling
from hora.lab.progress import Progress
from hora.lab.scaling import Placement
from hora.lab.train_worker import TrainSpec, load_example
from hora.launch.hosts import HostSlots


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    scaling.configure(parser)
    return parser.parse_args(list(argv))


def test_defaults_are_modest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "no_gpu_reason", lambda: "no GPU")  # auto: the CPU's batches
    config = scaling.config_from_args(_args())
    assert config.models == ["cnn"] and config.nps == [1, 2]
    assert config.backends == ["native", "gloo", "mpi", "nccl", "ddp"]
    assert config.steps == 20 and config.warmup == 5 and config.threads == 1
    assert config.batch("cnn") == 16 and config.placements == [Placement(1, 1), Placement(1, 2)]
    spec = config.spec("mnist", "/tmp/p")
    assert (spec.model, spec.batch_size, spec.threads, spec.progress_path) == (
        "mnist", 64, 1, "/tmp/p",
    )  # fmt: skip
    assert not spec.ddp and config.spec("cnn", None, "ddp").ddp  # DDP in place of hora's optimizer


def test_lists_and_all() -> None:
    config = scaling.config_from_args(
        _args(
            "--model", "all", "--backends", "gloo,native,gloo", "--np", "4,1,2", "--batch-size", "8"
        )  # fmt: skip  # noqa: E501
    )
    assert config.models == ["mlp", "cnn", "resnet50", "lstm", "mnist"]
    assert config.backends == ["gloo", "native"] and config.nps == [1, 2, 4]
    assert config.batch("resnet50") == 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "vgg"], "--model 'vgg': choose from mlp"),
        (["--backends", "nccl2"], "--backends 'nccl2'"),
        (["--np", "0,2"], "positive process counts"),
        (["--np", "two"], "process counts like 1,2,4"),
        (["--steps", "0"], "steps (0) must be at least 1"),
        (["--warmup", "-1"], "warm-up (-1) at least 0"),
        (["--batch-size", "0"], "batch size (0)"),
        (["--timeout", "0"], "timeout (0.0) > 0"),
        (["--np", "3", "-H", "a:2,b:2"], "--np 3 fits no balanced split of the hosts a:2,b:2"),
        (["-H", "a:x"], "slot count 'x'"),
    ],
)
def test_bad_options_are_named(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        scaling.config_from_args(_args(*argv))
    assert message in str(info.value)


def test_command_returns_2_for_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert scaling.command(_args("--np", "x")) == 2
    assert "hora bench scaling: error: --np 'x'" in capsys.readouterr().err


def test_placements_fill_both_tables() -> None:
    hosts = [HostSlots("a", 2), HostSlots("b", 2)]
    got = scaling.placements([1, 2, 4], hosts)
    assert [(p.servers, p.per_server, p.hosts) for p in got] == [
        (1, 1, ("a",)), (1, 2, ("a",)), (2, 1, ("a", "b")), (2, 2, ("a", "b")),
    ]  # fmt: skip
    assert got[3].hosts_arg() == "a:2,b:2" and got[3].np == 4
    assert got[2].label() == "2 servers x 1"
    uneven = scaling.placements([2], [HostSlots("a", 1), HostSlots("b", 4)])
    assert [(p.servers, p.per_server) for p in uneven] == [(2, 1)]
    assert scaling.placements([1, 3], []) == [Placement(1, 1), Placement(1, 3)]
    assert Placement(1, 3).hosts_arg() is None


def test_unavailable_backends_say_why() -> None:
    assert scaling.unavailable("native") is None
    reason = scaling.unavailable("nccl")
    assert reason is not None and "GPU" in reason


def test_progress_writes_a_line_per_configuration_without_a_terminal() -> None:
    stream = io.StringIO()
    progress = Progress(stream, total=2)
    progress.line("skipped nccl: no GPU", finished=False)
    progress.start("cnn native 1 server x 1")
    progress.step(3, 10)
    progress.line("cnn native 1x1: done")
    assert stream.getvalue() == "skipped nccl: no GPU\n[1/2] cnn native 1x1: done\n"


def test_progress_redraws_a_bar_on_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    progress = Progress(stream, total=2)
    progress.line("first")
    progress.start("cnn gloo 1 server x 2")
    progress.step(5, 10)
    last = stream.getvalue().split("\r")[-1]
    assert last.startswith("[##################......] 1/2 cnn gloo 1 server x 2: step 5/10")


def test_train_spec_and_examples_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="choose from mlp"):
        TrainSpec("vgg", 1, 1, 0)
    spec = TrainSpec("mlp", 4, 2, 1, examples_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--examples-dir"):
        load_example(spec, "synthetic")
    models = load_example(TrainSpec("mlp", 4, 2, 1), "synthetic").MODELS
    assert {"mlp", "cnn", "resnet50", "lstm"} <= set(models)


TOPO = (
    "\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\x1b[0m\n"
    "GPU0\t X \tNV12\tNV12\tSYS\tPXB\t0-11\t0\n"
    "GPU1\tNV12\t X \tNV12\tSYS\tPXB\t0-11\t0\n"
    "GPU2\tNV12\tNV12\t X \tSYS\tSYS\t12-23\t1\n"
    "GPU3\tSYS\tSYS\tSYS\t X \tSYS\t12-23\t1\n"
    "NIC0\tPXB\tPXB\tSYS\tSYS\t X \n\nLegend:\n  X    = Self\n"
)


def test_gpu_interconnect_is_summarised_from_nvidia_smi_topo() -> None:
    text = envreport.interconnect(TOPO)
    assert text.startswith("NV12 (NVLink, 12 links): 3 pairs, SYS (")
    assert text.endswith("3 pairs")
    one = "\tGPU0\tNIC0\tCPU Affinity\nGPU0\t X \tPHB\t0-7\n"
    assert envreport.interconnect(one) == "one GPU (no GPU-to-GPU link)"
    assert envreport.interconnect("").startswith("unknown")


def test_environment_table_has_the_labs_rows_and_a_column_per_server() -> None:
    hosts = [{k: f"{k}-{h}" for _, _, k in envreport.ROWS} | {"host": h} for h in ("alpha", "beta")]
    headers, body = envreport.environment_table(hosts)
    assert headers == ["", "item", "alpha", "beta"]
    named = envreport.environment_table([hosts[0] | {"server": "hostA"}, hosts[1]])
    assert named[0] == ["", "item", "hostA", "beta"]
    labels = [row[1] for row in body]
    for label in ("servers", "CPU model", "GPU model and count", "GPU interconnect",
                  "NICs (model, speed)", "OS", "GPU driver", "framework", "CUDA", "NCCL", "MPI",
                  "hora"):  # fmt: skip
        assert label in labels
    assert body[0] == ["hardware", "servers", "2", ""]
    assert body[labels.index("CUDA")][2:] == ["cuda-alpha", "cuda-beta"]
    assert [row[0] for row in body].count("software") == 1
    with pytest.raises(ValueError):
        envreport.environment_table([])


@pytest.mark.timeout(60)
def test_collect_describes_this_host() -> None:
    env = envreport.collect()
    assert set(env) == {k for _, _, k in envreport.ROWS} - {"servers"}
    assert all(isinstance(v, str) and v for v in env.values())
    assert "logical" in env["cores"] and env["python"].count(".") == 2
    assert env["framework"].startswith("torch ")
    speed, unit = env["copy_speed"].split()
    assert unit == "GB/s" and float(speed) > 0.1  # any machine copies faster than 100 MB/s


def test_rounds_keep_each_configurations_best_and_record_failures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The round logic alone: the training runs are replaced by a table of outcomes."""
    steps = {  # (np, round) -> mean step time; None: that round fails
        (1, 1): 0.30, (1, 2): 0.20, (1, 3): 0.25,
        (2, 1): 0.40, (2, 2): None, (2, 3): 0.50,
    }  # fmt: skip

    def fake(config: scaling.ScalingConfig, model: str, backend: str, place: Placement,
             logdir: str, progress: Progress, round_: int) -> dict:  # fmt: skip
        step = steps[(place.np, round_)]
        if step is None:
            raise RuntimeError("rank 1 exited")
        return {"model": model, "backend": backend, "servers": 1, "per_server": place.np,
                "np": place.np, "step_mean_s": step, "step_std_s": 0.0, "comm_share": 0.1,
                "throughput": place.np / step}  # fmt: skip

    monkeypatch.setattr(scaling, "run_configuration", fake)
    config = scaling.ScalingConfig(models=["mlp"], backends=["native"], repeat=3)
    stream = io.StringIO()
    rows, failed = scaling._measure_all(config, ["native"], Progress(stream, 6), "/x")
    assert [(r["np"], r["step_mean_s"], r["round_step_means_s"]) for r in rows] == [
        (1, 0.20, [0.30, 0.20, 0.25]), (2, 0.40, [0.40, 0.50]),
    ]  # fmt: skip
    assert failed == [{"model": "mlp", "backend": "native", "round": 2, "servers": 1,
                       "per_server": 2, "reason": "rank 1 exited"}]  # fmt: skip
    out = stream.getvalue()
    assert "mlp native 1 server x 2 (round 2/3) failed: rank 1 exited" in out
    assert "[6/6] mlp native 1x2: 500.0 ± 0.0 ms/step" in out and "speedup 0.80" in out
    with pytest.raises(ValueError, match="--repeat 0"):
        scaling.ScalingConfig(repeat=0)
