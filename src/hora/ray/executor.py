"""``hora.ray.RayExecutor`` (Horovod's ``horovod.ray.RayExecutor``): a static hora job whose
ranks are Ray actors.

``start()`` reserves one placement-group bundle per worker (or per host), starts one
:class:`hora.ray.worker.Worker` actor per rank, gives ranks grouped by Ray node (so local ranks
are right; :func:`hora.launch.hosts.assign_ranks`), starts hora's rendezvous store in this
process and hands each actor the environment :mod:`hora.launch.workerenv` builds for a launched
rank. ``run``/``execute`` then call a function on every actor and return the values in rank
order. A rank that raises, or whose actor dies (``ray.kill``, a lost node), ends the job: after a
short grace for the other ranks, every actor is killed, the placement group removed and the
store stopped, and LaunchError names the rank. ``shutdown()`` does the same after success.

Every method runs in the caller's thread (the Ray driver); an executor is not thread-safe.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hora.errors import LaunchError
from hora.launch.api import results_in_order
from hora.launch.hosts import HostSlots, SlotInfo, assign_ranks
from hora.launch.workerenv import job_env, rank_env
from hora.ray.callbacks import relay as callback_relay
from hora.ray.config import RaySettings, create_settings
from hora.ray.elastic import ElasticRayExecutor
from hora.ray.worker import Worker
from hora.rendezvous.server import RendezvousServer
from hora.settings import load

log = logging.getLogger("hora.ray")

# After the first rank fails, how long the others get to finish before every actor is killed.
FAILURE_GRACE_S = 3.0


@dataclass(frozen=True)
class _Rank:
    """One started rank: its actor, where it runs and its place in the job."""

    actor: Any
    node: str
    pid: int
    slot: SlotInfo


class RayExecutor:
    """A hora job on Ray actors; Horovod's ``RayExecutor`` with the same parameters.

    Give ``num_workers`` (ranks placed wherever Ray has room, packed onto few nodes) or
    ``num_hosts`` and ``num_workers_per_host`` (that many ranks on each of that many distinct
    nodes). Each worker reserves ``cpus_per_worker`` CPUs and, with ``use_gpu``,
    ``gpus_per_worker`` GPUs (default 1). With ``use_current_placement_group`` and a caller that
    itself runs inside a placement group, the workers use its bundles instead of a new group.
    """

    create_settings = staticmethod(create_settings)

    def __init__(
        self,
        settings: RaySettings | None = None,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: tuple[int, int] | None = None,
        elastic_timeout: float | None = None,
        override_discovery: bool = True,
    ):
        self._elastic: ElasticRayExecutor | None = None
        if min_workers is not None or max_workers is not None:
            if num_workers is not None or num_hosts is not None:
                raise ValueError(
                    f"RayExecutor: num_workers={num_workers}/num_hosts={num_hosts} (a static "
                    f"job) and min_workers={min_workers}/max_workers={max_workers} (an elastic "
                    "one) do not go together; give one or the other"
                )
            self._elastic = ElasticRayExecutor(
                settings,
                min_workers=min_workers if min_workers is not None else 1,
                max_workers=max_workers,
                reset_limit=reset_limit,
                cpus_per_worker=cpus_per_worker,
                use_gpu=use_gpu,
                gpus_per_worker=gpus_per_worker,
                override_discovery=override_discovery,
                elastic_timeout=elastic_timeout,
                cooldown_range=cooldown_range,
            )
            self.settings = self._elastic.settings
            self.num_workers = self.num_hosts = None
            self._ranks: list[_Rank] = []
            self._server: RendezvousServer | None = None
            self._pg: PlacementGroup | None = None
            self._own_pg = False
            return
        if (num_workers is None) == (num_hosts is None):
            raise ValueError(
                f"RayExecutor: give exactly one of num_workers (got {num_workers}) and "
                f"num_hosts (got {num_hosts}, with num_workers_per_host)"
            )
        count = num_workers if num_workers is not None else num_hosts
        if count is None or count < 1 or num_workers_per_host < 1:
            raise ValueError(
                f"RayExecutor: num_workers={num_workers}, num_hosts={num_hosts}, "
                f"num_workers_per_host={num_workers_per_host}: each must be at least 1"
            )
        if cpus_per_worker < 0 or (gpus_per_worker is not None and gpus_per_worker < 0):
            raise ValueError(
                f"RayExecutor: cpus_per_worker={cpus_per_worker}, gpus_per_worker="
                f"{gpus_per_worker}: resources cannot be negative"
            )
        if gpus_per_worker and not use_gpu:
            raise ValueError(f"RayExecutor: gpus_per_worker={gpus_per_worker} needs use_gpu=True")
        self.settings = settings if settings is not None else self.create_settings()
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self._ranks = []
        self._server = None
        self._pg = None
        self._own_pg = False

    # -- size ----------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        """How many ranks the job has (an elastic job: its minimum)."""
        if self._elastic is not None:
            return self._elastic.min_workers
        if self.num_workers is not None:
            return self.num_workers
        assert self.num_hosts is not None
        return self.num_hosts * self.num_workers_per_host

    @property
    def workers(self) -> list[Any]:
        """The running ranks' Ray actor handles in rank order (empty when none runs; an
        elastic job's live workers while it runs)."""
        if self._elastic is not None:
            return self._elastic.workers
        return [rank.actor for rank in self._ranks]

    # -- start ---------------------------------------------------------------------------
    def start(
        self,
        executable_cls: type | None = None,
        executable_args: Sequence[Any] | None = None,
        executable_kwargs: Mapping[str, Any] | None = None,
        extra_env_vars: Mapping[str, str] | None = None,
    ) -> None:
        """Start the actors and the rendezvous store; build ``executable_cls(*executable_args,
        **executable_kwargs)`` in each actor (after its environment is in place) for
        :meth:`execute`. ``extra_env_vars`` are added to every worker's environment.

        LaunchError when Ray cannot place the workers within ``placement_group_timeout_s`` or
        they do not start within ``timeout_s``; nothing is left running then.
        """
        if self._elastic is not None:
            if executable_cls is not None or extra_env_vars:
                raise ValueError(
                    "RayExecutor.start(): an elastic executor (min_workers/max_workers) starts "
                    "its workers with each run(fn); executable_cls and extra_env_vars are for "
                    "a static one (num_workers)"
                )
            self._elastic.start()
            return
        if self._ranks:
            raise LaunchError("RayExecutor.start(): already started; call shutdown() first")
        if not ray.is_initialized():
            ray.init()
        try:
            self._start(executable_cls, executable_args, executable_kwargs, extra_env_vars)
        except BaseException:
            self._teardown()
            raise

    def _start(
        self,
        executable_cls: type | None,
        executable_args: Sequence[Any] | None,
        executable_kwargs: Mapping[str, Any] | None,
        extra_env_vars: Mapping[str, str] | None,
    ) -> None:
        strategies = self._placement()
        actor_cls: Any = ray.remote(Worker)
        actors: list[Any] = [
            actor_cls.options(
                num_cpus=self.cpus_per_worker,
                num_gpus=self.gpus_per_worker,
                max_restarts=0,
                scheduling_strategy=strategy,
            ).remote()
            for strategy in strategies
        ]
        # the partial list lets _teardown kill the actors if they fail to start
        self._ranks = [_Rank(a, "", -1, _NO_SLOT) for a in actors]
        places = self._get([a.where.remote() for a in actors], "start the workers")
        # ranks grouped by node, nodes in the order of their first worker
        by_node: dict[str, list[int]] = {}
        for index, (node, _host, _pid, _gpus) in enumerate(places):
            by_node.setdefault(node, []).append(index)
        hosts = [HostSlots(places[ix[0]][1], len(ix)) for ix in by_node.values()]
        order = [index for ix in by_node.values() for index in ix]
        slots = assign_ranks(hosts, len(actors))
        self._ranks = [
            _Rank(actors[index], places[index][0], places[index][2], slot)
            for index, slot in zip(order, slots)
        ]
        secret = os.urandom(32)
        knobs = self.settings.knobs if self.settings.knobs is not None else load()
        # loopback when every rank runs on the driver's node, else the driver's node address;
        # every interface only when asked for (HORA_LISTEN_ANY), as for hora run's store
        here = ray.get_runtime_context().get_node_id()
        local = all(node == here for node in by_node)
        address = "127.0.0.1" if local else ray.util.get_node_ip_address()
        bind = "0.0.0.0" if knobs.listen_any else address
        server = RendezvousServer(
            secret, host=bind, port=0, handshake_timeout=knobs.handshake_timeout_seconds
        )
        port = server.start()
        self._server = server
        common = job_env({}, knobs, "native", port, list(self.settings.nics))
        gpus_by_node: dict[str, list[str]] = {}
        for node, _host, _pid, gpus in places:
            gpus_by_node.setdefault(node, []).extend(gpus)
        setups = []
        for rank in self._ranks:
            env = rank_env(common, rank.slot, address)
            env["HORA_SECRET_KEY"] = secret.hex()
            if self.use_gpu:  # every GPU of the node's workers, so local_rank picks one
                env["CUDA_VISIBLE_DEVICES"] = ",".join(dict.fromkeys(gpus_by_node[rank.node]))
            env.update(extra_env_vars or {})
            setups.append(
                rank.actor.setup.remote(
                    env, executable_cls, tuple(executable_args or ()), dict(executable_kwargs or {})
                )
            )
        self._gather(setups, "start")
        log.info(
            "hora.ray: %d ranks on %d Ray nodes; rendezvous store on %s:%d",
            len(self._ranks),
            len(by_node),
            address,
            port,
        )

    def _placement(self) -> list[PlacementGroupSchedulingStrategy]:
        """One scheduling strategy per worker, in bundle order."""
        per_host = self.num_workers_per_host if self.num_hosts is not None else 1
        bundle_count = self.num_hosts if self.num_hosts is not None else self.num_ranks
        assert bundle_count is not None
        bundle: dict[str, float] = {"CPU": self.cpus_per_worker * per_host}
        if self.gpus_per_worker:
            bundle["GPU"] = self.gpus_per_worker * per_host
        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:
            if len(current.bundle_specs) < bundle_count:
                raise LaunchError(
                    f"RayExecutor: the current placement group has {len(current.bundle_specs)} "
                    f"bundles but the job needs {bundle_count}; pass "
                    "use_current_placement_group=False to reserve a new one"
                )
            pg = current
        else:
            strategy = "STRICT_SPREAD" if self.num_hosts is not None else "PACK"
            pg = placement_group([dict(bundle) for _ in range(bundle_count)], strategy=strategy)
            self._pg, self._own_pg = pg, True
        timeout = self.settings.placement_group_timeout_s
        try:
            ray.get(pg.ready(), timeout=timeout)
        except GetTimeoutError:
            raise LaunchError(
                f"RayExecutor: Ray could not reserve {bundle_count} x {bundle} "
                f"({'one per node' if self.num_hosts is not None else 'packed'}) within "
                f"placement_group_timeout_s={timeout:g}; the cluster has "
                f"{ray.available_resources()} available of {ray.cluster_resources()}"
            ) from None
        return [
            PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index // per_host)
            for index in range(self.num_ranks)
        ]

    # -- running functions ----------------------------------------------------------------
    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        callbacks: Sequence[Callable[..., Any]] | None = None,
    ) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the values in rank order. LaunchError naming
        the rank (chained to its exception) when one raises or its actor dies; the job then
        ends (:meth:`start` again for a new one). ``callbacks``: called in this process with
        every value rank 0 logs with :func:`hora.ray.ray_logger.log`
        (:meth:`ElasticRayExecutor.run` says how)."""
        if self._elastic is not None:
            return self._elastic.run(fn, callbacks, args=args, kwargs=kwargs)
        actors = self._actors()
        call = (tuple(args or ()), dict(kwargs or {}))
        return self._with_callbacks(
            lambda q: [a.outcome.remote(fn, *call, q) for a in actors], "run", callbacks
        )

    def execute(
        self, fn: Callable[[Any], Any], callbacks: Sequence[Callable[..., Any]] | None = None
    ) -> list[Any]:
        """``fn(executable)`` on every rank (``executable``: the object :meth:`start` built,
        else None); the values in rank order. Failures and ``callbacks`` as :meth:`run`."""
        actors = self._actors()
        return self._with_callbacks(
            lambda q: [a.executable_outcome.remote(fn, q) for a in actors], "execute", callbacks
        )

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only; its value (its exception, raised here)."""
        return ray.get(self._actors()[0].execute_raw.remote(fn))

    def run_remote(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank, not waited for: Ray object refs in rank order
        (``ray.get`` gives the values or raises the rank's exception)."""
        return [a.call.remote(fn, tuple(args or ()), dict(kwargs or {})) for a in self._actors()]

    # -- stopping -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Kill every actor, remove the placement group this executor made and stop the
        rendezvous store. Safe to call again, or after a failure already ended the job."""
        self._teardown()

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self._teardown()

    # -- internals ------------------------------------------------------------------------
    def _with_callbacks(
        self,
        submit: Callable[[Any], list[Any]],
        what: str,
        callbacks: Sequence[Callable[..., Any]] | None,
    ) -> list[Any]:
        """``submit(queue)``'s refs gathered, with ``callbacks`` fed from ``queue`` meanwhile."""
        relay = callback_relay(callbacks)
        ok = False
        try:
            results = self._gather(submit(relay.queue if relay is not None else None), what)
            ok = True
            return results
        finally:
            if relay is not None:
                relay.close(raise_error=ok)

    def _actors(self) -> list[Any]:
        if self._elastic is not None:
            raise ValueError(
                "RayExecutor: an elastic executor (min_workers/max_workers) only runs functions "
                "with run(fn); execute, execute_single and run_remote need a static one "
                "(num_workers)"
            )
        if not self._ranks:
            raise LaunchError(
                "RayExecutor: no workers are running; call start() (again, after shutdown() "
                "or a failed run)"
            )
        return [rank.actor for rank in self._ranks]

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        try:
            return ray.get(refs, timeout=self.settings.timeout_s)
        except GetTimeoutError:
            raise LaunchError(
                f"RayExecutor: the workers did not {what} within timeout_s="
                f"{self.settings.timeout_s:g}"
            ) from None

    def _gather(self, refs: list[Any], what: str) -> list[Any]:
        """Wait for one outcome per rank (``refs`` in rank order); their values in rank order.
        On the first failure the other ranks get :data:`FAILURE_GRACE_S`, then the job ends."""
        timeout = self.settings.timeout_s if what == "start" else None
        start = time.monotonic()
        pending = {ref: rank for rank, ref in enumerate(refs)}
        outcomes: dict[int, tuple[Any, ...]] = {}
        died: dict[int, RayError] = {}
        first: int | None = None
        deadline: float | None = None
        while pending:
            now = time.monotonic()
            limit = deadline if deadline is not None else None
            if timeout is not None:
                limit = min(limit or float("inf"), start + timeout)
            if limit is not None and now >= limit:
                break
            wait = None if limit is None else limit - now
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    raw = ray.get(ref)
                    outcomes[rank] = cloudpickle.loads(raw) if raw is not None else ("ok", None)
                except RayActorError as e:
                    died[rank] = e
                except RayError as e:  # the outcome could not come back
                    outcomes[rank] = ("error", e, str(e))
                if (rank in died or outcomes[rank][0] == "error") and first is None:
                    first = rank
                    deadline = time.monotonic() + FAILURE_GRACE_S
        if first is None and not pending:
            return [outcomes[rank][1] for rank in range(len(refs))]
        stuck = sorted(pending.values())
        places = {r.slot.rank: f"pid {r.pid} on {r.slot.hostname}" for r in self._ranks}
        self._teardown()
        if died:
            rank = first if first in died else min(died)
            where = places.get(rank, "not started")
            raise LaunchError(
                f"RayExecutor.{what}: the Ray actor of rank {rank} ({where}) died before it "
                f"returned; the job ended and every worker was stopped: {died[rank]}"
            ) from died[rank]
        if first is None:  # only a start-up timeout leaves ranks pending without a failure
            raise LaunchError(
                f"RayExecutor.{what}: ranks {stuck} did not {what} within timeout_s="
                f"{self.settings.timeout_s:g}; every worker was stopped"
            )
        caller = f"RayExecutor.{what}"
        results_in_order(outcomes, len(refs), 0, (first, 1), caller=caller)
        raise LaunchError(f"{caller}: rank {first} failed; ranks {stuck} were stopped")

    def _teardown(self) -> None:
        """Kill the actors, remove the placement group if this executor made it, stop the
        store. Idempotent."""
        ranks, self._ranks = self._ranks, []
        for rank in ranks:
            try:
                ray.kill(rank.actor, no_restart=True)
            except Exception as e:  # already gone
                log.debug("hora.ray: killing rank %d's actor: %s", rank.slot.rank, e)
        if self._pg is not None and self._own_pg:
            try:
                remove_placement_group(self._pg)
            except Exception as e:
                log.debug("hora.ray: removing the placement group: %s", e)
        self._pg, self._own_pg = None, False
        if self._server is not None:
            self._server.stop()
            self._server = None


_NO_SLOT = SlotInfo("", -1, -1, -1, 0, 0, 0)
