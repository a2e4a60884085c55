"""``hora.run(func, ...)``: run a Python function on every rank and return the results.

For notebooks and for integrations (Ray, Spark): the function and its arguments are
cloudpickled into the job's rendezvous store, every rank runs ``python -m hora.launch.task``
(which fetches, calls and stores the outcome), and the list of results ordered by rank comes
back. A rank that raised makes ``run`` raise, chained to that rank's exception.

Runs in the caller's thread; each call is its own job, so concurrent calls from different
threads do not share state (output from both goes to the same console).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle

from hora.errors import LaunchError
from hora.launch.config import LaunchConfig
from hora.launch.hosts import parse_hostfile, parse_hosts
from hora.launch.job import Job, exit_status
from hora.launch.task import FUNC_KEY, RESULT_KEY
from hora.rendezvous.client import StoreClient
from hora.settings import Settings, load


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    np: int | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    *,
    num_proc: int | None = None,
    start_timeout: float = 30.0,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    ssh_config_file: str | None = None,
    network_interfaces: Sequence[str] = (),
    output_filename: str | None = None,
    verbose: bool = False,
    use_gloo: bool = False,
    use_mpi: bool = False,
    mpi_args: str = "",
    executable: str | None = None,
    env: Mapping[str, str] | None = None,
    settings: Settings | None = None,
    prefix_output_with_timestamp: bool = False,
) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``np`` ranks; return the results ordered by rank.

    ``hosts`` is ``-H`` syntax (``"server1:2,server2:2"``), ``hostfile`` a hostfile path;
    neither: ``np`` ranks on this host. ``num_proc`` is Horovod's name for ``np``. ``env`` is
    the workers' base environment (default: this process's). Raises LaunchError when a rank
    fails (chained to its exception when it raised one) or the job cannot start.
    """
    count = np if np is not None else num_proc if num_proc is not None else 1
    if hosts and hostfile:
        raise ValueError("give hosts or hostfile, not both")
    if use_gloo and use_mpi:
        raise ValueError("give use_gloo or use_mpi, not both")
    host_list = parse_hosts(hosts) if hosts else parse_hostfile(hostfile) if hostfile else []
    config = LaunchConfig(
        command=[executable or sys.executable, "-m", "hora.launch.task"],
        np=count,
        hosts=host_list,
        backend="mpi" if use_mpi else "gloo" if use_gloo else "native",
        ssh_port=ssh_port,
        ssh_identity_file=ssh_identity_file,
        ssh_config_file=ssh_config_file,
        network_interfaces=list(network_interfaces),
        start_timeout=start_timeout,
        verbose=verbose,
        output_filename=output_filename,
        prefix_timestamp=prefix_output_with_timestamp,
        mpi_args=mpi_args,
        settings=settings if settings is not None else load(env),
        env=dict(env) if env is not None else None,
    )
    payload = cloudpickle.dumps((func, tuple(args), dict(kwargs or {})))
    with (
        Job(config) as job,
        StoreClient("127.0.0.1", job.port, job.secret, timeout=start_timeout) as store,
    ):
        store.set(FUNC_KEY, payload)
        code = job.run()
        outcomes = _collect(store, count)
    return _results(outcomes, count, code, job.failure, use_mpi)


def _collect(store: StoreClient, count: int) -> dict[int, tuple[Any, ...]]:
    keys = {rank: RESULT_KEY.format(rank=rank) for rank in range(count)}
    return {
        rank: cloudpickle.loads(store.get(key, timeout=0))
        for rank, key in keys.items()
        if store.check([key])
    }


def _results(
    outcomes: dict[int, tuple[Any, ...]],
    count: int,
    code: int,
    failure: tuple[int, int] | None,
    mpi: bool = False,
) -> list[Any]:
    errors = {rank: o for rank, o in outcomes.items() if o[0] == "error"}
    if errors:
        rank = failure[0] if failure and failure[0] in errors else min(errors)
        _, exc, text = errors[rank]
        raise LaunchError(f"hora.run: rank {rank} raised an exception:\n{text}") from exc
    if code != 0 or len(outcomes) < count:
        what = f"code {code}"
        if failure:
            who = "mpirun" if mpi else f"rank {failure[0]}"
            what = f"{who} exited with status {exit_status(failure[1])}"
        if len(outcomes) == count:  # every value came back: the failure came while exiting
            raise LaunchError(
                f"hora.run: every rank returned its result, then {what} while shutting down; "
                "its output above says why"
            )
        raise LaunchError(f"hora.run: the job failed ({what}) before every rank returned")
    return [outcomes[rank][1] for rank in sorted(outcomes)]
