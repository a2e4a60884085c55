"""The ``mpirun`` command ``hora run --mpi`` runs, built the way Horovod builds it (Open MPI).

``mpirun --allow-run-as-root --tag-output -np N -H h1:2,h2:2 -bind-to none -map-by slot
[-mca btl_tcp_if_include NICS] [-mca plm_rsh_args ...] -x NAME ... [mpi args] command``.
Every variable is forwarded by name (``-x NAME``), never by value, so the job secret stays off
the command line; mpirun reads the values from its own environment. Pure functions; thread-safe.
"""

from __future__ import annotations

import shlex
import shutil
from collections.abc import Mapping

from hora.errors import LaunchError
from hora.launch.config import LaunchConfig
from hora.launch.hosts import SlotInfo
from hora.launch.ssh import SshOptions


def find_mpirun() -> str:
    path = shutil.which("mpirun") or shutil.which("mpiexec")
    if path is None:
        raise LaunchError(
            "--mpi: no mpirun on PATH. Install Open MPI (e.g. apt-get install openmpi-bin) or "
            "run without --mpi to use hora's own launcher"
        )
    return path


def command(
    config: LaunchConfig,
    slots: list[SlotInfo],
    env: Mapping[str, str],
    ssh_options: SshOptions,
    interfaces: list[str],
    mpirun: str | None = None,
) -> list[str]:
    """The full mpirun argv for ``config``; ``env`` names the variables to forward."""
    per_host: dict[str, int] = {}
    for slot in slots:
        per_host[slot.hostname] = per_host.get(slot.hostname, 0) + 1
    argv = [
        mpirun or find_mpirun(),
        "--allow-run-as-root",
        "--tag-output",
        "-np",
        str(config.np),
        "-H",
        ",".join(f"{h}:{n}" for h, n in per_host.items()),
    ]
    # --binding-args replaces the default placement: ranks in slot order, not bound
    argv += shlex.split(config.binding_args) or ["-bind-to", "none", "-map-by", "slot"]
    if interfaces:
        argv += ["-mca", "btl_tcp_if_include", ",".join(interfaces)]
    if config.tcp_flag:  # --tcp: Open MPI's TCP path only, as horovodrun asks for it
        argv += ["-mca", "pml", "ob1", "-mca", "btl", "^openib"]
    rsh = ssh_options.rsh_args()
    if rsh:
        argv += ["-mca", "plm_rsh_args", rsh]
    if config.output_filename:
        argv += ["--output-filename", config.output_filename]
    for name in env:
        argv += ["-x", name]
    argv += shlex.split(config.mpi_args)
    return argv + list(config.command)
