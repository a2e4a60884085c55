"""The settings of :mod:`hora.ray`'s executors (Horovod's ``RayExecutor.create_settings``).

Plain data and a pure function; thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hora.settings import Settings


@dataclass(frozen=True)
class RaySettings:
    """What :meth:`RayExecutor.create_settings` returns: Horovod's Ray settings plus the knobs.

    ``timeout_s`` bounds the actors' start-up; ``placement_group_timeout_s`` how long Ray may
    take to reserve the workers' resources; ``nics`` the interfaces hora's data connections use.
    ``ssh_identity_file`` and ``ssh_str`` are accepted for Horovod's signature; a Ray job starts
    no ssh sessions. ``knobs``: the ``HOROVOD_*``/``HORA_*`` settings the workers get (default:
    read from this process's environment when the executor starts).
    """

    timeout_s: float = 30.0
    ssh_identity_file: str | None = None
    ssh_str: str | None = None
    placement_group_timeout_s: float = 100.0
    nics: tuple[str, ...] = ()
    knobs: Settings | None = field(default=None, compare=False)


def create_settings(
    timeout_s: float = 30,
    ssh_identity_file: str | None = None,
    ssh_str: str | None = None,
    placement_group_timeout_s: float = 100,
    nics: Sequence[str] | str | None = None,
) -> RaySettings:
    """Horovod's ``RayExecutor.create_settings``: the settings to pass to an executor."""
    if timeout_s <= 0 or placement_group_timeout_s <= 0:
        raise ValueError(
            f"timeout_s={timeout_s} and placement_group_timeout_s="
            f"{placement_group_timeout_s}: both must be positive seconds"
        )
    names = [nics] if isinstance(nics, str) else list(nics or ())
    interfaces = tuple(n.strip() for text in names for n in text.split(",") if n.strip())
    return RaySettings(
        timeout_s=float(timeout_s),
        ssh_identity_file=ssh_identity_file,
        ssh_str=ssh_str,
        placement_group_timeout_s=float(placement_group_timeout_s),
        nics=interfaces,
    )
