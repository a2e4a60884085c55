"""Who this process is: rank, size, local and cross ranks, and where the rendezvous store is.

Read from the environment the launcher sets (``HORA_*`` or Horovod's ``HOROVOD_*`` names).
A process started with none of it is a world of one. Called once by ``init()`` in the user
thread.
"""

from __future__ import annotations

import os
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
    source: str = "single"  # hora, mpi, slurm, torchrun or single

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


def detect(env: Mapping[str, str] | None = None) -> Identity:
    """The identity given by ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    if env_lookup(env, "RANK") is not None:
        return _from_hora(env)
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
