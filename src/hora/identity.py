"""Who this process is: rank, size, local and cross ranks, and where the rendezvous store is.

Read from the environment, trying in order:

1. ``hora run`` (``HORA_*`` or Horovod's ``HOROVOD_*`` names): the launcher hosts the store.
2. ``mpirun``/``mpiexec``: Open MPI (``OMPI_COMM_WORLD_*``) or MPICH/Hydra (``PMI_RANK``...).
3. torchrun-style variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``...), as
   torchrun and Kubernetes training operators set them; in a Kubernetes indexed Job, the pod's
   ``JOB_COMPLETION_INDEX`` (which Kubernetes sets) stands for ``RANK``.
4. Slurm's ``srun`` (``SLURM_PROCID`` within a job step).

Without a launcher (2-4), rank 0 hosts the store itself (``host_store=True``) at the address the
others are told: ``HORA_RENDEZVOUS_ADDR``/``HORA_RENDEZVOUS_PORT`` when set, else
``MASTER_ADDR``/``MASTER_PORT`` (the port + 1 under torchrun, whose own store holds
``MASTER_PORT``), else for one-node mpirun jobs 127.0.0.1, and for Slurm the first node of the
step; the port, when none is given, is derived from the job's id. A process started with none of
this is a world of one. Called once by ``init()`` in the user thread.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from hora.settings import env_lookup


@dataclass(frozen=True)
class Identity:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    hostname: str = ""
    rendezvous_addr: str | None = None
    rendezvous_port: int | None = None
    secret: bytes | None = None
    host_store: bool = False  # True: this rank must start the rendezvous server itself
    source: str = "single"  # hora, mpi, slurm, torchrun, kubernetes or single

    @property
    def is_single(self) -> bool:
        return self.size == 1 and self.rendezvous_addr is None


def _int(env: Mapping[str, str], suffix: str, default: int) -> int:
    raw = env_lookup(env, suffix)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"HORA_{suffix}/HOROVOD_{suffix}={raw!r} is not an integer") from None


def _var(env: Mapping[str, str], names: tuple[str, ...], default: int | None = None) -> int:
    """The first of ``names`` set in ``env``, as an integer."""
    for name in names:
        raw = env.get(name)
        if raw not in (None, ""):
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not an integer") from None
    if default is None:
        raise ValueError(f"none of {', '.join(names)} is set")
    return default


def detect(env: Mapping[str, str] | None = None) -> Identity:
    """The identity given by ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    if env_lookup(env, "RANK") is not None:
        return _from_hora(env)
    if "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        return _from_mpi(env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "JOB_COMPLETION_INDEX" in env and "WORLD_SIZE" in env:
        return _from_torchrun(env, "JOB_COMPLETION_INDEX", "kubernetes")
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return _from_slurm(env)
    return Identity(hostname=socket.gethostname())


def _from_hora(env: Mapping[str, str]) -> Identity:
    rank = _int(env, "RANK", 0)
    size = _int(env, "SIZE", 1)
    if not 0 <= rank < size:
        raise ValueError(f"HORA_RANK={rank} is outside [0, HORA_SIZE={size})")
    addr = env_lookup(env, "RENDEZVOUS_ADDR") or env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    port_raw = env_lookup(env, "RENDEZVOUS_PORT") or env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    secret_hex = env_lookup(env, "SECRET_KEY")
    if size > 1 and (not addr or not port_raw):
        raise ValueError(
            f"HORA_SIZE={size} but HORA_RENDEZVOUS_ADDR/HORA_RENDEZVOUS_PORT are not set: start "
            "multi-process jobs with `hora run -np N ...`, or set the rendezvous variables"
        )
    return Identity(
        rank=rank,
        size=size,
        local_rank=_int(env, "LOCAL_RANK", 0),
        local_size=_int(env, "LOCAL_SIZE", 1),
        cross_rank=_int(env, "CROSS_RANK", 0),
        cross_size=_int(env, "CROSS_SIZE", 1),
        hostname=env_lookup(env, "HOSTNAME") or socket.gethostname(),
        rendezvous_addr=addr or None,
        rendezvous_port=int(port_raw) if port_raw else None,
        secret=bytes.fromhex(secret_hex) if secret_hex else None,
        source="hora",
    )


def _job_secret(env: Mapping[str, str], job_vars: tuple[str, ...]) -> bytes:
    """``HORA_SECRET_KEY`` when set; otherwise a key derived from the job's identifying variables.

    The derived key is weaker than a launcher's random one: anyone who can learn those variables
    (the job id, the master address, ...) can compute it. It keeps stray processes of other jobs
    out, not a determined local user; set ``HORA_SECRET_KEY`` (the same hex value on every rank)
    where that matters.
    """
    secret_hex = env_lookup(env, "SECRET_KEY")
    if secret_hex:
        return bytes.fromhex(secret_hex)
    material = "\0".join(f"{k}={env.get(k, '')}" for k in job_vars)
    return hashlib.sha256(b"hora-derived-secret\0" + material.encode()).digest()


# Ports a job derives rather than asks the kernel for: below Linux's ephemeral range (32768-60999
# by default), so that no socket another process bound to port 0, or connected from, can hold
# one (hora_torch_plugin.DERIVED_PORTS, torch's store port under hora run, is the same range)
DERIVED_PORTS = range(20000, 32768)


def _derived_port(env: Mapping[str, str], job_vars: tuple[str, ...]) -> int:
    """A port that every rank of the job computes alike from its job id, in
    :data:`DERIVED_PORTS`."""
    material = "\0".join(env.get(k, "") for k in job_vars).encode()
    digest = int.from_bytes(hashlib.sha256(material).digest()[:4], "big")
    return DERIVED_PORTS[digest % len(DERIVED_PORTS)]


def _store(
    env: Mapping[str, str], job_vars: tuple[str, ...], default_addr: str | None, what: str
) -> tuple[str, int]:
    """The store address of a launcher-less job: explicit variables, else ``default_addr``."""
    addr = env_lookup(env, "RENDEZVOUS_ADDR") or env.get("MASTER_ADDR") or default_addr
    if not addr:
        raise ValueError(
            f"{what} spans several hosts but no store address is set: export MASTER_ADDR "
            "(the host of rank 0) and MASTER_PORT to every rank, or use `hora run`"
        )
    port_raw = env_lookup(env, "RENDEZVOUS_PORT") or env.get("MASTER_PORT")
    port = int(port_raw) if port_raw else _derived_port(env, job_vars)
    return addr, port


_OMPI_JOB = ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_hnp_uri", "PMIX_NAMESPACE")
_MPICH_JOB = ("PMI_KVSNAME", "PMI_PORT", "PMI_FD", "PMI_SIZE", "HYDI_CONTROL_FD")


def _from_mpi(env: Mapping[str, str]) -> Identity:
    """Open MPI or MPICH. Cross ranks assume equal ranks per host filled in order."""
    if "OMPI_COMM_WORLD_RANK" in env:
        rank = _var(env, ("OMPI_COMM_WORLD_RANK",))
        size = _var(env, ("OMPI_COMM_WORLD_SIZE",))
        local_rank = _var(env, ("OMPI_COMM_WORLD_LOCAL_RANK",), 0)
        local_size = _var(env, ("OMPI_COMM_WORLD_LOCAL_SIZE",), 1)
        one_node = _var(env, ("OMPI_MCA_orte_num_nodes",), 0) == 1 or local_size == size
        job_vars: tuple[str, ...] = _OMPI_JOB
    else:
        rank = _var(env, ("PMI_RANK",))
        size = _var(env, ("PMI_SIZE",))
        local_rank = _var(env, ("MPI_LOCALRANKID",), 0)
        local_size = _var(env, ("MPI_LOCALNRANKS",), 1)
        one_node = local_size == size
        job_vars = _MPICH_JOB
    explicit = env_lookup(env, "RENDEZVOUS_ADDR")  # set by `hora run --mpi`
    addr, port = _store(env, job_vars, "127.0.0.1" if one_node else None, "this mpirun job")
    return _launcherless(
        env, "mpi", rank, size, local_rank, local_size, addr, port, job_vars, not explicit
    )


def _from_torchrun(
    env: Mapping[str, str], rank_var: str = "RANK", source: str = "torchrun"
) -> Identity:
    """torchrun's variables; a Kubernetes indexed Job's rank is ``JOB_COMPLETION_INDEX``."""
    rank = _var(env, (rank_var,))
    size = _var(env, ("WORLD_SIZE",))
    job_vars = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")
    if not env.get("MASTER_ADDR") and not env_lookup(env, "RENDEZVOUS_ADDR") and size > 1:
        raise ValueError(f"{rank_var} and WORLD_SIZE are set but MASTER_ADDR is not")
    addr, port = _store(env, job_vars, "127.0.0.1", f"this {source}-style job")
    if "TORCHELASTIC_RUN_ID" in env and not env_lookup(env, "RENDEZVOUS_PORT"):
        port += 1  # torchrun's own store listens on MASTER_PORT
    return _launcherless(
        env, source, rank, size, _var(env, ("LOCAL_RANK",), 0),
        _var(env, ("LOCAL_WORLD_SIZE",), 1), addr, port, job_vars, True,
    )  # fmt: skip


def _from_slurm(env: Mapping[str, str]) -> Identity:
    rank = _var(env, ("SLURM_PROCID",))
    size = _var(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"))
    local_rank = _var(env, ("SLURM_LOCALID",), 0)
    node = _var(env, ("SLURM_NODEID",), 0)
    tasks = expand_tasks_per_node(
        env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(size)
    )
    local_size = tasks[node] if node < len(tasks) else 1
    peers = [i for i, n in enumerate(tasks) if n > local_rank]
    job_vars = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEPID")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    first = first_slurm_host(nodelist) if nodelist else "127.0.0.1"
    addr, port = _store(env, job_vars, first, "this Slurm step")
    return Identity(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=peers.index(node) if node in peers else 0,
        cross_size=len(peers) or 1,
        hostname=socket.gethostname(),
        rendezvous_addr=addr,
        rendezvous_port=port,
        secret=_job_secret(env, job_vars),
        host_store=rank == 0,
        source="slurm",
    )


def _launcherless(
    env: Mapping[str, str],
    source: str,
    rank: int,
    size: int,
    local_rank: int,
    local_size: int,
    addr: str,
    port: int,
    job_vars: tuple[str, ...],
    rank0_hosts: bool,
) -> Identity:
    if not 0 <= rank < size:
        raise ValueError(f"{source}: rank {rank} is outside [0, {size})")
    uniform = local_size > 0 and size % local_size == 0
    return Identity(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=rank // local_size if uniform else 0,
        cross_size=size // local_size if uniform else 1,
        hostname=socket.gethostname(),
        rendezvous_addr=addr,
        rendezvous_port=port,
        secret=_job_secret(env, job_vars),
        host_store=rank0_hosts and rank == 0,
        source=source,
    )


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise ValueError(f"SLURM_TASKS_PER_NODE: cannot read {part!r} in {text!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``node[07-09,12],gpu1`` -> ``node07``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"SLURM_STEP_NODELIST: cannot read {nodelist!r}")
    prefix, ranges = match[1], match[2]
    if not ranges:
        return prefix
    return prefix + ranges.split(",", 1)[0].split("-", 1)[0]
