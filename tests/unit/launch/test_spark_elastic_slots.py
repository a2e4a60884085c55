"""hora.spark.run_elastic's driver: which workers leave when a host's Spark tasks change, on
the driver's own records (no Spark, no worker process).

A host's slots are its registered tasks. When Spark runs a lost task again on another host,
the first host has a slot less while its other workers are healthy: they stay whatever their
slot index. The end-to-end case is tests/integration/test_spark_elastic_cluster.py's.
"""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

from hora.elastic.driver import _Member
from hora.launch.hosts import HostSlots
from hora.spark.elastic import SparkElasticJob, _Task, _TaskWorker


def _job(tasks: list[_Task]) -> SimpleNamespace:
    job = SimpleNamespace(_lock=threading.Lock(), _tasks={t.tid: t for t in tasks})
    job._superseded = lambda w: SparkElasticJob._superseded(job, w)  # type: ignore[arg-type]
    return job


def _member(label: int, slot: str, task: _Task | None) -> _Member:
    host = slot.rsplit(":", 1)[0]
    worker = _TaskWorker(label, host, {}, queue.Queue())
    worker.task = task
    if task is not None:
        task.worker = worker
    return _Member(slot, host, label, worker, slot=slot)  # type: ignore[arg-type]


def _removed(job: SimpleNamespace, live: list[_Member], hosts: list[HostSlots]) -> list[str]:
    gone = SparkElasticJob._removed(job, live, {h.name: h for h in hosts})  # type: ignore[arg-type]
    return [m.id for m in gone]


def test_a_healthy_worker_stays_when_its_hosts_other_task_moved() -> None:
    # partition 0 ran on a:0's task (tid 1), partition 1 on a:1's (tid 2); partition 0's
    # executor was lost and Spark runs it again on host b (tid 3): a has one slot left
    t1, t2, t3 = _Task(1, 0, "a"), _Task(2, 1, "a"), _Task(3, 0, "b")
    job = _job([t1, t2, t3])
    live = [_member(0, "a:0", t1), _member(1, "a:1", t2)]
    assert _removed(job, live, [HostSlots("a", 1), HostSlots("b", 1)]) == []


def test_workers_beyond_a_hosts_tasks_leave_unmatched_ones_first() -> None:
    t1, t2 = _Task(1, 0, "a"), _Task(2, 1, "a")
    job = _job([t1, t2])
    # two matched workers and one that no task took: a has two tasks, so the pending one goes
    live = [_member(0, "a:0", t1), _member(1, "a:1", t2), _member(2, "a:2", None)]
    assert _removed(job, live, [HostSlots("a", 2)]) == ["a:2"]
    # a host with fewer tasks than matched workers (not one Spark makes, but the rule holds):
    # the last started goes
    assert _removed(job, live[:2], [HostSlots("a", 1)]) == ["a:1"]
    # a host that is gone takes all its workers that still have a task
    assert _removed(job, live[:2], []) == ["a:1", "a:0"]
