"""What workers inherit: Horovod's exclusions, tunables, identity, store, backend."""

from __future__ import annotations

from hora.launch.hosts import assign_ranks, parse_hosts
from hora.launch.workerenv import exportable, job_env, rank_env
from hora.settings import load

BASE = {
    "PATH": "/usr/bin",
    "MY_VAR": "x y 'z'",
    "BASH_FUNC_module%%": "() { :; }",
    "OLDPWD": "/old",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "NVIDIA_CUDA_VISIBLE_DEVICES": "0",
    "HORA_SECRET_KEY": "ab",
    "HOROVOD_SECRET_KEY": "cd",
    "HOROVOD_RANK": "7",
    "HOROVOD_FUSION_THRESHOLD": "5",
    "OMPI_COMM_WORLD_RANK": "0",
    "OMPI_MCA_ess": "singleton",
    "PMIX_NAMESPACE": "123",
    "OMPI_MCA_btl_tcp_if_include": "eth0",
}


def test_exclusions() -> None:
    env = exportable(BASE)
    assert env["PATH"] == "/usr/bin" and env["MY_VAR"] == "x y 'z'"
    assert env["OMPI_MCA_btl_tcp_if_include"] == "eth0"  # MPI settings pass; MPI job ids do not
    kept = {"PATH", "MY_VAR", "HOROVOD_FUSION_THRESHOLD", "OMPI_MCA_btl_tcp_if_include"}
    assert set(env) == kept


def test_job_and_rank_env() -> None:
    common = job_env(BASE, load(BASE), "gloo", 4321, ["eth0", "eth1"])
    slot = assign_ranks(parse_hosts("a:1,b:2"), 3)[2]
    env = rank_env(common, slot, "10.0.0.1")
    assert env["HORA_RANK"] == env["HOROVOD_RANK"] == "2"
    assert env["HORA_LOCAL_RANK"] == "1" and env["HORA_CROSS_SIZE"] == "1"
    assert env["HORA_RENDEZVOUS_ADDR"] == env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.0.0.1"
    assert env["HORA_RENDEZVOUS_PORT"] == env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "4321"
    assert env["HORA_CONTROLLER"] == env["HOROVOD_CPU_OPERATIONS"] == "gloo"
    assert env["HORA_GLOO_IFACE"] == "eth0" and env["NCCL_SOCKET_IFNAME"] == "eth0,eth1"
    assert env["HORA_FUSION_THRESHOLD"] == env["HOROVOD_FUSION_THRESHOLD"] == "5"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert "HORA_SECRET_KEY" not in env and "HOROVOD_SECRET_KEY" not in env


def test_native_backend_sets_no_controller() -> None:
    env = job_env({}, load({}), "native", 1, [])
    assert "HORA_CONTROLLER" not in env and "HORA_GLOO_IFACE" not in env


def test_torch_huge_pages_by_default_user_value_kept() -> None:
    assert job_env({}, load({}), "native", 1, [])["THP_MEM_ALLOC_ENABLE"] == "1"
    mine = {"THP_MEM_ALLOC_ENABLE": "0"}
    assert job_env(mine, load(mine), "native", 1, [])["THP_MEM_ALLOC_ENABLE"] == "0"
