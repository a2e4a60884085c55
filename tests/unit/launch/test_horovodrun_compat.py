"""horovodrun's command line and config file, as Horovod users write them, and every setting
refused before a worker starts."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from hora.launch import cli
from hora.settings import MiB

SRC = str(Path(__file__).parents[3] / "src")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hora run", allow_abbrev=False)
    cli.configure(parser)
    return parser


def _config(argv: list[str], env: dict[str, str] | None = None):
    return cli.build_config(_parser().parse_args(argv), env=env or {})


# (flags, Settings field, value): every horovodrun boolean flag and its `--no-` form
BOOL_FLAGS = [
    ("--autotune", "autotune", True),
    ("--no-autotune", "autotune", False),
    ("--hierarchical-allreduce", "hierarchical_allreduce", True),
    ("--no-hierarchical-allreduce", "hierarchical_allreduce", False),
    ("--hierarchical-allgather", "hierarchical_allgather", True),
    ("--no-hierarchical-allgather", "hierarchical_allgather", False),
    ("--timeline-mark-cycles", "timeline_mark_cycles", True),
    ("--no-timeline-mark-cycles", "timeline_mark_cycles", False),
    ("--no-stall-check", "stall_check_disable", True),
    ("--stall-check", "stall_check_disable", False),
    ("--mpi-threads-disable", "mpi_threads_disable", True),
    ("--no-mpi-threads-disable", "mpi_threads_disable", False),
    ("--log-without-timestamp", "log_hide_time", True),
    ("--log-with-timestamp", "log_hide_time", False),
    ("--log-hide-timestamp", "log_hide_time", True),
    ("--no-log-hide-timestamp", "log_hide_time", False),
    ("--no-log-with-timestamp", "log_hide_time", True),
]


@pytest.mark.parametrize(("flag", "field", "value"), BOOL_FLAGS)
def test_every_boolean_flag_and_its_no_form(flag: str, field: str, value: bool) -> None:
    # the environment says the opposite: the flag wins
    from hora.settings import KNOB_BY_FIELD

    env_name = KNOB_BY_FIELD[field].env_names[1]
    cfg = _config(["-np", "1", flag, "x"], {env_name: "0" if value else "1"})
    assert getattr(cfg.settings, field) is value


def test_both_forms_of_one_flag_are_refused_together(capsys) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["-np", "1", "--autotune", "--no-autotune", "x"])
    assert "not allowed with" in capsys.readouterr().err


def test_prefix_timestamp_is_not_an_ssh_port() -> None:
    cfg = _config(["-np", "1", "-prefix-timestamp", "x"])
    assert cfg.prefix_timestamp is True and cfg.ssh_port is None
    assert _config(["-np", "1", "-p", "2222", "x"]).ssh_port == 2222


def test_numeric_library_and_logging_flags() -> None:
    cfg = _config(["-np", "1", "--num-nccl-streams", "2", "--log-level", "debug",
                   "--gloo-timeout-seconds", "45", "--thread-affinity", "0,1", "x"])  # fmt: skip
    s = cfg.settings
    assert (s.num_nccl_streams, s.log_level, s.gloo_timeout_seconds) == (2, "debug", 45)
    assert s.thread_affinity == "0,1"


def test_network_interface_may_repeat_and_hold_commas() -> None:
    cfg = _config(["-np", "1", "--network-interface", "eth0,eth1", "--network-interface",
                   "ib0", "x"])  # fmt: skip
    assert cfg.network_interfaces == ["eth0", "eth1", "ib0"]


def test_jsrun_is_refused_clearly(caplog) -> None:
    code = cli.command(_parser().parse_args(["-np", "1", "--jsrun", "true"]))
    assert code == 2
    assert "--jsrun: not supported" in caplog.text


def test_tcp_keeps_open_mpi_off_infiniband() -> None:
    from hora.launch import mpirun
    from hora.launch.hosts import assign_ranks
    from hora.launch.ssh import SshOptions

    cfg = _config(["-np", "2", "--mpi", "--tcp", "x"])
    argv = mpirun.command(cfg, assign_ranks(cfg.host_list(), 2), {}, SshOptions(), [], "mpirun")
    assert "pml ob1 -mca btl ^openib" in " ".join(argv)


# horovodrun's YAML format, every section (test/data/config.test.yaml of Horovod's own tests
# has the same shape)
HOROVOD_CONFIG = """\
controller: gloo

params:
  fusion_threshold_mb: 32
  cycle_time_ms: 10
  cache_capacity: 2048
  hierarchical_allreduce: true
  hierarchical_allgather: true

autotune:
  enabled: true
  log_file: {log}
  warmup_samples: 5
  steps_per_sample: 20
  bayes_opt_max_samples: 50
  gaussian_process_noise: 0.9

timeline:
  filename: {timeline}
  mark_cycles: true

stall_check:
  enabled: false
  warning_time_seconds: 120
  shutdown_time_seconds: 240

library_options:
  mpi_threads_disable: true
  num_nccl_streams: 2
  ccl_bgt_affinity: 1
  gloo_timeout_seconds: 60

logging:
  level: INFO
  with_timestamp: false
"""


def _horovod_file(tmp_path: Path) -> Path:
    path = tmp_path / "horovod.yaml"
    path.write_text(HOROVOD_CONFIG.format(log=tmp_path / "at.csv", timeline=tmp_path / "tl.json"))
    return path


def test_config_file_in_horovodrun_format_with_every_section(tmp_path, caplog) -> None:
    path = _horovod_file(tmp_path)
    with caplog.at_level(logging.INFO, logger="hora.launch"):
        cfg = _config(["-np", "2", "--config-file", str(path), "x"])
    s = cfg.settings
    assert cfg.backend == "gloo"
    assert (s.fusion_threshold, s.cycle_time_ms, s.cache_capacity) == (32 * MiB, 10, 2048)
    assert s.hierarchical_allreduce and s.hierarchical_allgather
    assert s.autotune and s.autotune_log == str(tmp_path / "at.csv")
    assert (s.autotune_warmup_samples, s.autotune_steps_per_sample) == (5, 20)
    assert (s.autotune_bayes_opt_max_samples, s.autotune_gaussian_process_noise) == (50, 0.9)
    assert s.timeline == str(tmp_path / "tl.json") and s.timeline_mark_cycles
    assert s.stall_check_disable is True
    assert (s.stall_check_time_seconds, s.stall_shutdown_time_seconds) == (120, 240)
    assert s.mpi_threads_disable and s.num_nccl_streams == 2 and s.gloo_timeout_seconds == 60
    assert s.log_level == "INFO" and s.log_hide_time is True
    assert "ccl_bgt_affinity" in caplog.text  # read, and said to have nothing to do


def test_command_line_flags_win_over_horovodrun_config_file(tmp_path) -> None:
    path = _horovod_file(tmp_path)
    argv = ["-np", "2", "--config-file", str(path), "--mpi", "--cycle-time-ms", "3",
            "--no-autotune", "--stall-check", "--log-with-timestamp", "--log-level", "ERROR",
            "--no-hierarchical-allreduce", "x"]  # fmt: skip
    cfg = _config(argv)
    s = cfg.settings
    assert cfg.backend == "mpi"
    assert s.cycle_time_ms == 3 and s.autotune is False and s.stall_check_disable is False
    assert s.log_hide_time is False and s.log_level == "ERROR"
    assert s.hierarchical_allreduce is False and s.cache_capacity == 2048


def test_horovodrun_section_defaults(tmp_path) -> None:
    """As horovodrun: an autotune section without `enabled` turns autotuning off, a
    stall_check section without it keeps the stall check on."""
    path = tmp_path / "c.yaml"
    path.write_text("autotune:\n  warmup_samples: 4\nstall_check:\n  warning_time_seconds: 9\n")
    env = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_STALL_CHECK_DISABLE": "1"}
    s = _config(["-np", "1", "--config-file", str(path), "x"], env).settings
    assert s.autotune is False and s.stall_check_disable is False
    assert s.autotune_warmup_samples == 4 and s.stall_check_time_seconds == 9


def test_hora_keys_keep_working_beside_horovods(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "controller:\n  mpi: true\nverbose: true\nparams:\n  torus_allreduce: true\n"
        "library_options:\n  start_timeout: 12\n  network_interfaces: eth0,eth1\n"
        "  cpu_bind: none\nlogging:\n  hide_timestamp: true\n"
        "  prefix_output_with_timestamp: true\n"
    )
    cfg = _config(["-np", "1", "--config-file", str(path), "x"])
    assert cfg.backend == "mpi" and cfg.verbose and cfg.start_timeout == 12
    assert cfg.network_interfaces == ["eth0", "eth1"] and cfg.prefix_timestamp
    assert cfg.settings.torus_allreduce and cfg.settings.cpu_bind == "none"
    assert cfg.settings.log_hide_time


def test_unknown_config_keys_are_all_named(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("params:\n  fusion_threshold_gb: 1\nlogging:\n  colour: red\nextras: 1\n")
    with pytest.raises(ValueError) as info:
        _config(["-np", "1", "--config-file", str(path), "x"])
    text = str(info.value)
    assert "extras" in text and "params.fusion_threshold_gb" in text and "logging.colour" in text


def test_unknown_controller_in_config_file(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("controller: carrier-pigeon\n")
    with pytest.raises(ValueError, match="carrier-pigeon.*no such controller"):
        _config(["-np", "1", "--config-file", str(path), "x"])


# -- every bad setting is refused in the launcher, before a worker starts ---------------------


def _hora_run(argv: list[str], env: dict[str, str], tmp_path: Path) -> tuple[int, str, Path]:
    marker = tmp_path / "worker-started"
    code = "import sys; from hora.launch.cli import main; sys.exit(main(sys.argv[1:]))"
    worker = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    import os

    full_env = {**os.environ, **env, "PYTHONPATH": SRC}
    done = subprocess.run(
        [sys.executable, "-c", code, "run", "-np", "2", *argv, *worker],
        capture_output=True, text=True, env=full_env, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    return done.returncode, done.stderr, marker


BAD = [
    (["--cpu-bind", "foo"], {}, "--cpu-bind=foo: expected one of auto, crowded, none"),
    (["--log-level", "LOUD"], {}, "--log-level=LOUD: expected one of TRACE, DEBUG, INFO"),
    (["--fusion-threshold-mb", "-5"], {}, "--fusion-threshold-mb=-5: must be >= 0"),
    (["--cycle-time-ms", "-3"], {}, "--cycle-time-ms=-3"),
    (["--cache-capacity", "-1"], {}, "--cache-capacity=-1: must be >= 0"),
    (["--autotune-gaussian-process-noise", "1.5"], {}, "must be in [0, 1]"),
    ([], {"HOROVOD_CYCLE_TIME": "-3"}, "HOROVOD_CYCLE_TIME=-3"),
    ([], {"HOROVOD_CPU_OPERATIONS": "bogus"}, "HOROVOD_CPU_OPERATIONS=bogus: expected one of"),
    ([], {"HOROVOD_CPU_OPERATIONS": "ccl"}, "CCL (Intel oneCCL) support is not built"),
    ([], {"HORA_FUSION_THRESHOLD": "lots"}, "HORA_FUSION_THRESHOLD='lots': expected an int"),
    ([], {"HOROVOD_THREAD_AFFINITY": "x"}, "HOROVOD_THREAD_AFFINITY=x: expected core ids"),
    (["--timeline-filename", "/nonexistent-folder/tl.json"], {}, "does not exist"),
    ([], {"HOROVOD_TIMELINE": "/nonexistent-folder/tl.json"}, "HOROVOD_TIMELINE="),
    ([], {"HOROVOD_START_TIMEOUT": "soon"}, "HOROVOD_START_TIMEOUT='soon'"),
    (["--output-filename", "/dev/null/out"], {}, "--output-filename=/dev/null/out: /dev/null"),
]


@pytest.mark.parametrize(("argv", "env", "message"), BAD)
def test_bad_settings_stop_the_launch_before_any_worker(argv, env, message, tmp_path) -> None:
    code, err, marker = _hora_run(argv, env, tmp_path)
    assert code != 0
    assert message in err, err
    assert "Traceback" not in err
    assert len([ln for ln in err.splitlines() if ln.strip()]) == 1, err
    assert not marker.exists()


def test_bad_config_file_values_name_the_key(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("params:\n  cache_capacity: -4\n")
    code, err, marker = _hora_run(["--config-file", str(path)], {}, tmp_path)
    assert code != 0 and "params.cache_capacity=-4: must be >= 0" in err, err
    assert not marker.exists()


INIT = "import hora\ntry:\n    hora.init()\nexcept ValueError as e:\n    print('ERROR', e)\n"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"HOROVOD_CYCLE_TIME": "-3"}, "HOROVOD_CYCLE_TIME=-3"),
        ({"HOROVOD_CPU_OPERATIONS": "ccl"}, "not built into hora"),
        ({"HOROVOD_LOG_LEVEL": "LOUD"}, "HOROVOD_LOG_LEVEL=LOUD: expected one of"),
        ({"HOROVOD_TIMELINE": "/nonexistent-folder/t.json"}, "HOROVOD_TIMELINE="),
    ],
)
def test_init_validates_for_processes_started_without_hora_run(env, message) -> None:
    import os

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    done = subprocess.run(
        [sys.executable, "-c", INIT], capture_output=True, text=True, timeout=120,
        env={**clean, **env, "PYTHONPATH": SRC},
    )  # fmt: skip
    assert f"ERROR {message}" in done.stdout or message in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--min-np", "0"], "--min-np=0: must be >= 1"),
        (["--min-np", "3", "--max-np", "2"], "--max-np=2: must be >= --min-np 3"),
        (["--slots-per-host", "0"], "--slots-per-host=0: must be >= 1"),
        (["--reset-limit", "-1"], "--reset-limit=-1: must be >= 0"),
        (["--elastic-timeout", "0"], "--elastic-timeout=0: must be > 0"),
        (["--blacklist-cooldown-range", "9", "3"], "--blacklist-cooldown-range=9 3"),
        (["-p", "70000"], "--ssh-port=70000"),
    ],
)
def test_launcher_flags_out_of_range_are_refused(argv, message) -> None:
    with pytest.raises(ValueError) as info:
        _config(["-np", "2", *argv, "x"])
    assert message in str(info.value)


def test_flags_a_static_job_does_not_use_are_named_once(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="hora.launch"):
        _config(["-np", "2", "--reset-limit", "3", "--mpi-args", "-x FOO", "x"])
        _config(["-np", "2", "--mpi", "--mpi-args", "-x FOO", "x"])
    notes = [r.getMessage() for r in caplog.records]
    assert sum("--reset-limit" in n for n in notes) == 1
    assert sum("--mpi-args" in n for n in notes) == 1  # not for the --mpi job
