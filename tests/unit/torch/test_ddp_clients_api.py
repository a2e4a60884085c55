"""hora.torch.lightning.HoraEnvironment and hora.torch.accelerate.accelerator() in one process:
what they read from hora's environment and the errors they give before any rank starts (the
trainings at np=2 are tests/integration/test_ddp_clients.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

pytest.importorskip("lightning_fabric")
pytest.importorskip("accelerate")

# imported before any test sets hora's variables: importing registers the backend and, under
# `hora run`, would fill torch's variables in this process for good
from accelerate.utils import InitProcessGroupKwargs  # noqa: E402

from hora.torch.accelerate import accelerator  # noqa: E402
from hora.torch.lightning import HoraEnvironment  # noqa: E402

JOB = {"HORA_RANK": "3", "HORA_SIZE": "4", "HORA_LOCAL_RANK": "1", "HORA_LOCAL_SIZE": "2",
       "HORA_CROSS_RANK": "1", "HORA_CROSS_SIZE": "2", "HORA_RENDEZVOUS_ADDR": "10.0.0.1",
       "HORA_RENDEZVOUS_PORT": "4000"}  # fmt: skip


@pytest.fixture
def hora_run(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The environment `hora run` gives rank 3 of 4, two hosts of two."""
    for name in ("RANK", "SIZE"):
        monkeypatch.delenv(f"HOROVOD_{name}", raising=False)
    for name, value in JOB.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29511")
    return monkeypatch


def test_hora_environment_is_hora_runs_identity(hora_run: pytest.MonkeyPatch) -> None:
    assert HoraEnvironment.detect()
    env = HoraEnvironment()
    assert env.creates_processes_externally
    assert (env.global_rank(), env.world_size(), env.local_rank(), env.node_rank()) == (3, 4, 1, 1)
    assert (env.main_address, env.main_port) == ("10.0.0.7", 29511)
    env.set_global_rank(0)  # Lightning's own count changes nothing: the launcher's stands
    env.set_world_size(8)
    assert (env.global_rank(), env.world_size()) == (3, 4)
    env.validate_settings(num_devices=2, num_nodes=2)
    with pytest.raises(ValueError, match=r"devices=4 x num_nodes=2 = 8 processes.*started 4"):
        env.validate_settings(num_devices=4, num_nodes=2)


def test_hora_environment_across_hosts_needs_master_addr(hora_run: pytest.MonkeyPatch) -> None:
    hora_run.delenv("MASTER_ADDR")
    with pytest.raises(RuntimeError, match="MASTER_ADDR=<host> hora run"):
        HoraEnvironment().main_address  # noqa: B018 - the property raises


def test_hora_environment_outside_hora_run_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    for prefix in ("HORA", "HOROVOD"):
        monkeypatch.delenv(f"{prefix}_RANK", raising=False)
    assert not HoraEnvironment.detect()
    with pytest.raises(RuntimeError, match="not started by `hora run`"):
        HoraEnvironment()


def test_accelerator_refuses_another_backend_before_starting_anything() -> None:
    with pytest.raises(ValueError, match="backend='gloo'.*asks for another backend"):
        accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    assert not dist.is_initialized()


def test_accelerator_refuses_a_group_of_another_backend() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="default group runs 'gloo', not hora"):
            accelerator()
    finally:
        dist.destroy_process_group()
