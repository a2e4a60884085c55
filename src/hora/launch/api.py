"""Running a Python function on every rank of a job and returning the results: the machinery
behind ``hora.run`` (:mod:`hora.runner`).

For notebooks and for integrations (Ray, Spark): the function and its arguments are
cloudpickled into the job's rendezvous store, every rank runs ``python -m hora.launch.task``
(which fetches, calls and stores the outcome), and the list of results ordered by rank comes
back. A rank that raised makes :func:`run_on_job` raise, chained to that rank's exception.

Runs in the caller's thread; each call is its own job, so concurrent calls from different
threads do not share state (output from both goes to the same console).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle

from hora.errors import LaunchError
from hora.launch.job import Job, exit_status
from hora.launch.task import FUNC_KEY, RESULT_KEY, SIZE_KEY
from hora.rendezvous.client import StoreClient


def run_on_job(
    job: Job,
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    elastic: bool = False,
    caller: str = "hora.run",
) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on every rank of ``job`` (a :class:`Job`, or an elastic
    job built on it); the results ordered by rank. An elastic job's results are those of the
    ranks of its last round. LaunchError (its message starting with ``caller``) when a rank
    fails or the job cannot start."""
    config = job.config
    payload = cloudpickle.dumps((func, tuple(args), dict(kwargs or {})))
    count = config.np
    timeout = config.start_timeout
    with job, StoreClient(job.store_address, job.port, job.secret, timeout=timeout) as store:
        store.set(FUNC_KEY, payload)
        code = job.run()
        if elastic:  # the ranks of the last round; each of them stored the round's size
            size_raw = store.get(SIZE_KEY, timeout=0) if store.check([SIZE_KEY]) else b"0"
            count = int(size_raw.decode() or 0) or count
        outcomes = _collect(store, count)
    return results_in_order(outcomes, count, code, job.failure, config.backend == "mpi", caller)


def _collect(store: StoreClient, count: int) -> dict[int, tuple[Any, ...]]:
    keys = {rank: RESULT_KEY.format(rank=rank) for rank in range(count)}
    return {
        rank: cloudpickle.loads(store.get(key, timeout=0))
        for rank, key in keys.items()
        if store.check([key])
    }


def results_in_order(
    outcomes: dict[int, tuple[Any, ...]],
    count: int,
    code: int,
    failure: tuple[int, int] | None,
    mpi: bool = False,
    caller: str = "hora.run",
) -> list[Any]:
    """The values of ``outcomes`` (rank -> ``("ok", value)`` or ``("error", exception,
    traceback text)``, as :mod:`hora.launch.task` stores them) ordered by rank. LaunchError,
    naming the rank (``failure``'s when it raised, else the lowest) and chained to its exception,
    when a rank raised; LaunchError too when ``code`` is non-zero or fewer than ``count`` came
    back. ``caller`` starts each message."""
    errors = {rank: o for rank, o in outcomes.items() if o[0] == "error"}
    if errors:
        rank = failure[0] if failure and failure[0] in errors else min(errors)
        _, exc, text = errors[rank]
        raise LaunchError(f"{caller}: rank {rank} raised an exception:\n{text}") from exc
    if code != 0 or len(outcomes) < count:
        what = f"code {code}"
        if failure:
            who = "mpirun" if mpi else f"rank {failure[0]}"
            what = f"{who} exited with status {exit_status(failure[1])}"
        if len(outcomes) == count:  # every value came back: the failure came while exiting
            raise LaunchError(
                f"{caller}: every rank returned its result, then {what} while shutting down; "
                "its output above says why"
            )
        raise LaunchError(f"{caller}: the job failed ({what}) before every rank returned")
    return [outcomes[rank][1] for rank in sorted(outcomes)]
