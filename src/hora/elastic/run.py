"""``hvd.elastic.run``: the worker's side of elastic training.

The decorated training function runs inside a loop. When a collective fails (a worker died:
:class:`~hora.errors.HoraInternalError` on every survivor) the state rolls back to its last
commit; when the launcher reports new or removed hosts (:class:`~hora.errors.HostsUpdatedInterrupt`
at a ``commit``) it keeps its values. Either way hora is shut down and initialised again, which
re-forms the job with the launcher (see :mod:`hora.elastic.rendezvous`), the reset callbacks run,
the state is synchronised from the new rank 0 (skipped when hosts were only removed), and the
function is called again.

Runs in the training thread; not thread-safe.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from hora.elastic.state import State
from hora.errors import HoraInternalError, HostsUpdatedInterrupt

log = logging.getLogger("hora.elastic")

F = TypeVar("F", bound=Callable[..., Any])


def run(func: F) -> F:
    """Run ``func(state, *args, **kwargs)`` until it returns, recovering from lost workers
    and re-forming the job when hosts change. Outside an elastic job (``hora run`` without
    ``--min-np``/``--max-np``/``--host-discovery-script``) a failed collective is raised."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HoraInternalError as e:
                if not _elastic():
                    raise
                log.warning("a collective failed (%s); rolling back to the last commit", e)
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as e:
                log.info("hosts changed; re-forming the job")
                skip_sync = e.skip_sync
            reset()
            state.on_reset()

    return wrapper  # type: ignore[return-value]


def _elastic() -> bool:
    from hora.settings import load

    return load().elastic


def reset() -> None:
    """Shut hora down and initialise it again: the launcher assigns this worker a new rank."""
    from hora.core import runtime

    runtime.shutdown()
    runtime.init()


def host_updates() -> tuple[int, bool]:
    """How many times the launcher has changed the hosts, and whether the last change only
    removed hosts; ``(0, False)`` outside an elastic job."""
    from hora.core import runtime
    from hora.elastic.rendezvous import read_host_updates

    rt = runtime.runtime()
    if not rt.settings.elastic or rt.store is None:
        return 0, False
    return read_host_updates(rt.store)
