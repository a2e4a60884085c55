"""Every knob once: HORA_* over HOROVOD_*, types, errors, export to workers."""

from __future__ import annotations

import pytest

from hora import settings


def test_hora_names_win_over_horovod_names() -> None:
    s = settings.load(
        {
            "HOROVOD_FUSION_THRESHOLD": "1",
            "HORA_FUSION_THRESHOLD": "2",
            "HOROVOD_CYCLE_TIME": "3.5",
            "HOROVOD_TIMELINE": "t.json",
        }
    )
    assert (s.fusion_threshold, s.cycle_time_ms, s.timeline) == (2, 3.5, "t.json")
    assert s.explicit == {"fusion_threshold", "cycle_time_ms", "timeline"}


def test_defaults_are_horovods() -> None:
    s = settings.load({})
    assert s.fusion_threshold == 128 << 20 and s.cycle_time_ms == 1.0
    assert s.cache_capacity == 1024 and s.stall_check_time_seconds == 60
    assert s.stall_shutdown_time_seconds == 0 and not s.explicit


def test_bad_values_say_which_variable() -> None:
    # the variable that was actually set
    with pytest.raises(ValueError, match="HOROVOD_CACHE_CAPACITY='lots'"):
        settings.load({"HOROVOD_CACHE_CAPACITY": "lots"})
    with pytest.raises(ValueError, match="HORA_HIERARCHICAL_ALLREDUCE='maybe'"):
        settings.load({"HORA_HIERARCHICAL_ALLREDUCE": "maybe"})


def test_gpu_allreduce_selects_gpu_operations() -> None:
    assert settings.load({"HOROVOD_GPU_ALLREDUCE": "NCCL"}).gpu_operations == "NCCL"


def test_to_env_round_trips() -> None:
    s = settings.load({"HORA_FUSION_THRESHOLD": "7", "HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    env = settings.to_env(s)
    assert env["HOROVOD_FUSION_THRESHOLD"] == "7" and env["HORA_TIMELINE_MARK_CYCLES"] == "1"
    again = settings.load(env)
    assert again.fusion_threshold == 7 and again.timeline_mark_cycles is True


def test_settings_fields_and_knobs_agree() -> None:
    import dataclasses

    fields = {f.name for f in dataclasses.fields(settings.Settings)} - {"explicit", "origin"}
    assert fields == {k.field for k in settings.KNOBS}
    for k in settings.KNOBS:
        assert getattr(settings.Settings(), k.field) == k.default, k.field


def test_every_knob_default_is_valid() -> None:
    settings.validate(settings.Settings())
    for k in settings.KNOBS:
        assert settings.problem(k, k.default) is None, k.field


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"HOROVOD_FUSION_THRESHOLD": "-1"}, "HOROVOD_FUSION_THRESHOLD=-1: must be >= 0"),
        ({"HOROVOD_CYCLE_TIME": "-3"}, "HOROVOD_CYCLE_TIME=-3.0: must be >= 0"),
        ({"HOROVOD_CACHE_CAPACITY": "-2"}, "HOROVOD_CACHE_CAPACITY=-2: must be >= 0"),
        ({"HOROVOD_LOG_LEVEL": "LOUD"}, "expected one of TRACE, DEBUG, INFO, WARNING"),
        ({"HORA_CPU_BIND": "foo"}, "HORA_CPU_BIND=foo: expected one of auto, crowded, none"),
        ({"HOROVOD_CONTROLLER": "zmq"}, "HOROVOD_CONTROLLER=zmq: expected one of"),
        ({"HOROVOD_GPU_OPERATIONS": "ddl"}, "DDL (IBM DDL) support is not built"),
        ({"HOROVOD_GLOO_TIMEOUT_SECONDS": "0"}, "must be > 0"),
    ],
)
def test_bad_ranges_and_choices_name_the_variable(env, message) -> None:
    with pytest.raises(settings.SettingError) as info:
        settings.load(env)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_choices_ignore_case_and_paths_are_checked(tmp_path) -> None:
    s = settings.load({"HOROVOD_LOG_LEVEL": "debug", "HOROVOD_CPU_OPERATIONS": "GLOO"})
    assert s.log_level == "debug"
    ok = settings.load({"HOROVOD_TIMELINE": str(tmp_path / "t.json")})
    settings.check_paths(ok)
    settings.check_paths(settings.load({"HOROVOD_TIMELINE": "DYNAMIC"}))
    bad = settings.load({"HOROVOD_AUTOTUNE_LOG": str(tmp_path / "missing" / "a.csv")})
    with pytest.raises(settings.SettingError, match="HOROVOD_AUTOTUNE_LOG=.*does not exist"):
        settings.check_paths(bad)
    with pytest.raises(settings.SettingError, match="is a folder"):
        settings.check_paths(settings.load({"HORA_TIMELINE": str(tmp_path)}))
