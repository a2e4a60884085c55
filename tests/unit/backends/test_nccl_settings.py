"""Horovod's GPU-backend variables: HOROVOD_GPU_OPERATIONS and the per-op HOROVOD_GPU_<OP>,
their spellings and checks, and the backend they choose."""

from __future__ import annotations

import pytest

from hora import settings
from hora.backends import registry
from hora.settings import SettingError, load

PER_OP = ["ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER"]


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend PyTorch sees a GPU (selection only; no backend is built)."""
    monkeypatch.setattr(registry, "_gpu_present", lambda: True)


@pytest.mark.parametrize("op", PER_OP)
@pytest.mark.parametrize("value", ["NCCL", "nccl", "Nccl"])
def test_each_per_op_variable_names_the_gpu_backend(op: str, value: str, gpu: None) -> None:
    s = load({f"HOROVOD_GPU_{op}": value})
    assert getattr(s, f"gpu_{op.lower()}") == value
    assert s.gpu_operations == value and s.origin["gpu_operations"] == f"HOROVOD_GPU_{op}"
    assert registry.select(s) == "nccl"


@pytest.mark.parametrize("op", PER_OP)
def test_per_op_variables_are_ignored_without_a_gpu(
    op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "_gpu_present", lambda: False)
    assert registry.select(load({f"HOROVOD_GPU_{op}": "NCCL"})) == "native"


def test_agreeing_variables_are_accepted(gpu: None) -> None:
    env = {"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_GPU_ALLREDUCE": "nccl"}
    env |= {f"HOROVOD_GPU_{op}": "NCCL" for op in PER_OP[1:]}
    s = load(env)
    assert s.gpu_operations == "NCCL" and registry.select(s) == "nccl"
    assert registry.select(load({"HOROVOD_GPU_ALLREDUCE": "MPI", "HOROVOD_GPU_ALLTOALL": "mpi"})) \
        == "mpi"  # fmt: skip


def test_a_cpu_backend_still_runs_everything(gpu: None) -> None:
    s = load({"HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GPU_BROADCAST": "NCCL"})
    assert registry.select(s) == "gloo"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"HOROVOD_GPU_ALLREDUCE": "NCCL", "HOROVOD_GPU_BROADCAST": "MPI"},
            "HOROVOD_GPU_BROADCAST=MPI differs from HOROVOD_GPU_ALLREDUCE=NCCL: hora runs every "
            "collective of a job through one backend",
        ),
        (
            {"HOROVOD_GPU_OPERATIONS": "MPI", "HORA_GPU_REDUCESCATTER": "nccl"},
            "HORA_GPU_REDUCESCATTER=NCCL differs from HOROVOD_GPU_OPERATIONS=MPI",
        ),
    ],
)
def test_mixed_gpu_backends_are_refused_naming_both(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingError, match=message.replace("(", r"\(")) as info:
        load(env)
    assert "HOROVOD_ALLOW_MIXED_GPU_IMPL" in str(info.value)  # says what Horovod does too


@pytest.mark.parametrize("op", PER_OP)
def test_bad_values_name_the_variable_and_the_choices(op: str) -> None:
    with pytest.raises(SettingError, match=f"HOROVOD_GPU_{op}=bogus: expected one of nccl, mpi"):
        load({f"HOROVOD_GPU_{op}": "bogus"})


def test_ddl_is_answered_as_not_built() -> None:
    with pytest.raises(SettingError, match="HOROVOD_GPU_ALLREDUCE=DDL: DDL .*not built"):
        load({"HOROVOD_GPU_ALLREDUCE": "DDL"})


def test_hora_name_wins_and_the_settings_travel_to_workers() -> None:
    s = load({"HOROVOD_GPU_ALLGATHER": "mpi", "HORA_GPU_ALLGATHER": "nccl"})
    assert s.gpu_allgather == "nccl" and s.gpu_operations == "nccl"
    again = load(settings.to_env(s))
    assert (again.gpu_allgather, again.gpu_operations) == ("nccl", "nccl")
