"""``hora.spark.run_elastic``: an elastic hora job whose workers run in Spark tasks.

The job is :mod:`hora.elastic.driver`'s (through :class:`hora.elastic.remote.SchedulerJob`),
with Spark deciding where workers run. The driver (this process) keeps the rendezvous store
and submits one ordinary (not barrier) stage of ``max(num_proc, max_np)`` tasks under a job
group of its own. Each task attempt registers in the store with its executor's host and waits;
the elastic driver sees the registered tasks as its hosts' slots, and starting a worker on a
slot hands one waiting task of that host the worker's environment: the task then runs one
worker process (:func:`hora.spark.task.start_rank`) and reports its exit status.

A worker that fails makes its task fail, so Spark runs the task again (up to
``spark.task.maxFailures``, ``local[N,F]``'s F); the new attempt registers and the driver
starts a worker in it, which joins at the next re-formation while the others roll back to
their last commit. Spark, not hora, decides whether a host whose task failed gets the retry
(``spark.excludeOnFailure.*``), so hora blacklists no host. Each re-formation counts against
``reset_limit``; a job that exceeds it, or that has fewer than ``min_np`` workers once Spark
can retry no more, fails with the reason, and the Spark job is cancelled.

A host's slots are its tasks, not numbered places: a lost executor's tasks may run again on
another host, so a host can have a slot less while its other workers are healthy. Those stay,
whatever the slot index the driver gave them; workers leave only where a host has more of them
than tasks (those no task took yet first), and new workers start only for tasks no worker
holds.

Store keys, under ``spark/elastic/``: ``tasks`` (a counter: the attempt's id), ``task/<id>``
(``<partition> <host> <pid>``), ``work/<id>`` (the worker's environment, JSON), ``stop/<id>``
(the driver asks the worker to stop), ``exit/<id>`` (its exit status), ``done`` (the job is
over: waiting tasks return).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from hora.elastic.remote import KILLED, RemoteWorker, SchedulerJob
from hora.errors import LaunchError, RendezvousError
from hora.launch.api import run_on_job
from hora.launch.config import ElasticOptions, LaunchConfig
from hora.launch.hosts import HostSlots, assign_ranks
from hora.launch.process import ConsoleSink
from hora.launch.workerenv import exportable
from hora.rendezvous.client import StoreClient
from hora.spark.output import OutputServer
from hora.spark.runner import _first_line, _spark_context, job_config
from hora.spark.task import TaskSpec, start_rank

log = logging.getLogger("hora.spark")

COUNT_KEY = "spark/elastic/tasks"
TASK_KEY = "spark/elastic/task/{tid}"
WORK_KEY = "spark/elastic/work/{tid}"
STOP_KEY = "spark/elastic/stop/{tid}"
EXIT_KEY = "spark/elastic/exit/{tid}"
DONE_KEY = "spark/elastic/done"

# how a task of ours says why it failed (in the error Spark raises once it gives up on it)
_WORKER_EXIT = re.compile(r"an elastic worker exited with status -?\d+")
_POLL = 0.1  # seconds between two looks at the store, in the tasks and on the driver
_STOPPED = -15  # the exit status of a worker stopped before a task took it (as by SIGTERM)


# -- the executor's side ------------------------------------------------------------------------
def elastic_task(spec: TaskSpec) -> Callable[[int, Iterator[object]], Iterator[int]]:
    """The function Spark runs for each partition (``mapPartitionsWithIndex``)."""

    def run(partition: int, _: Iterator[object]) -> Iterator[int]:
        code = run_worker(spec, partition, socket.gethostname())
        if code is not None and code != 0:
            # Spark runs the task again: the new attempt is the job's new worker
            raise RuntimeError(f"hora.spark: an elastic worker exited with status {code}")
        yield 0 if code is None else code

    return run


def run_worker(spec: TaskSpec, partition: int, host: str) -> int | None:
    """Register as a free slot on ``host``, wait for a worker to run and run it; its exit
    status (0 when the driver stopped it), or None when the job ended before one came."""
    with contextlib.ExitStack() as cleanup:
        store = cleanup.enter_context(
            StoreClient(spec.store_addr, spec.store_port, spec.secret, timeout=spec.store_timeout)
        )
        if store.check([DONE_KEY]):
            return None
        tid = store.add(COUNT_KEY, 1)
        store.set(TASK_KEY.format(tid=tid), f"{partition} {host} {os.getpid()}".encode())
        work = WORK_KEY.format(tid=tid)
        while True:
            try:
                store.wait([work], timeout=1.0)
                break
            except RendezvousError:
                if store.check([DONE_KEY]):
                    return None
        given = json.loads(store.get(work).decode())
        env = exportable(os.environ)
        env.update(given["env"])
        worker, exits = start_rank(spec, env, int(given["label"]), cleanup)
        stop, stopped = STOP_KEY.format(tid=tid), False
        while True:
            try:
                _, code = exits.get(timeout=_POLL)
                break
            except queue.Empty:
                if not stopped and store.check([stop]):
                    worker.stop()
                    stopped = True
        store.set(EXIT_KEY.format(tid=tid), str(code).encode())
    return 0 if stopped else code


# -- the driver's side --------------------------------------------------------------------------
@dataclass
class _Task:
    """One registered task attempt."""

    tid: int
    partition: int
    host: str
    worker: _TaskWorker | None = None
    code: int | None = None  # its worker's exit status, once known


class _TaskWorker(RemoteWorker):
    """A worker the driver started on ``host``: pending until a free task of that host takes
    it; stopping it asks that task to stop its process."""

    def __init__(
        self, label: int, host: str, env: dict[str, str], exits: queue.Queue[tuple[int, int]]
    ):
        super().__init__(label, exits)
        self.host = host
        self.env = env
        self.task: _Task | None = None
        self.stopping = False
        self.asked = False  # the task was asked to stop it

    def stop(self) -> None:
        self.stopping = True  # the job's matcher thread passes it on


class SparkElasticJob(SchedulerJob):
    """An elastic job whose workers run in the tasks of one Spark stage (the module's text)."""

    def __init__(
        self,
        config: LaunchConfig,
        options: ElasticOptions,
        sc: Any,
        driver_host: str,
        spec: dict[str, Any],
        tasks: int,
        targets: dict[str, Any],
    ) -> None:
        self._sc = sc
        self._driver_host = driver_host
        self._spec_args = spec
        self._task_count = tasks
        self._targets = targets
        self._output: OutputServer | None = None
        self._group = f"hora-spark-elastic-{uuid.uuid4().hex[:12]}"
        self._spark: threading.Thread | None = None
        self.spark_error: BaseException | None = None
        self._lock = threading.Lock()
        self._tasks: dict[int, _Task] = {}
        self._pending: list[_TaskWorker] = []
        self._running: list[_TaskWorker] = []
        self._matcher: threading.Thread | None = None
        self._closing = threading.Event()
        self._ready = False  # the store is up and the stage submitted
        super().__init__(config, options, driver_host, config.network_interfaces, "Spark")

    # -- hosts: the registered tasks --------------------------------------------------------
    def _wait_for_hosts(self, np: int) -> list[HostSlots]:
        if not self._ready:  # from the constructor: the tasks start once the store is up
            return [HostSlots("<spark tasks>", max(np, self.options.max_np or np))]
        deadline = time.monotonic() + self.config.start_timeout
        while True:
            hosts = self._discover()
            if sum(h.slots for h in hosts) >= np:
                return hosts
            if self._spark is not None and not self._spark.is_alive():
                raise LaunchError(self._spark_ended())
            if time.monotonic() > deadline:
                found = ",".join(f"{h.name}:{h.slots}" for h in hosts) or "none"
                raise LaunchError(
                    f"only {found} of num_proc={np} Spark tasks started within "
                    f"start_timeout={self.config.start_timeout:g} s; this Spark application "
                    f"has {self._sc.defaultParallelism} task slots "
                    "(spark.default.parallelism): lower num_proc, add executors or cores, or "
                    "raise start_timeout (HOROVOD_SPARK_START_TIMEOUT)"
                )
            time.sleep(_POLL)

    def _discover(self) -> list[HostSlots]:
        """Each host's slots: the partitions whose newest attempt registered there (a failed
        attempt counts until Spark's retry registers; a finished one until the job ends)."""
        with self._lock:
            newest: dict[int, _Task] = {}
            for task in self._tasks.values():
                newest[task.partition] = task  # tids grow with time
            hosts: dict[str, int] = {}
            for task in newest.values():
                hosts[task.host] = hosts.get(task.host, 0) + 1
        return [HostSlots(h, n) for h, n in hosts.items()]

    def _removed(self, live: list[Any], hosts: dict[str, HostSlots]) -> list[Any]:
        """A host's slots are its tasks, not numbered places: when Spark runs a lost task
        again on another host, the first host has a slot less while its other workers are
        healthy, whatever their slot index. So workers leave only where a host has more of
        them than tasks: those no task took yet first, then the last started. A worker whose
        task Spark runs again is gone already (the matcher reports its exit)."""
        gone: list[Any] = []
        with self._lock:
            by_host: dict[str, list[Any]] = {}
            for m in live:
                if not self._superseded(m.worker):
                    by_host.setdefault(m.host, []).append(m)
            for host, members in by_host.items():
                excess = len(members) - (hosts[host].slots if host in hosts else 0)
                if excess > 0:
                    order = sorted(members, key=lambda m: (m.worker.task is not None, -m.label))
                    gone.extend(order[:excess])
        return gone

    def _superseded(self, worker: _TaskWorker) -> bool:
        """Whether Spark started a newer attempt of ``worker``'s task (caller holds the
        lock)."""
        task = worker.task
        return task is not None and any(
            t.partition == task.partition and t.tid > task.tid for t in self._tasks.values()
        )

    def _blacklist_host(self, host: str) -> None:
        log.info("hora.spark: a worker on %s failed; Spark runs its task again", host)

    def _can_grow(self) -> bool:
        return self._spark is not None and self._spark.is_alive()

    def _spawn(  # type: ignore[override]
        self, label: int, host: str, env: dict[str, str], stdout: ConsoleSink, stderr: ConsoleSink
    ) -> _TaskWorker:
        worker = _TaskWorker(label, host, env, self._exits)
        with self._lock:
            self._pending.append(worker)
        self.workers.append(worker)  # type: ignore[arg-type]
        return worker

    # -- the matcher: tasks take workers, exits come back -------------------------------------
    def _match(self) -> None:
        with StoreClient("127.0.0.1", self.port, self.secret) as store:
            seen = 0
            while not self._closing.is_set():
                try:
                    seen = self._match_once(store, seen)
                except Exception as e:  # the store stopped under us: the job is over
                    log.debug("hora.spark: matcher: %s", e)
                    return
                time.sleep(_POLL)

    def _match_once(self, store: StoreClient, seen: int) -> int:
        count = store.add(COUNT_KEY, 0)
        for tid in range(seen + 1, count + 1):
            key = TASK_KEY.format(tid=tid)
            store.wait([key], timeout=30.0)
            partition, host, _ = store.get(key).decode().split(" ", 2)
            with self._lock:
                self._tasks[tid] = _Task(tid, int(partition), host)
        alive = self._spark is not None and self._spark.is_alive()
        with self._lock:
            for w in [w for w in self._pending if w.stopping or not alive]:
                self._pending.remove(w)
                w.finish(_STOPPED if w.stopping else KILLED)
            for w in list(self._pending):
                free = [t for t in self._tasks.values() if t.host == w.host and t.worker is None]
                if not free:
                    continue
                task = free[0]
                task.worker, w.task = w, task
                payload = {"env": w.env, "label": w.label}
                store.set(WORK_KEY.format(tid=task.tid), json.dumps(payload).encode())
                self._pending.remove(w)
                self._running.append(w)
            for w in list(self._running):
                assert w.task is not None
                key = EXIT_KEY.format(tid=w.task.tid)
                if store.check([key]):
                    w.task.code = int(store.get(key).decode())
                    self._running.remove(w)
                    w.finish(w.task.code)
                elif not alive or self._superseded(w):
                    # Spark ended the stage, or runs this task again: the worker is gone
                    self._running.remove(w)
                    w.finish(KILLED)
                elif w.stopping and not w.asked:
                    store.set(STOP_KEY.format(tid=w.task.tid), b"1")
                    w.asked = True
        return count

    # -- the stage ------------------------------------------------------------------------------
    def _submit(self, spec: TaskSpec) -> None:
        sc = self._sc
        try:
            sc.setJobGroup(self._group, "hora.spark.run_elastic", interruptOnCancel=True)
            rdd = sc.parallelize(range(self._task_count), self._task_count)
            rdd.mapPartitionsWithIndex(elastic_task(spec)).collect()
        except BaseException as e:  # the driver reports it
            self.spark_error = e

    def _spark_ended(self) -> str:
        if self.spark_error is None:
            return "the Spark job ended before the training did"
        last = _WORKER_EXIT.search(str(self.spark_error))
        if last:
            why = (
                "Spark gave up on a task that failed as often as spark.task.maxFailures allows;"
                f" its last attempt: {last.group(0)}"
            )
        else:
            why = _first_line(self.spark_error)
        return f"the Spark job ended before the training did ({why})"

    def __enter__(self) -> SparkElasticJob:
        super().__enter__()
        bind = "0.0.0.0"
        if self._targets:
            self._output = OutputServer(self.secret, self._targets, bind)
        return self

    def run(self) -> int:
        spec = TaskSpec(
            store_addr=self._driver_host,
            store_port=self.port,
            secret=self.secret,
            common_env={},
            output_port=self._output.port if self._output is not None else None,
            forward=tuple(self._targets),
            **self._spec_args,
        )
        self._spark = threading.Thread(
            target=self._submit, args=(spec,), name="hora-spark-job", daemon=True
        )
        self._spark.start()
        self._matcher = threading.Thread(target=self._match, name="hora-spark-match", daemon=True)
        self._matcher.start()
        self._ready = True
        try:
            self._hosts = self._wait_for_hosts(self.config.np)
        except LaunchError as e:
            self.error = e
            return 1
        total = sum(h.slots for h in self._hosts)
        cap = total if self.options.max_np is None else min(total, self.options.max_np)
        self.slots = assign_ranks(self._hosts, cap)
        try:
            code = super().run()
        finally:
            with StoreClient("127.0.0.1", self.port, self.secret) as store:
                store.set(DONE_KEY, b"1")  # waiting tasks return
        if code != 0 and self.spark_error is not None and not self._spark.is_alive():
            why = f": {self.error}" if self.error is not None else ""
            self.error = LaunchError(self._spark_ended() + why)
        return code

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            spark = self._spark
            if spark is not None:
                spark.join(timeout=5.0)  # waiting tasks see "done" and return
                if spark.is_alive():
                    self._sc.cancelJobGroup(self._group)
                    spark.join(timeout=60.0)
                if spark.is_alive():
                    log.warning("hora.spark: Spark has not ended job group %s", self._group)
            self._closing.set()
            if self._matcher is not None:
                self._matcher.join(timeout=10.0)
            if self._output is not None:
                self._output.close()
        finally:
            super().__exit__(exc_type, exc, tb)


def run_elastic(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    start_timeout: float | None = None,
    elastic_timeout: float | None = None,
    reset_limit: int | None = None,
    env: Mapping[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
    verbose: int = 1,
    nics: Iterable[str] | None = None,
    prefix_output_with_timestamp: bool = False,
    min_np: int | None = None,
    max_np: int | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as an elastic hora job whose workers run in Spark tasks;
    the results of the final round's ranks, in rank order (``horovod.spark.run_elastic``'s
    signature and meaning).

    ``fn`` trains with ``hvd.elastic.run`` and a state object, as under ``hora run --min-np``.
    ``num_proc`` (default ``spark.default.parallelism``) workers start the job;
    ``min_num_proc`` (default ``num_proc``) are needed to go on; ``max_num_proc`` Spark
    tasks are submitted (default ``num_proc``); ``min_np``/``max_np`` are their deprecated
    names, as in Horovod. A worker that fails makes its
    task fail; Spark runs it again (``spark.task.maxFailures``) and the new attempt joins the
    job, the others rolling back to their last commit. ``reset_limit`` bounds the
    re-formations; ``elastic_timeout`` (default ``HOROVOD_ELASTIC_TIMEOUT``, 600 s) how long
    one may take; ``start_timeout`` (default ``HOROVOD_SPARK_START_TIMEOUT``, 600 s) how long
    the first ``num_proc`` tasks may take to start. ``env``, ``stdout``, ``stderr``, ``nics``,
    ``verbose`` and ``prefix_output_with_timestamp`` as for :func:`hora.spark.run`.

    Raises LaunchError with the reason when the job fails (the reset limit, fewer than
    ``min_np`` workers once Spark retries no more, a rank that raised, a timeout); the Spark
    job is cancelled and the store stopped first.
    """
    min_np = min_np if min_num_proc is None else min_num_proc  # min_np/max_np: old names
    max_np = max_np if max_num_proc is None else max_num_proc
    sc = _spark_context()
    count = sc.defaultParallelism if num_proc is None else int(num_proc)
    low = count if min_np is None else int(min_np)
    high = count if max_np is None else int(max_np)
    if not 1 <= low <= count <= high:
        raise ValueError(
            f"hora.spark.run_elastic: min_np={low}, num_proc={count}, max_np={high}: need "
            "1 <= min_np <= num_proc <= max_np"
        )
    config = job_config(count, start_timeout, env, nics, verbose, prefix_output_with_timestamp)
    options = ElasticOptions(
        min_np=low,
        max_np=high,
        elastic_timeout=config.settings.elastic_timeout
        if elastic_timeout is None
        else float(elastic_timeout),
        reset_limit=reset_limit,
    )
    driver_host = sc.getConf().get("spark.driver.host") or "127.0.0.1"
    targets = {n: s for n, s in (("stdout", stdout), ("stderr", stderr)) if s is not None}
    spec = {
        "grace_seconds": config.grace_seconds,
        "timestamp": config.prefix_timestamp,
        "store_timeout": config.start_timeout,
    }
    job = SparkElasticJob(config, options, sc, driver_host, spec, high, targets)
    try:
        return run_on_job(job, fn, args, kwargs, elastic=True, caller="hora.spark.run_elastic")
    except LaunchError as e:
        if job.error is not None:
            raise LaunchError(f"hora.spark.run_elastic: {job.error}") from e
        raise
