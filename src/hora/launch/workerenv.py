"""The environment each worker gets: the launcher's own (minus Horovod's exclusions), the
tunables, the rank's identity, the rendezvous address and the backend choice, plus
``TF_CPP_MIN_LOG_LEVEL=1`` where it is not set and the ``tf_logs`` knob is off, and
``THP_MEM_ALLOC_ENABLE=1`` where it is not set (:data:`TORCH_HUGE_PAGES`).

The secret is never part of it: :mod:`hora.launch.process` hands it over on the worker's stdin.
Pure functions, run by the launcher's main thread; thread-safe.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from hora.launch.hosts import SlotInfo
from hora.launch.quiet import worker_env_defaults
from hora.settings import Settings, to_env

# Never exported to workers (Horovod's rules, plus the job secret under every name).
_EXCLUDED = re.compile(r"^(BASH_FUNC_.*|OLDPWD|.*CUDA_VISIBLE_DEVICES|(HORA|HOROVOD)_SECRET_KEY)$")
# Identity variables of the launcher's own environment (a nested launch) are replaced, not kept;
# so is the launcher's own MPI job (it ran under mpirun, or imported mpi4py: an MPI singleton),
# which would make mpirun and the workers' MPI believe they belong to that job.
_IDENTITY = re.compile(
    r"^(HORA|HOROVOD)_(RANK|SIZE|LOCAL_RANK|LOCAL_SIZE|CROSS_RANK|CROSS_SIZE|HOSTNAME|"
    r"RENDEZVOUS_ADDR|RENDEZVOUS_PORT)$|^HOROVOD_GLOO_RENDEZVOUS_(ADDR|PORT)$"
    r"|^(PMIX_.*|PMI_.*|ORTE_.*|HYDI_.*|MPI_LOCALRANKID|MPI_LOCALNRANKS)$"
    r"|^OMPI_(COMM_WORLD_.*|APP_CTX_.*|UNIVERSE_SIZE|FIRST_RANKS|NUM_APP_CTX|FILE_LOCATION"
    r"|COMMAND|ARGV|MCA_ess|MCA_ess_base_.*|MCA_pmix|MCA_orte_.*)$"
)

# torch's CPU allocator puts tensors of 2 MiB and more on transparent huge pages when this is
# set (it reads it once, at its first allocation, so only the launcher can give it). Every pass
# over a large tensor then misses the TLB far less: at np=2 on one host a 64 MiB gradient's
# in-place allreduce took 11.0 ms against 14.4, and reading a 64 MiB tensor 6.0-6.4 ms against
# 9.4-11.3 (docs/settings.md). A user's own value, 0 included, is kept.
TORCH_HUGE_PAGES = {"THP_MEM_ALLOC_ENABLE": "1"}


def is_exportable(name: str) -> bool:
    """Whether the launcher's variable ``name`` is passed on to workers."""
    return not _EXCLUDED.match(name) and not _IDENTITY.match(name)


def exportable(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` that workers inherit."""
    return {k: v for k, v in env.items() if is_exportable(k)}


def job_env(
    base: Mapping[str, str],
    settings: Settings,
    backend: str,
    rendezvous_port: int,
    interfaces: list[str],
) -> dict[str, str]:
    """Variables common to every worker of a job (everything but identity and address)."""
    env = exportable(base)
    env.update(to_env(settings))
    for name, value in worker_env_defaults(settings.tf_logs).items():
        env.setdefault(name, value)  # TensorFlow's INFO lines hidden unless tf_logs
    for name, value in TORCH_HUGE_PAGES.items():
        env.setdefault(name, value)
    if backend in ("gloo", "mpi"):
        for prefix in ("HORA_", "HOROVOD_"):
            env[prefix + "CONTROLLER"] = backend
            env[prefix + "CPU_OPERATIONS"] = backend
    if interfaces:
        for name in ("HORA_GLOO_IFACE", "HOROVOD_GLOO_IFACE"):
            env.setdefault(name, interfaces[0])
        env.setdefault("NCCL_SOCKET_IFNAME", ",".join(interfaces))
    port = str(rendezvous_port)
    env["HORA_RENDEZVOUS_PORT"] = env["HOROVOD_GLOO_RENDEZVOUS_PORT"] = port
    env["PYTHONUNBUFFERED"] = "1"
    return env


def rank_env(common: Mapping[str, str], slot: SlotInfo, rendezvous_addr: str) -> dict[str, str]:
    """One worker's complete environment: ``common`` plus its identity and store address."""
    env = dict(common)
    env.update(slot.identity_env())
    env["HORA_RENDEZVOUS_ADDR"] = env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] = rendezvous_addr
    return env
