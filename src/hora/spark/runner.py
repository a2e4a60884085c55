"""``hora.spark.run``: a hora job whose ranks are Spark barrier tasks.

The driver (this process) keeps hora's rendezvous store, as ``hora run`` does, and submits one
barrier stage of ``num_proc`` tasks from a background thread under a job group of its own;
each task starts one rank (:mod:`hora.spark.task`). The function, its arguments and the
results travel through the store, exactly as for :func:`hora.run`
(:func:`hora.launch.api.run_on_job`). The driver thread watches the store and Spark's status
tracker: a rank that exits non-zero, a task that Spark loses, or too few tasks started within
``start_timeout`` cancels the job group at once, and the driver raises. Runs in the caller's
thread; each call is its own job.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

from hora.errors import LaunchError
from hora.launch.api import run_on_job
from hora.launch.config import LaunchConfig
from hora.launch.job import Job, exit_status
from hora.launch.workerenv import job_env
from hora.rendezvous.client import StoreClient
from hora.settings import env_lookup, load
from hora.spark.output import OutputServer
from hora.spark.task import EXIT_KEY, FAILED_KEY, STARTED_KEY, TASK_KEY, TaskSpec, barrier_task

log = logging.getLogger("hora.spark")

_POLL = 0.1  # seconds between two looks at the store and at Spark's status tracker
_ABORT_WAIT = 5.0  # seconds Spark gets to abort a stage that lost a task before hora cancels
# how Spark's abort message names the failed task's partition
_LOST_TASK = re.compile(
    r"Lost task (\d+)\.\d+ in stage|Task (\d+) in stage \S+ failed|ResultTask\(\d+, (\d+)\)"
)


def _spark_context() -> Any:
    try:
        from pyspark import SparkContext
    except ImportError:
        raise ImportError(
            "hora.spark needs pyspark: pip install 'hora[spark]' (and a Java runtime)"
        ) from None
    sc = SparkContext._active_spark_context
    if sc is None:
        raise RuntimeError(
            "hora.spark.run: no active SparkContext; create a SparkSession first "
            "(SparkSession.builder.getOrCreate())"
        )
    return sc


def _bind_address(driver_host: str, listen_any: bool) -> str:
    """Where the driver's store listens: loopback when the tasks reach the driver there (a
    ``local`` or ``local-cluster`` master with ``spark.driver.host`` on loopback), else every
    interface (the executors' hosts are not known before the tasks run)."""
    if listen_any:
        return "0.0.0.0"
    try:
        address = socket.gethostbyname(driver_host)
    except OSError:
        return "0.0.0.0"
    return "127.0.0.1" if ipaddress.ip_address(address).is_loopback else "0.0.0.0"


def _first_line(error: BaseException) -> str:
    """The gist of a (Java-sized) Spark error: its first two lines that are not py4j's
    wrapper or a Java stack frame."""
    lines = [
        line.strip().lstrip(": ")
        for line in str(error).splitlines()
        if line.strip()
        and not line.strip().startswith("at ")
        and "An error occurred while calling" not in line
    ]
    text = " / ".join(lines[:2]) if lines else type(error).__name__
    return text if len(text) <= 500 else text[:497] + "..."


class SparkJob(Job):
    """A :class:`Job` whose workers are the tasks of one Spark barrier stage.

    Entering starts the rendezvous store (no preflight: the executors' hosts are not known
    before the tasks run); ``run`` submits the stage and waits; leaving cancels the stage if it
    still runs, waits for Spark to end it, and stops the store.
    """

    def __init__(
        self,
        config: LaunchConfig,
        sc: Any,
        driver_host: str,
        executable: str | None,
        targets: dict[str, Any] | None = None,
    ):
        super().__init__(config)
        self._targets = dict(targets or {})
        self._output: OutputServer | None = None
        self._sc = sc
        self._driver_host = driver_host
        self._executable = executable
        self._group = f"hora-spark-{uuid.uuid4().hex[:12]}"
        self._thread: threading.Thread | None = None
        self._spark_error: BaseException | None = None

    def __enter__(self) -> SparkJob:
        bind = _bind_address(self._driver_host, self.config.settings.listen_any)
        self._start_store(bind)
        if self._targets:
            self._output = OutputServer(self.secret, self._targets, bind)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._cancel()
            if self._output is not None:
                self._output.close()
        finally:
            super().__exit__(exc_type, exc, tb)

    def _cancel(self) -> None:
        """Cancel the stage if it still runs and wait (bounded) for Spark to end its tasks."""
        thread = self._thread
        if thread is None:
            return
        if thread.is_alive():
            self._sc.cancelJobGroup(self._group)
        thread.join(timeout=60.0)
        if thread.is_alive():
            log.warning("hora.spark: Spark has not ended job group %s after 60 s", self._group)

    def run(self) -> int:
        cfg = self.config
        if self._server is None:
            raise LaunchError("SparkJob.run() must be called inside `with SparkJob(...) as job:`")
        common = job_env(
            os.environ if cfg.env is None else cfg.env,
            cfg.settings,
            cfg.backend,
            self.port,
            cfg.network_interfaces,
        )
        spec = TaskSpec(
            store_addr=self._driver_host,
            store_port=self.port,
            secret=self.secret,
            common_env=common,
            executable=self._executable,
            grace_seconds=cfg.grace_seconds,
            timestamp=cfg.prefix_timestamp,
            store_timeout=cfg.start_timeout,
            output_port=self._output.port if self._output is not None else None,
            forward=tuple(self._targets),
        )
        self._thread = threading.Thread(
            target=self._submit, args=(spec,), name="hora-spark-job", daemon=True
        )
        self._thread.start()
        with StoreClient("127.0.0.1", self.port, self.secret, timeout=cfg.start_timeout) as store:
            return self._watch(store)

    def _submit(self, spec: TaskSpec) -> None:
        """The background thread: run the barrier stage to its end (or its cancellation)."""
        sc = self._sc
        try:
            sc.setJobGroup(self._group, "hora.spark.run", interruptOnCancel=True)
            rdd = sc.parallelize(range(self.config.np), self.config.np)
            rdd.barrier().mapPartitions(barrier_task(spec)).collect()
        except BaseException as e:  # reported by the driver thread
            self._spark_error = e

    def _watch(self, store: StoreClient) -> int:
        np = self.config.np
        deadline = time.monotonic() + self.config.start_timeout
        assert self._thread is not None
        while True:
            done = not self._thread.is_alive()
            if store.add(FAILED_KEY, 0) > 0:
                return self._rank_failed(store)
            if done:
                if self._spark_error is None:
                    return 0
                return self._spark_failed(store, _first_line(self._spark_error))
            lost = self._failed_tasks()
            if lost:
                # let Spark abort the stage itself (its message names the lost task), then
                # cancel whatever still runs
                self._thread.join(timeout=_ABORT_WAIT)
                self._cancel()
                if store.add(FAILED_KEY, 0) > 0:
                    return self._rank_failed(store)
                why = f"Spark reports {lost} failed task(s)"
                if self._spark_error is not None:
                    why += ": " + _first_line(self._spark_error)
                return self._spark_failed(store, why)
            started = store.add(STARTED_KEY, 0)
            if started < np and time.monotonic() > deadline:
                self._sc.cancelJobGroup(self._group)
                raise LaunchError(
                    f"hora.spark.run: only {started} of num_proc={np} Spark tasks started "
                    f"within start_timeout={self.config.start_timeout:g} s; a barrier stage "
                    f"needs {np} free task slots at once and this Spark application has "
                    f"{self._sc.defaultParallelism} (spark.default.parallelism): lower "
                    "num_proc, add executors or cores, or raise start_timeout "
                    "(HOROVOD_SPARK_START_TIMEOUT)"
                )
            time.sleep(_POLL)

    def _failed_tasks(self) -> int:
        tracker = self._sc.statusTracker()
        failed = 0
        for job_id in tracker.getJobIdsForGroup(self._group):
            job = tracker.getJobInfo(job_id)
            for stage_id in job.stageIds if job is not None else ():
                stage = tracker.getStageInfo(stage_id)
                if stage is not None:
                    failed += stage.numFailedTasks + (1 if stage.currentAttemptId > 0 else 0)
        return failed

    def _rank_failed(self, store: StoreClient) -> int:
        """A rank exited non-zero: name the first, stop the stage; the job's exit code."""
        for rank in range(self.config.np):
            key = EXIT_KEY.format(rank=rank)
            if store.check([key]):
                code = int(store.get(key, timeout=0).decode())
                if code != 0:
                    self.failure = (rank, code)
                    log.error("Process %d exit with status code %s.", rank, exit_status(code))
                    break
        self._cancel()
        return 1

    def _spark_failed(self, store: StoreClient, why: str) -> int:
        """Spark ended the stage without a rank exiting non-zero (a task was killed, an
        executor lost): a rank that raised is reported by the caller; otherwise raise here."""
        from hora.launch.task import RESULT_KEY

        np = self.config.np
        if any(store.check([RESULT_KEY.format(rank=r)]) for r in range(np)):
            return 1  # run_on_job reports a rank's exception, or the missing ranks
        ranks: dict[int, str] = {}
        by_partition: dict[int, tuple[int, str]] = {}
        for partition in range(np):
            key = TASK_KEY.format(partition=partition)
            if store.check([key]):
                text_rank, host, _ = store.get(key, timeout=0).decode().split(" ", 2)
                ranks[int(text_rank)] = host
                by_partition[int(text_rank)] = (partition, host)
        exited = [r for r in ranks if store.check([EXIT_KEY.format(rank=r)])]
        missing = sorted(r for r in ranks if r not in exited)
        where = ", ".join(f"rank {r} on {ranks[r]}" for r in missing) or "none had started"
        text = str(self._spark_error or "")
        match = _LOST_TASK.search(text)
        lost = ""
        if match:
            partition = int(next(g for g in match.groups() if g is not None))
            for rank, (part, where_) in by_partition.items():
                if part == partition:
                    lost = f"the Spark task of rank {rank} on {where_} was lost; "
        raise LaunchError(
            f"hora.spark.run: {lost}the Spark stage failed before every rank returned "
            f"({why}); ranks without an exit status: {where}"
        )


def run(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    use_mpi: bool | None = None,
    use_gloo: bool | None = None,
    extra_mpi_args: str | None = None,
    env: Mapping[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
    verbose: int = 1,
    nics: Iterable[str] | None = None,
    prefix_output_with_timestamp: bool = False,
    executable: str | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` hora ranks, one per Spark barrier task;
    return the results ordered by rank (``horovod.spark.run``'s signature and meaning).

    ``num_proc`` defaults to the SparkContext's ``defaultParallelism``. ``start_timeout``
    (default ``HOROVOD_SPARK_START_TIMEOUT`` or 600 s) bounds the wait for every task to
    start. ``env`` is the workers' base environment (default the driver's ``os.environ``),
    laid over the executor's own; the ``HOROVOD_*``/``HORA_*`` knobs in it reach every rank.
    ``use_gloo`` selects the Gloo backend; ``nics`` names the interfaces the ranks use.
    ``executable`` is the Python the ranks run (default the executors' own). ``stdout`` and
    ``stderr``: streams in this process that receive the ranks' output lines (prefixed with
    the rank); ``None`` leaves that output on the executors' standard output and error (in
    ``local`` and ``local-cluster`` masters, this process's console). ``use_mpi=True`` raises:
    ranks in Spark tasks are not started
    by mpirun, so ``extra_mpi_args`` has nothing to apply to.

    Raises LaunchError naming the rank when a rank raises (chained to its exception, with its
    traceback in the message) or exits non-zero, when Spark loses a task, or when the tasks
    do not all start within ``start_timeout``.
    """
    if use_mpi and use_gloo:
        raise ValueError("Argument use_gloo and use_mpi only allow one set True.")
    if use_mpi:
        raise ValueError(
            "hora.spark.run: use_mpi=True is not supported: the ranks run in Spark tasks, "
            "which mpirun does not start; leave use_mpi unset (hora's native backend) or "
            "pass use_gloo=True"
        )
    sc = _spark_context()
    count = sc.defaultParallelism if num_proc is None else int(num_proc)
    config = job_config(
        count, start_timeout, env, nics, verbose, prefix_output_with_timestamp, use_gloo
    )
    driver_host = sc.getConf().get("spark.driver.host") or "127.0.0.1"
    targets = {n: s for n, s in (("stdout", stdout), ("stderr", stderr)) if s is not None}
    job = SparkJob(config, sc, driver_host, executable, targets)
    return run_on_job(job, fn, args, kwargs)


def job_config(
    count: int,
    start_timeout: float | None,
    env: Mapping[str, str] | None,
    nics: Iterable[str] | None,
    verbose: int,
    prefix_output_with_timestamp: bool,
    use_gloo: bool | None = None,
) -> LaunchConfig:
    """The launch configuration of a Spark job of ``count`` ranks (``run``'s and
    ``run_elastic``'s arguments; ``start_timeout`` defaults to HOROVOD_SPARK_START_TIMEOUT,
    else 600 s)."""
    base = os.environ if env is None else env
    if start_timeout is None:
        raw = env_lookup(base, "SPARK_START_TIMEOUT", "600") or "600"
        try:
            start_timeout = float(raw)
        except ValueError:
            raise ValueError(f"HOROVOD_SPARK_START_TIMEOUT={raw!r}: expected seconds") from None
    return LaunchConfig(
        command=["python", "-m", "hora.launch.task"],  # the tasks build their own
        np=count,
        backend="gloo" if use_gloo else "native",
        network_interfaces=list(dict.fromkeys(nics or ())),
        start_timeout=float(start_timeout),
        verbose=bool(verbose),
        prefix_timestamp=prefix_output_with_timestamp,
        settings=load(base),
        env=dict(base),
    )
