"""Elastic jobs whose workers another scheduler runs: Ray actors (:mod:`hora.ray.elastic`) and
Spark tasks (:mod:`hora.spark.elastic`).

:class:`SchedulerJob` is :class:`~hora.elastic.driver.ElasticJob` with what such a scheduler
changes: the hosts and their slots are the scheduler's (a subclass answers ``_discover``), the
rendezvous store starts in this process without the launcher's ssh preflight, every worker
reaches the store at one address, and a worker is a :class:`RemoteWorker`: a stand-in that
the driver polls and stops like a worker process, whose exit status the subclass reports with
:meth:`RemoteWorker.finish`. The error that ended a job is kept in ``error`` so that the
integration raises it rather than a bare exit code.
"""

from __future__ import annotations

import dataclasses
import queue
import threading

from hora.elastic.driver import ElasticJob
from hora.errors import LaunchError
from hora.launch.config import ElasticOptions, LaunchConfig
from hora.launch.preflight import Preflight

KILLED = -9  # the exit status of a worker whose actor or task vanished (as a SIGKILLed process)

# The elastic driver runs its discovery when a discovery script is set; a SchedulerJob answers
# from the scheduler instead of running anything.
SCHEDULER_HOSTS = "<the hosts of the scheduler>"


class RemoteWorker:
    """One elastic worker that runs elsewhere, seen by the elastic driver as a worker process
    (``poll``, ``stop``, ``kill_after``). ``finish`` records its exit status once and hands it
    to the driver's ``exits`` queue; subclasses say how to stop it."""

    def __init__(self, label: int, exits: queue.Queue[tuple[int, int]]) -> None:
        self.label = label
        self._exits = exits
        self._code: int | None = None
        self._lock = threading.Lock()

    def finish(self, code: int) -> bool:
        """Record the exit status (the first one given wins); whether this call recorded it."""
        with self._lock:
            if self._code is not None:
                return False
            self._code = code
        self._exits.put((self.label, code))
        return True

    def poll(self) -> int | None:
        return self._code

    def stop(self) -> None:
        raise NotImplementedError

    def kill_after(self, deadline: float) -> None:
        self.stop()


class SchedulerJob(ElasticJob):
    """An elastic job whose hosts and workers a scheduler provides (see the module's text).

    ``store_address``: where every worker reaches this process's store; ``nics``: the
    interfaces the workers use (empty: they choose); ``scheduler``: the scheduler's name, for
    messages.
    """

    def __init__(
        self,
        config: LaunchConfig,
        options: ElasticOptions,
        store_address: str,
        nics: list[str],
        scheduler: str,
    ) -> None:
        self._remote_address = store_address
        self._nics = list(nics)
        self._scheduler = scheduler
        self.error: LaunchError | None = None
        options = dataclasses.replace(options, host_discovery_script=SCHEDULER_HOSTS)
        super().__init__(config, options)

    def __enter__(self) -> SchedulerJob:
        # no ssh preflight: the scheduler reached the hosts; the store listens on every
        # interface, as for any elastic job (its hosts are not known when it starts)
        reason = "given by nics" if self._nics else self._scheduler
        self._preflight = Preflight({}, self._nics, reason)
        self._start_store("0.0.0.0")
        return self

    def _address(self, host: str) -> str:
        # one address for every worker, the driver's: a worker that reached the store on
        # loopback would listen on loopback too, out of reach of other hosts' workers
        return self._remote_address

    def _watch(self) -> int:
        try:
            return super()._watch()
        except LaunchError as e:  # the driver logs it and returns 1; the caller raises it
            self.error = e
            raise
