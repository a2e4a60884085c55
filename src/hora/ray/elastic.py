"""``hora.ray.ElasticRayExecutor`` (Horovod's ``horovod.ray.ElasticRayExecutor``): an elastic
hora job whose workers are Ray actors.

The job is :mod:`hora.elastic.driver`'s, unchanged but for three things Ray decides: the hosts
are Ray's live nodes (each with as many slots as ``cpus_per_worker`` fit in its CPUs), each
worker is an actor pinned to its node that runs :mod:`hora.launch.task` in its process, and the
rendezvous store runs in this process without the launcher's ssh preflight. So a worker whose
actor dies (``ray.kill``, a lost node) is handled as a failed worker process is: its node is
blacklisted (for ``cooldown_range`` when given), the others roll back to their last commit and
go on, and nodes that join the Ray cluster get workers up to ``max_workers``.

Runs in the caller's thread (the Ray driver); each :meth:`ElasticRayExecutor.run` is one job.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hora.elastic.remote import KILLED, RemoteWorker, SchedulerJob
from hora.errors import LaunchError
from hora.launch.api import run_on_job
from hora.launch.config import ElasticOptions, LaunchConfig
from hora.launch.hosts import HostSlots
from hora.launch.process import ConsoleSink
from hora.ray.callbacks import relay as callback_relay
from hora.ray.config import RaySettings
from hora.ray.elastic_settings import ElasticRaySettings, create_elastic_settings
from hora.ray.worker import Worker
from hora.settings import load

log = logging.getLogger("hora.ray")


class _ActorProcess(RemoteWorker):
    """One elastic worker's actor; its exit status is reported when ``run_task`` ends."""

    def __init__(self, label: int, actor: Any, ref: Any, exits: queue.Queue[tuple[int, int]]):
        super().__init__(label, exits)
        self.actor = actor
        self._thread = threading.Thread(
            target=self._wait, args=(ref,), name=f"hora-ray-worker-{label}", daemon=True
        )
        self._thread.start()

    def _wait(self, ref: Any) -> None:
        try:
            code = int(ray.get(ref))
        except RayActorError:
            code = KILLED
        except Exception as e:  # the task could not run (serialization, a lost object)
            log.error("hora.ray: elastic worker %d failed: %s", self.label, e)
            code = 1
        self.stop()  # the worker is done: its actor and process go
        self.finish(code)

    def stop(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception as e:  # already gone
            log.debug("hora.ray: killing elastic worker %d: %s", self.label, e)


class _RayJob(SchedulerJob):
    """An elastic job whose hosts are Ray nodes (by node id) and whose workers are actors."""

    def __init__(
        self,
        config: LaunchConfig,
        options: ElasticOptions,
        cpus_per_worker: float,
        gpus_per_worker: float,
        nics: Sequence[str],
        logger: Any = None,
    ) -> None:
        self._cpus = cpus_per_worker
        self._gpus = gpus_per_worker
        self._logger = logger
        self._actor_cls: Any = ray.remote(Worker)
        super().__init__(config, options, ray.util.get_node_ip_address(), list(nics), "Ray")

    def _discover(self) -> list[HostSlots]:
        hosts = []
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            res = node.get("Resources", {})
            fits = [res.get("CPU", 0) / self._cpus] if self._cpus else []
            if self._gpus:
                fits.append(res.get("GPU", 0) / self._gpus)
            slots = int(min(fits)) if fits else 1
            if slots > 0:
                hosts.append(HostSlots(node["NodeID"], slots))
        return hosts

    def _spawn(  # type: ignore[override]
        self, label: int, host: str, env: dict[str, str], stdout: ConsoleSink, stderr: ConsoleSink
    ) -> _ActorProcess:
        env = dict(env)
        env["HORA_SECRET_KEY"] = self.secret.hex()  # a launched worker reads it on its stdin
        actor = self._actor_cls.options(
            num_cpus=self._cpus,
            num_gpus=self._gpus,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(host, soft=False),
        ).remote()
        ref = actor.run_task.remote(env, self._logger)
        worker = _ActorProcess(label, actor, ref, self._exits)
        self.workers.append(worker)  # type: ignore[arg-type]
        return worker


class ElasticRayExecutor:
    """Horovod's ``ElasticRayExecutor``: ``run(worker_fn)`` trains elastically on Ray actors.

    Horovod's way: ``settings = ElasticRayExecutor.create_settings(min_num_proc=2,
    max_num_proc=8)``, ``ElasticRayExecutor(settings, use_gpu=False, cpus_per_slot=1)``,
    ``start()``, ``run(worker_fn)`` (``worker_fn()`` uses ``hvd.elastic.run`` and a state
    object as under ``hora run --min-np``). The settings' ``min_num_proc`` workers are needed
    to start and to go on; at most ``max_num_proc`` run (default: every slot of the cluster).
    Each worker reserves ``cpus_per_slot`` CPUs (and, with ``use_gpu``, ``gpus_per_slot``
    GPUs, default 1); ``env_vars`` are set in every worker before it starts.

    hora's keywords, after Horovod's, override the settings: ``min_workers``,
    ``max_workers``, ``reset_limit``, ``elastic_timeout`` (default ``HOROVOD_ELASTIC_TIMEOUT``,
    600 s: how long a round may take to form), ``cooldown_range`` (seconds, min and max: a node
    whose worker failed comes back, else it stays out of the job), ``cpus_per_worker`` and
    ``gpus_per_worker`` (as ``cpus_per_slot``/``gpus_per_slot``; fractions allowed).
    """

    create_settings = staticmethod(create_elastic_settings)

    def __init__(
        self,
        settings: RaySettings | None = None,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: float | None = None,
        env_vars: Mapping[str, str] | None = None,
        override_discovery: bool = True,
        *,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cpus_per_worker: float | None = None,
        gpus_per_worker: float | None = None,
        elastic_timeout: float | None = None,
        cooldown_range: tuple[int, int] | None = None,
    ):
        if not override_discovery:
            raise ValueError(
                "ElasticRayExecutor(override_discovery=False): hora discovers the Ray nodes "
                "itself; use hora.run(host_discovery_script=...) for a discovery script"
            )
        if gpus_per_slot and not use_gpu:
            raise ValueError(
                f"ElasticRayExecutor: gpus_per_slot={gpus_per_slot} needs use_gpu=True"
            )
        if use_gpu and gpus_per_slot is not None and gpus_per_slot < 1:
            raise ValueError(f"ElasticRayExecutor: gpus_per_slot={gpus_per_slot} must be >= 1")
        self.settings = settings if settings is not None else create_elastic_settings()
        bounds = self.settings if isinstance(self.settings, ElasticRaySettings) else None

        def pick(given: Any, name: str, default: Any) -> Any:
            return given if given is not None else getattr(bounds, name, default)

        self.min_workers = int(pick(min_workers, "min_num_proc", 1))
        self.max_workers = pick(max_workers, "max_num_proc", None)
        if self.min_workers < 1 or (
            self.max_workers is not None and self.max_workers < self.min_workers
        ):
            raise ValueError(
                f"ElasticRayExecutor: min_workers={self.min_workers}, max_workers="
                f"{self.max_workers}: need 1 <= min_workers <= max_workers (min_num_proc and "
                "max_num_proc of create_settings)"
            )
        self.reset_limit = pick(reset_limit, "reset_limit", None)
        self.elastic_timeout = pick(elastic_timeout, "elastic_timeout", None)
        self.cooldown_range = pick(cooldown_range, "cooldown_range", None)
        self.use_gpu = bool(use_gpu)
        self.cpus_per_worker = cpus_per_worker if cpus_per_worker is not None else cpus_per_slot
        if self.cpus_per_worker <= 0 and not use_gpu:
            raise ValueError(
                f"ElasticRayExecutor: cpus_per_slot={self.cpus_per_worker} must be > 0"
            )
        gpus = gpus_per_worker if gpus_per_worker is not None else gpus_per_slot
        self.gpus_per_worker = (gpus or 1) if use_gpu else 0
        self.cpus_per_slot, self.gpus_per_slot = self.cpus_per_worker, self.gpus_per_worker
        self.env_vars = {str(k): str(v) for k, v in (env_vars or {}).items()}
        self._job: _RayJob | None = None

    @property
    def workers(self) -> list[Any]:
        """The actor handles of the running job's live workers, in start order (for another
        thread: ``run`` blocks); empty between runs."""
        job = self._job
        if job is None:
            return []
        procs: list[Any] = list(job.workers)  # _ActorProcess objects, in the Worker list
        return [p.actor for p in procs if p.poll() is None]

    def start(self) -> None:
        """Connect to Ray (``ray.init()`` when not yet); the workers start with each run."""
        if not ray.is_initialized():
            ray.init()

    def run(
        self,
        worker_fn: Callable[..., Any],
        callbacks: Sequence[Callable[..., Any]] | None = None,
        *,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """``worker_fn()`` (hora: ``worker_fn(*args, **kwargs)``) as an elastic job; the values
        of the last round's ranks in rank order. LaunchError (a RuntimeError) when the job
        fails (every node blacklisted, fewer than ``min_workers`` left with no way to get more,
        the reset limit, a timeout).

        ``callbacks``: callables, each called in this process (in a thread of its own) with
        every value rank 0 logs with :func:`hora.ray.ray_logger.log`, in the order logged;
        all of them are delivered before ``run`` returns. A callback that raises stops the
        deliveries and ``run`` raises its exception once the job is over."""
        if callbacks is not None and not all(callable(c) for c in callbacks):
            raise TypeError(
                f"ElasticRayExecutor.run(worker_fn, callbacks): callbacks={callbacks!r} must "
                "be callables; pass the function's arguments as args=[...], kwargs={...}"
            )
        self.start()
        knobs = self.settings.knobs
        if knobs is None:  # env_vars may set knobs too
            knobs = load({**os.environ, **self.env_vars})
        timeout = (
            self.elastic_timeout if self.elastic_timeout is not None else knobs.elastic_timeout
        )
        config = LaunchConfig(
            command=["<a Ray actor>"],
            np=self.min_workers,
            start_timeout=self.settings.timeout_s,
            settings=knobs,
            verbose=bool(getattr(self.settings, "verbose", 0)),
            # the actors keep their own environment plus env_vars; the knobs come from settings
            env=dict(self.env_vars),
        )
        options = ElasticOptions(
            min_np=self.min_workers,
            max_np=self.max_workers,
            elastic_timeout=timeout,
            reset_limit=self.reset_limit,
            cooldown_range=self.cooldown_range,
        )
        relay = callback_relay(callbacks)
        job = _RayJob(
            config,
            options,
            self.cpus_per_worker,
            self.gpus_per_worker,
            self.settings.nics,
            relay.queue if relay is not None else None,
        )
        self._job = job
        ok = False
        try:
            results = run_on_job(
                job, worker_fn, args or (), kwargs, elastic=True, caller="ElasticRayExecutor.run"
            )
            ok = True
            return results
        except LaunchError as e:
            if job.error is not None:
                raise LaunchError(f"ElasticRayExecutor.run: {job.error}") from e
            raise
        finally:
            self._job = None
            if relay is not None:
                relay.close(raise_error=ok)

    def shutdown(self) -> None:
        """Nothing outlives a run (its actors are killed and its store stopped as it ends)."""
