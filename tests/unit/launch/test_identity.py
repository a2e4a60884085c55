"""hora.identity.detect from hora's, Open MPI's, MPICH's, torchrun's, Kubernetes' and Slurm's
variables."""

from __future__ import annotations

import os

import pytest

import hora_torch_plugin
from hora.identity import DERIVED_PORTS, detect, expand_tasks_per_node, first_slurm_host


def test_single_process() -> None:
    ident = detect({})
    assert ident.is_single and ident.source == "single"


def test_hora_variables() -> None:
    env = {"HORA_RANK": "1", "HORA_SIZE": "2", "HORA_RENDEZVOUS_ADDR": "h", "HORA_RENDEZVOUS_PORT":
           "9", "HORA_SECRET_KEY": "0a0b", "SLURM_PROCID": "5", "SLURM_STEP_ID": "0"}  # fmt: skip
    ident = detect(env)
    assert (ident.source, ident.rank, ident.secret, ident.host_store) == ("hora", 1, b"\n\x0b",
                                                                           False)  # fmt: skip


def test_torchrun_variables() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    env.update(MASTER_ADDR="node0", MASTER_PORT="29500", TORCHELASTIC_RUN_ID="job1")
    ident = detect(env)
    assert ident.source == "torchrun"
    assert (ident.rank, ident.size, ident.local_rank, ident.local_size) == (5, 8, 1, 4)
    assert (ident.cross_rank, ident.cross_size) == (1, 2)
    assert (ident.rendezvous_addr, ident.rendezvous_port) == ("node0", 29501)
    assert ident.host_store is False and ident.secret
    root = detect({**env, "RANK": "0", "LOCAL_RANK": "0"})
    assert root.host_store is True and root.secret == ident.secret
    other_job = detect({**env, "TORCHELASTIC_RUN_ID": "job2"})
    assert other_job.secret != ident.secret


def test_operator_style_variables_and_explicit_secret() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "pod0", "MASTER_PORT": "23456",
           "HORA_SECRET_KEY": "ff"}  # fmt: skip
    ident = detect(env)
    assert ident.rendezvous_port == 23456 and ident.secret == b"\xff" and ident.host_store
    assert (ident.local_rank, ident.local_size, ident.cross_rank, ident.cross_size) == (0, 1, 0, 2)
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        detect({"RANK": "0", "WORLD_SIZE": "2"})


def test_kubernetes_indexed_job_variables() -> None:
    # What a pod of deploy/kubernetes.yaml sees: Kubernetes sets JOB_COMPLETION_INDEX (and
    # HOSTNAME), the manifest sets WORLD_SIZE, MASTER_ADDR, MASTER_PORT and the secret.
    env = {"JOB_COMPLETION_INDEX": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "hora-0.hora",
           "MASTER_PORT": "29500", "HORA_SECRET_KEY": "0c", "HOSTNAME": "hora-2"}  # fmt: skip
    ident = detect(env)
    assert (ident.source, ident.rank, ident.size) == ("kubernetes", 2, 3)
    assert (ident.local_rank, ident.local_size, ident.cross_rank, ident.cross_size) == (0, 1, 2, 3)
    assert (ident.rendezvous_addr, ident.rendezvous_port) == ("hora-0.hora", 29500)
    assert ident.secret == b"\x0c" and not ident.host_store
    assert detect({**env, "JOB_COMPLETION_INDEX": "0"}).host_store
    # an operator's RANK wins over the index; the index alone is not a job of several
    assert detect({**env, "RANK": "1"}).rank == 1
    assert detect({"JOB_COMPLETION_INDEX": "4"}).is_single
    with pytest.raises(ValueError, match="JOB_COMPLETION_INDEX and WORLD_SIZE.*MASTER_ADDR"):
        detect({"JOB_COMPLETION_INDEX": "1", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="outside"):
        detect({**env, "JOB_COMPLETION_INDEX": "3"})


def test_slurm_variables() -> None:
    env = {"SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "5", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "3,2", "SLURM_STEP_ID": "0",
           "SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "gpu[07-08]"}  # fmt: skip
    ident = detect(env)
    assert ident.source == "slurm"
    assert (ident.rank, ident.size, ident.local_rank, ident.local_size) == (4, 5, 1, 2)
    assert (ident.cross_rank, ident.cross_size) == (1, 2)
    assert ident.rendezvous_addr == "gpu07" and 20000 <= (ident.rendezvous_port or 0) < 32768
    assert not ident.host_store
    assert detect({**env, "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                   "SLURM_NODEID": "0"}).host_store  # fmt: skip
    # A batch script (no step) is not a Slurm step: a world of one.
    assert detect({k: v for k, v in env.items() if k != "SLURM_STEP_ID"}).is_single


def test_slurm_variables_of_an_older_srun() -> None:
    # SLURM_NTASKS/SLURM_STEPID/SLURM_TASKS_PER_NODE/SLURM_JOB_NODELIST only, 2 nodes x 2 tasks
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_STEPID": "0", "SLURM_JOB_ID": "9",
           "SLURM_JOB_NODELIST": "node[01-02]"}  # fmt: skip
    ident = detect(env)
    assert (ident.source, ident.rank, ident.size, ident.local_rank, ident.local_size) == (
        "slurm", 3, 4, 1, 2)  # fmt: skip
    assert (ident.cross_rank, ident.cross_size, ident.rendezvous_addr) == (1, 2, "node01")


def test_slurm_helpers() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert first_slurm_host("node[07-09,12],gpu1") == "node07"
    assert first_slurm_host("login1,login2") == "login1"
    with pytest.raises(ValueError):
        expand_tasks_per_node("2(y3)")


def test_open_mpi_variables() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "OMPI_MCA_orte_num_nodes": "1", "OMPI_MCA_ess_base_jobid": "123"}  # fmt: skip
    ident = detect(env)
    assert (ident.source, ident.rank, ident.size, ident.local_rank) == ("mpi", 1, 2, 1)
    assert ident.rendezvous_addr == "127.0.0.1" and not ident.host_store
    assert detect({**env, "OMPI_COMM_WORLD_RANK": "0"}).host_store
    launched = detect({**env, "HORA_RENDEZVOUS_ADDR": "10.0.0.1", "HORA_RENDEZVOUS_PORT": "5",
                       "HORA_SECRET_KEY": "01", "OMPI_COMM_WORLD_RANK": "0"})  # fmt: skip
    assert launched.rendezvous_addr == "10.0.0.1" and launched.rendezvous_port == 5
    assert launched.secret == b"\x01" and not launched.host_store
    multi = {**env, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_MCA_orte_num_nodes": "2"}
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        detect(multi)
    ident = detect({**multi, "MASTER_ADDR": "n0"})
    assert (ident.cross_rank, ident.cross_size) == (0, 2)


def test_mpich_variables() -> None:
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
           "MASTER_ADDR": "n0", "PMI_KVSNAME": "kvs_1"}  # fmt: skip
    ident = detect(env)
    assert (ident.source, ident.rank, ident.cross_rank, ident.cross_size) == ("mpi", 2, 1, 2)


def test_derived_ports_stay_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port every rank derives (hora's store under Slurm, torch's store under ``hora run``)
    lies below Linux's ephemeral ports, where no socket bound to port 0 can already hold it;
    the ranks of one job derive the same one."""
    assert hora_torch_plugin.DERIVED_PORTS == DERIVED_PORTS  # one range, written where each runs
    seen_store, seen_torch = set(), set()
    for job in range(400):
        env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0",
               "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_ID": "0",
               "SLURM_JOB_ID": str(job), "SLURM_STEP_NODELIST": "n1"}  # fmt: skip
        port = detect(env).rendezvous_port
        assert port == detect({**env, "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}).rendezvous_port
        seen_store.add(port)
        # the plugin fills in os.environ: give it a copy, so nothing reaches later tests
        fresh = {"HORA_RANK": "0", "HORA_SIZE": "2", "HORA_SECRET_KEY": f"{job:064x}"}
        monkeypatch.setattr(os, "environ", fresh)
        seen_torch.add(int(hora_torch_plugin.torch_env_from_hora_run()["MASTER_PORT"]))
    for seen in (seen_store, seen_torch):
        assert all(20000 <= p < 32768 for p in seen), sorted(seen)[-3:]
        assert len(seen) > 350  # spread over the range, not a few ports
