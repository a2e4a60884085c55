"""``hvd.elastic.run``: the worker's side of elastic training.

The decorated training function runs inside a loop. When a collective fails (a worker died:
:class:`~hora.errors.HoraInternalError` on every survivor) the state rolls back to its last
commit; when the launcher reports new or removed hosts (:class:`~hora.errors.HostsUpdatedInterrupt`
at a ``commit``) it keeps its values. Either way hora is shut down and initialised again, which
re-forms the job with the launcher (see :mod:`hora.rendezvous.rounds`), the state's ``on_reset``
runs (its ``reset()``, then the reset callbacks), the state is synchronised from the new rank 0
(skipped when hosts were only removed), and the function is called again. A worker whose host
left the job exits with status 0 at its re-formation. After its first ``sync()`` a worker
writes :func:`synced_key` in the launcher's store: from then on it holds the committed state, so
a worker whose host is removed may leave the job without taking the only copy with it.

Runs in the training thread; not thread-safe.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from hora.errors import HoraInternalError, HostsUpdatedInterrupt, RendezvousError
from hora.rendezvous.rounds import WorkerRemoved

log = logging.getLogger("hora.elastic")

F = TypeVar("F", bound=Callable[..., Any])

_REFORM_TRIES = 5  # re-formations in a row whose connections fail before the worker gives up
_synced = False  # this worker told the launcher that it holds the committed state


def synced_key(worker: str) -> str:
    """The store key a worker sets once it holds the committed state (after a sync)."""
    return f"elastic/synced/{worker}"


def run(func: F) -> F:
    """Run ``func(state, *args, **kwargs)`` until it returns, recovering from lost workers
    and re-forming the job when hosts change. Outside an elastic job (``hora run`` without
    ``--min-np``/``--max-np``/``--host-discovery-script``) a failed collective is raised."""

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:  # a hora.elastic.state.State
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                    _tell_synced()
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


def _tell_synced() -> None:
    global _synced
    if _synced:
        return
    from hora.core import runtime
    from hora.settings import env_lookup

    rt = runtime.runtime()
    worker = env_lookup(os.environ, "ELASTIC_ID")
    if rt.settings.elastic and rt.store is not None and worker:
        rt.store.set(synced_key(str(worker)), b"1")
        _synced = True


def _elastic() -> bool:
    from hora.settings import load

    return load().elastic


def reset() -> None:
    """Shut hora down and initialise it again: the launcher assigns this worker a new rank.

    A round whose connections cannot be built (a member died while they were being made) is
    given up for the next one. A worker removed from the job exits here with status 0.
    """
    from hora.core import runtime

    for attempt in range(1, _REFORM_TRIES + 1):
        runtime.shutdown()
        try:
            runtime.init()
            return
        except WorkerRemoved as e:
            log.info("%s; exiting", e)
            raise SystemExit(0) from None
        except ValueError as e:
            cause = e.__cause__
            lost = isinstance(cause, (HoraInternalError, RendezvousError, OSError, TimeoutError))
            if not lost or attempt == _REFORM_TRIES:
                raise
            log.warning("re-formation failed (%s); asking for the next round", e)
