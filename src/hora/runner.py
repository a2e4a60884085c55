"""``hora.run`` (Horovod's ``horovod.run`` and ``horovod.runner.run``): run a Python function
on every rank of a new job and return the results ordered by rank.

The parameters are ``horovod.run``'s; given ``min_num_proc``, ``max_num_proc`` or
``host_discovery_script`` the job is elastic (:mod:`hora.elastic.driver`), else static
(:class:`hora.launch.job.Job`); :func:`hora.launch.api.run_on_job` does the rest. This module
sits above the launcher and the elastic driver, so that neither imports the other. Runs in the
caller's thread; each call is its own job.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from hora.launch.api import run_on_job
from hora.launch.config import LaunchConfig
from hora.launch.hosts import parse_hostfile, parse_hosts
from hora.launch.job import Job
from hora.settings import Settings, env_lookup, load


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = 1,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: tuple[int, int] | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    host_discovery_script: str | None = None,
    start_timeout: float | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: bool | int | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interface: str | Iterable[str] | None = None,
    network_interfaces: Sequence[str] | None = None,
    executable: str | None = None,
    np: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    *,
    ssh_config_file: str | None = None,
    env: Mapping[str, str] | None = None,
    settings: Settings | None = None,
    prefix_output_with_timestamp: bool = False,
    elastic_timeout: float | None = None,
) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` ranks; return the results ordered by rank.

    The parameters are ``horovod.run``'s, with its names, order and meanings: ``hosts`` is
    ``-H`` syntax (``"server1:2,server2:2"``), ``hostfile`` a hostfile path (neither:
    ``num_proc`` ranks on this host); ``network_interface`` names interfaces (comma-separated
    or a list; Horovod's deprecated form), ``network_interfaces`` lists them; ``np``, ``min_np``
    and ``max_np`` are Horovod's deprecated names. Given
    ``min_num_proc``, ``max_num_proc`` or ``host_discovery_script``, the job is elastic (as
    ``hora run --min-np/--max-np/--host-discovery-script``; ``slots``, ``reset_limit`` and
    ``cooldown_range`` are its ``--slots-per-host``, ``--reset-limit`` and
    ``--blacklist-cooldown-range``), and the results are those of the ranks of its last round.
    ``disable_cache`` is accepted; hora caches no checks.

    hora's own keyword-only extras follow: ``ssh_config_file`` (ssh -F), ``env`` (the workers'
    base environment; default this process's), ``settings`` (the knobs; default read from
    ``env``), ``prefix_output_with_timestamp`` and ``elastic_timeout``.

    Raises ValueError for contradictory arguments or a bad setting (before anything starts),
    and LaunchError when a rank fails (chained to its exception when it raised one) or the job
    cannot start.
    """
    if np is not None:
        warnings.warn("np is deprecated, use num_proc instead", DeprecationWarning, stacklevel=2)
        if num_proc in (None, 1):
            num_proc = np
    if min_np is not None:
        warnings.warn("min_np is deprecated, use min_num_proc", DeprecationWarning, stacklevel=2)
        min_num_proc = min_num_proc if min_num_proc is not None else min_np
    if max_np is not None:
        warnings.warn("max_np is deprecated, use max_num_proc", DeprecationWarning, stacklevel=2)
        max_num_proc = max_num_proc if max_num_proc is not None else max_np
    count = 1 if num_proc is None else int(num_proc)
    if hosts is not None and hostfile is not None:
        raise ValueError("Argument hosts and hostfile only allow one provided.")
    if use_gloo and use_mpi:
        raise ValueError("Argument use_gloo and use_mpi only allow one set True.")
    host_list = parse_hosts(hosts) if hosts else parse_hostfile(hostfile) if hostfile else []
    base_env = dict(env) if env is not None else None
    if start_timeout is None:
        raw = env_lookup(os.environ if env is None else env, "START_TIMEOUT", "30") or "30"
        try:
            start_timeout = float(raw)
        except ValueError:
            raise ValueError(f"HOROVOD_START_TIMEOUT={raw!r}: expected seconds") from None
    nics = [network_interface] if isinstance(network_interface, str) else network_interface
    interfaces = [*(network_interfaces or ()), *(nics or ())]
    config = LaunchConfig(
        command=[executable or sys.executable, "-m", "hora.launch.task"],
        np=count,
        hosts=host_list,
        backend="mpi" if use_mpi else "gloo" if use_gloo else "native",
        ssh_port=ssh_port,
        ssh_identity_file=ssh_identity_file,
        ssh_config_file=ssh_config_file,
        network_interfaces=list(
            dict.fromkeys(n.strip() for text in interfaces for n in text.split(",") if n.strip())
        ),
        start_timeout=float(start_timeout),
        verbose=bool(verbose),
        output_filename=output_filename,
        prefix_timestamp=prefix_output_with_timestamp,
        disable_cache=bool(disable_cache),
        mpi_args=mpi_args or "",
        settings=settings if settings is not None else load(env),
        env=base_env,
    )
    if min_num_proc is None and max_num_proc is None and not host_discovery_script:
        return run_on_job(Job(config), func, args, kwargs)
    from hora.elastic.driver import ElasticJob, ElasticOptions

    timeout = elastic_timeout if elastic_timeout is not None else config.settings.elastic_timeout
    options = ElasticOptions(
        min_np=count if min_num_proc is None else int(min_num_proc),
        max_np=max_num_proc,
        host_discovery_script=host_discovery_script,
        slots_per_host=slots,
        elastic_timeout=timeout,
        reset_limit=reset_limit,
        cooldown_range=None if cooldown_range is None else tuple(cooldown_range),
    )
    return run_on_job(ElasticJob(config, options), func, args, kwargs, elastic=True)
