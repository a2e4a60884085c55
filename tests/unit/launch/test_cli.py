"""hora run's command line: the frozen flag set, parsing, precedence, unsupported flags, help."""

from __future__ import annotations

import argparse
import logging

import pytest

from hora.launch import cli
from hora.settings import MiB

FLAGS = [
    "--as-horovod", "--autotune", "--autotune-bayes-opt-max-samples",
    "--autotune-gaussian-process-noise", "--autotune-log-file", "--autotune-steps-per-sample",
    "--autotune-warmup-samples",
    "--binding-args", "--blacklist-cooldown-range", "--cache-capacity", "--check-build",
    "--config-file", "--cpu-bind", "--cycle-time-ms", "--disable-cache", "--elastic-timeout",
    "--fusion-threshold-mb", "--gloo", "--gloo-timeout-seconds", "--help",
    "--hierarchical-allgather", "--hierarchical-allreduce", "--host-discovery-script",
    "--hostfile", "--hosts", "--jsrun", "--log-hide-timestamp", "--log-level",
    "--log-with-timestamp", "--log-without-timestamp", "--max-np", "--max-num-proc", "--min-np",
    "--min-num-proc", "--mpi", "--mpi-args", "--mpi-threads-disable", "--network-interface",
    "--network-interfaces", "--no-autotune", "--no-hierarchical-allgather",
    "--no-hierarchical-allreduce", "--no-log-hide-timestamp", "--no-log-with-timestamp",
    "--no-mpi-threads-disable", "--no-stall-check", "--no-tf-logs",
    "--no-timeline-mark-cycles",
    "--no-torus-allreduce", "--num-nccl-streams", "--num-proc", "--output-filename",
    "--prefix-output-with-timestamp", "--reset-limit", "--slots", "--slots-per-host",
    "--ssh-config-file", "--ssh-identity-file", "--ssh-port", "--stall-check",
    "--stall-check-shutdown-time-seconds", "--stall-check-warning-time-seconds",
    "--start-timeout", "--tcp", "--tf-logs", "--thread-affinity", "--timeline-filename",
    "--timeline-mark-cycles", "--torus-allreduce", "--verbose", "--version", "-H", "-cb", "-h",
    "-hostfile", "-i", "-np", "-p", "-prefix-timestamp", "-v",
]  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hora run", allow_abbrev=False)
    cli.configure(parser)
    return parser


def _config(argv: list[str], env: dict[str, str] | None = None):
    return cli.build_config(_parser().parse_args(argv), env=env or {})


def test_flag_set_is_frozen() -> None:
    parser = _parser()
    assert sorted(o for a in parser._actions for o in a.option_strings) == FLAGS


def test_typical_command_line() -> None:
    cfg = _config(["-np", "4", "-H", "a:2,b:2", "-p", "2222", "-i", "/k", "--gloo",
                   "python", "train.py", "--lr", "0.1", "-np", "9"])  # fmt: skip
    assert cfg.np == 4
    assert [(h.name, h.slots) for h in cfg.hosts] == [("a", 2), ("b", 2)]
    assert (cfg.ssh_port, cfg.ssh_identity_file, cfg.backend) == (2222, "/k", "gloo")
    assert cfg.command == ["python", "train.py", "--lr", "0.1", "-np", "9"]


def test_tunable_flags_become_settings() -> None:
    argv = "-np 1 --fusion-threshold-mb 32 --cycle-time-ms 2.5 --no-stall-check"
    cfg = _config([*argv.split(), "--timeline-filename", "t.json", "--autotune", "x"])
    s = cfg.settings
    assert s.fusion_threshold == 32 * MiB
    assert s.cycle_time_ms == 2.5
    assert s.stall_check_disable is True
    assert s.timeline == "t.json"
    assert s.autotune is True
    assert {"fusion_threshold", "cycle_time_ms", "timeline"} <= s.explicit


def test_precedence_flags_over_file_over_env(tmp_path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "params:\n  fusion_threshold_mb: 16\n  cycle_time_ms: 7\n  cache_capacity: 5\n"
        "stall_check:\n  enabled: false\ncontroller:\n  gloo: true\nverbose: true\n"
    )
    env = {"HOROVOD_FUSION_THRESHOLD": "1", "HOROVOD_CYCLE_TIME": "3", "HORA_AUTOTUNE": "1",
           "HORA_CACHE_CAPACITY": "9"}  # fmt: skip
    cfg = _config(["-np", "1", "--config-file", str(path), "--cycle-time-ms", "11", "x"], env)
    s = cfg.settings
    assert s.cycle_time_ms == 11  # flag beats file and env
    assert s.fusion_threshold == 16 * MiB  # file beats env
    assert s.cache_capacity == 5  # file beats env
    assert s.autotune is True  # env when nothing else says
    assert s.stall_check_disable is True  # `enabled: false` in the file
    assert cfg.backend == "gloo" and cfg.verbose is True
    assert _config(["-np", "1", "--config-file", str(path), "--mpi", "x"]).backend == "mpi"


def test_no_flag_overrides_config_file_bool(tmp_path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("params:\n  hierarchical_allreduce: true\n")
    on = _config(["-np", "1", "--config-file", str(path), "x"])
    off = _config(["-np", "1", "--config-file", str(path), "--no-hierarchical-allreduce", "x"])
    assert on.settings.hierarchical_allreduce is True
    assert off.settings.hierarchical_allreduce is False


def test_config_file_errors_name_the_key(tmp_path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("params:\n  fusion_threshold_gb: 1\n")
    with pytest.raises(ValueError, match="params.fusion_threshold_gb"):
        _config(["-np", "1", "--config-file", str(path), "x"])


def test_start_timeout_from_env_and_interfaces() -> None:
    cfg = _config(["-np", "1", "--network-interfaces", "eth0,eth1", "--network-interface",
                   "ib0", "x"], {"HOROVOD_START_TIMEOUT": "12"})  # fmt: skip
    assert cfg.start_timeout == 12
    assert cfg.network_interfaces == ["eth0", "eth1", "ib0"]


def test_ssh_config_file_from_env() -> None:
    assert _config(["-np", "1", "x"], {"HORA_SSH_CONFIG": "/c"}).ssh_config_file == "/c"


def test_flags_with_nothing_to_do_say_so_once(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="hora.launch"):
        cfg = _config(["-np", "1", "--tcp", "--num-nccl-streams", "2", "--disable-cache", "x"])
    text = caplog.text
    assert "--tcp" in text and "--num-nccl-streams" in text and "--disable-cache" in text
    assert len(caplog.records) == 3
    assert cfg.env is not None and cfg.env["NCCL_IB_DISABLE"] == "1" and cfg.tcp_flag
    assert cfg.settings.num_nccl_streams == 2


def test_elastic_flags_make_an_elastic_job_and_static_flags_do_not() -> None:
    argv = ["-np", "3", "--min-np", "2", "--max-np", "4", "--reset-limit", "5", "x"]
    args = _parser().parse_args(argv)
    opts = cli.elastic_options(args, cli.build_config(args, env={}))
    assert (opts.min_np, opts.max_np, opts.reset_limit, opts.elastic_timeout) == (2, 4, 5, 600.0)
    args = _parser().parse_args(["-np", "3", "--max-np", "4", "--elastic-timeout", "9", "x"])
    opts = cli.elastic_options(args, cli.build_config(args, env={}))
    assert (opts.min_np, opts.elastic_timeout) == (3, 9.0)  # --min-np defaults to -np
    assert opts.cooldown_range is None  # failed slots are never reused unless asked
    args = _parser().parse_args(["-np", "3", "x"])
    assert cli.elastic_options(args, cli.build_config(args, env={})) is None
    argv = ["-np", "3", "--min-np", "2", "--blacklist-cooldown-range", "10", "100", "x"]
    args = _parser().parse_args(argv)
    assert cli.elastic_options(args, cli.build_config(args, env={})).cooldown_range == (10, 100)


def test_missing_np_and_command() -> None:
    with pytest.raises(ValueError, match="-np is required"):
        _config(["x"])
    with pytest.raises(ValueError, match="no command"):
        _config(["-np", "2"])


def test_hosts_and_hostfile_are_exclusive(capsys) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["-np", "1", "-H", "a:1", "--hostfile", "f", "x"])
    assert "not allowed with" in capsys.readouterr().err


def test_help_is_grouped_with_examples(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = capsys.readouterr().out
    for title in ("general:", "hosts:", "ssh:", "controller:", "tunables:", "timeline:"):
        assert title in out
    assert out.count("example: hora run") >= 8


def test_top_level_help_lists_subcommands(capsys) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in cli.SUBCOMMANDS)
    assert cli.main(["frobnicate"]) == 2


def test_bad_host_string_exits_with_clear_error(caplog) -> None:
    code = cli.command(_parser().parse_args(["-np", "2", "-H", "a:x", "true"]))
    assert code == 2
    assert "slot count 'x'" in caplog.text


def test_docs_name_every_knob_flag_and_unsupported_flag() -> None:
    from pathlib import Path

    from hora.settings import KNOBS

    text = (Path(__file__).parents[3] / "docs" / "launch.md").read_text()
    flags = [k.flag for k in KNOBS if k.flag] + list(cli.NO_EFFECT) + list(cli.REFUSED)
    missing = [f for f in flags if f"`{f}`" not in text and f"`--[no-]{f[2:]}`" not in text]
    assert missing == []
