"""hora.run has horovod.run's parameters, and runs elastic jobs when asked for one."""

from __future__ import annotations

import inspect
import os
import warnings

import pytest

# horovod.run's parameters, in its order (horovod/runner/__init__.py, 0.28.1)
HOROVOD_RUN = [
    "func", "args", "kwargs", "num_proc", "min_num_proc", "max_num_proc", "slots",
    "reset_limit", "cooldown_range", "hosts", "hostfile", "host_discovery_script",
    "start_timeout", "ssh_port", "ssh_identity_file", "disable_cache", "output_filename",
    "verbose", "use_gloo", "use_mpi", "mpi_args", "network_interface", "network_interfaces",
    "executable", "np", "min_np", "max_np",
]  # fmt: skip


def test_signature_is_horovod_runs_with_hora_extras_after() -> None:
    import hora

    params = list(inspect.signature(hora.run).parameters.values())
    assert [p.name for p in params[: len(HOROVOD_RUN)]] == HOROVOD_RUN
    assert params[3].default == 1  # num_proc
    extras = params[len(HOROVOD_RUN) :]
    assert extras and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extras)
    assert {"env", "settings", "ssh_config_file"} <= {p.name for p in extras}
    assert "num_proc" in (hora.run.__doc__ or "")


def test_help_shows_the_parameters(capsys) -> None:
    import hora

    help(hora.run)
    out = capsys.readouterr().out
    first = out.split("\n\n")[1].split(" -> ")[0]  # the signature, before the docstring
    assert first.startswith("run(func")
    assert "min_num_proc" in first and "host_discovery_script" in first


def test_contradictions_are_refused_before_anything_starts() -> None:
    import hora

    with pytest.raises(ValueError, match="hosts and hostfile"):
        hora.run(print, hosts="a:1", hostfile="f")
    with pytest.raises(ValueError, match="use_gloo and use_mpi"):
        hora.run(print, use_gloo=True, use_mpi=True)
    with pytest.raises(ValueError, match="--cycle-time-ms|HOROVOD_CYCLE_TIME"):
        hora.run(print, env={**os.environ, "HOROVOD_CYCLE_TIME": "-1"})


def _make_who():
    # made inside a function so that cloudpickle sends it by value (workers cannot import
    # this test module)
    def who() -> tuple[int, int, str]:
        import os

        import hora as hvd

        hvd.init()
        return hvd.rank(), hvd.size(), os.environ.get("HORA_ELASTIC", "")

    return who


@pytest.mark.timeout(120)
def test_static_run_with_horovods_names() -> None:
    import hora

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = hora.run(_make_who(), np=2, network_interface="lo", disable_cache=True)
    assert results == [(0, 2, ""), (1, 2, "")]
    assert any("np is deprecated" in str(w.message) for w in caught)


@pytest.mark.timeout(150)
def test_min_and_max_num_proc_run_an_elastic_job() -> None:
    import hora

    results = hora.run(_make_who(), num_proc=2, min_num_proc=2, max_num_proc=2, hosts="localhost:2")
    assert results == [(0, 2, "1"), (1, 2, "1")]


@pytest.mark.timeout(150)
def test_host_discovery_script_runs_an_elastic_job(tmp_path) -> None:
    import hora

    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    results = hora.run(_make_who(), num_proc=2, host_discovery_script=str(script), slots=2)
    assert results == [(0, 2, "1"), (1, 2, "1")]
