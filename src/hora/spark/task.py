"""The Spark side of :func:`hora.spark.run`: what one barrier task does in its executor.

Each task works out its rank from the addresses of all tasks of the barrier stage (ranks are
grouped by executor host, so local ranks and local sizes are those of the host), records
itself in the driver's rendezvous store, starts ``python -m hora.launch.task`` as one hora rank
under the launcher's stoppable wrapper (:func:`hora.launch.process.wrapper_script`), and waits
for it. The rank's exit status goes to the store; a non-zero one fails the task, and so the
Spark job. When Spark kills the task's Python worker, the wrapper sees end-of-file on its stdin
and stops the rank. Runs in the Spark Python worker's task thread.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from hora.launch import local
from hora.launch.hosts import HostSlots, SlotInfo, assign_ranks
from hora.launch.job import exit_status
from hora.launch.process import ConsoleSink, Worker, wrapper_script
from hora.launch.workerenv import exportable, rank_env
from hora.rendezvous.client import StoreClient
from hora.spark import output

STARTED_KEY = "spark/started"  # counter: tasks that started their rank
FAILED_KEY = "spark/failed"  # counter: ranks that exited non-zero
TASK_KEY = "spark/task/{partition}"  # "<rank> <host> <task pid>"
EXIT_KEY = "spark/exit/{rank}"  # the rank's exit code


@dataclass(frozen=True)
class TaskSpec:
    """What the driver sends to every task (inside the task's closure)."""

    store_addr: str
    store_port: int
    secret: bytes
    common_env: dict[str, str]
    executable: str | None = None  # None: the executor's Python
    grace_seconds: float = 5.0
    timestamp: bool = False
    store_timeout: float = 30.0
    output_port: int | None = None  # the driver's OutputServer, when it forwards output
    forward: tuple[str, ...] = ()  # the streams it forwards ("stdout", "stderr")


def place(addresses: Sequence[str]) -> list[SlotInfo]:
    """Each task's slot, indexed by partition, from the ``host:port`` of every task.

    Hosts are ordered by their first task; a host's tasks take its slots by partition order.
    """
    hosts = [address.rsplit(":", 1)[0] for address in addresses]
    order = list(dict.fromkeys(hosts))
    slots = assign_ranks([HostSlots(h, hosts.count(h)) for h in order], len(hosts))
    by_host: dict[str, list[SlotInfo]] = {}
    for slot in slots:
        by_host.setdefault(slot.hostname, []).append(slot)
    return [by_host[host].pop(0) for host in hosts]


def start_rank(
    spec: TaskSpec, env: dict[str, str], label: int, cleanup: contextlib.ExitStack
) -> tuple[Worker, queue.Queue[tuple[int, int]]]:
    """Start one rank (``python -m hora.launch.task`` under the launcher's stoppable wrapper)
    with ``env``, its output tagged ``label`` (and forwarded to the driver when asked for:
    ``cleanup`` closes those connections); the worker and the queue its exit status comes on."""
    command = [spec.executable or sys.executable, "-m", "hora.launch.task"]
    script = wrapper_script(command, grace_seconds=spec.grace_seconds)
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    sinks = {"stdout": ConsoleSink(sys.stdout), "stderr": ConsoleSink(sys.stderr)}
    for name in spec.forward:
        assert spec.output_port is not None
        conn = output.connect(
            spec.store_addr, spec.output_port, spec.secret, name, spec.store_timeout
        )
        cleanup.callback(conn.close)
        sinks[name] = ConsoleSink(conn)  # type: ignore[arg-type]  # a binary stream
    worker = Worker(
        label,
        local.worker_argv(script),
        env=env,
        cwd=None,
        stdin_data=spec.secret.hex().encode() + b"\n",
        stdout=sinks["stdout"],
        stderr=sinks["stderr"],
        exits=exits,
        timestamp=spec.timestamp,
    )
    return worker, exits


def run_rank(spec: TaskSpec, partition: int, addresses: Sequence[str]) -> tuple[int, int]:
    """Start this task's rank, wait for it; ``(rank, exit code)``."""
    slot = place(addresses)[partition]
    env = exportable(os.environ)
    env.update(spec.common_env)
    env = rank_env(env, slot, spec.store_addr)
    with contextlib.ExitStack() as cleanup:
        store = cleanup.enter_context(
            StoreClient(spec.store_addr, spec.store_port, spec.secret, timeout=spec.store_timeout)
        )
        _, exits = start_rank(spec, env, slot.rank, cleanup)
        record = f"{slot.rank} {slot.hostname} {os.getpid()}"
        store.set(TASK_KEY.format(partition=partition), record.encode())
        store.add(STARTED_KEY, 1)
        rank, code = exits.get()
        store.set(EXIT_KEY.format(rank=rank), str(code).encode())
        if code != 0:
            store.add(FAILED_KEY, 1)
    return rank, code


def barrier_task(spec: TaskSpec) -> object:
    """The function Spark runs for each partition of the barrier stage."""

    def run(_: Iterator[object]) -> Iterator[tuple[int, int]]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        if ctx.attemptNumber() > 0:
            raise RuntimeError(
                "hora.spark: a task of this job failed before; hora does not retry a job's "
                "tasks (the driver reports the first failure)"
            )
        addresses = [info.address for info in ctx.getTaskInfos()]
        rank, code = run_rank(spec, ctx.partitionId(), addresses)
        if code != 0:
            raise RuntimeError(f"hora.spark: rank {rank} exited with status {exit_status(code)}")
        yield rank, code

    return run
