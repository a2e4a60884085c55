"""hora.ray.ElasticRayExecutor on a real local Ray cluster of two nodes (one per module).

A worker whose actor is killed with ray.kill mid-training is survived: its node leaves the
job, the others roll back to their last commit and finish, and every committed epoch counts
exactly once. Nothing is left running afterwards; a job that cannot get its minimum fails with
the reason.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'hora[ray]')")

from hora.errors import LaunchError  # noqa: E402
from hora.ray import ElasticRayExecutor  # noqa: E402

# the workers cannot import this test module: send its functions by value (the function of an
# elastic run travels through hora's store, pickled by cloudpickle itself)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

CPUS_PER_NODE = 2
pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": CPUS_PER_NODE, "include_dashboard": False},
    )
    try:
        nodes.add_node(num_cpus=CPUS_PER_NODE)
        ray.init(address=nodes.address, logging_level="ERROR", log_to_driver=False)
        nodes.wait_for_nodes()
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()  # also forgets this cluster's address on the machine


def _train(flag_dir, epochs):
    """Elastic training that counts committed epochs: each adds exactly 1.0 to ``total``
    whatever the world size; at epoch 5 each worker writes its actor id under its worker id."""
    import numpy as np

    import hora as hvd
    from hora.elastic import ObjectState, run

    hvd.init()
    state = ObjectState(hvd.broadcast_object, hvd.rank, epoch=0, total=0.0)

    @run
    def loop(state):
        while state.epoch < epochs:
            out = hvd.allreduce(np.ones(10, np.float32), op=hvd.Sum, name="grad")
            state.total += float(out[0]) / hvd.size()
            state.epoch += 1
            if state.epoch == 5:
                actor = ray.get_runtime_context().get_actor_id()
                Path(flag_dir, f"at5.{os.environ['HORA_ELASTIC_ID']}").write_text(actor)
            time.sleep(0.1)
            state.commit()

    loop(state)
    port = int(os.environ["HORA_RENDEZVOUS_PORT"])
    return hvd.rank(), hvd.size(), state.epoch, state.total, port


def _assert_nothing_left(port, deadline_s=60.0):
    total = CPUS_PER_NODE * 2
    end = time.monotonic() + deadline_s
    while ray.available_resources().get("CPU", 0) != total and time.monotonic() < end:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == total, ray.available_resources()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_actor_killed_mid_training_is_survived(cluster, tmp_path):
    settings = ElasticRayExecutor.create_settings(timeout_s=30)
    executor = ElasticRayExecutor(settings, min_workers=2, max_workers=4, elastic_timeout=60)
    head = ray.get_runtime_context().get_node_id()
    killed = []

    def kill_one_on_the_other_node():
        while len(list(tmp_path.glob("at5.*"))) < 4:
            time.sleep(0.05)
        flag = next(f for f in tmp_path.glob("at5.*") if not f.name[4:].startswith(head))
        actor_id = flag.read_text()
        victim = next(a for a in executor.workers if a._actor_id.hex() == actor_id)
        ray.kill(victim)
        killed.append(flag.name)

    killer = threading.Thread(target=kill_one_on_the_other_node, daemon=True)
    killer.start()
    results = executor.run(_train, args=[str(tmp_path), 30])
    assert killed, "the actor was not killed"
    # the two workers of the head node finished; every epoch counted exactly once
    assert [r[:4] for r in results] == [(0, 2, 30, 30.0), (1, 2, 30, 30.0)]
    assert executor.workers == []
    _assert_nothing_left(results[0][4])


def test_every_slot_trains_and_a_missing_minimum_fails(cluster, tmp_path):
    settings = ElasticRayExecutor.create_settings(timeout_s=30)
    results = ElasticRayExecutor(settings, min_workers=2).run(_train, args=[str(tmp_path), 3])
    assert [r[:4] for r in results] == [(r, 4, 3, 3.0) for r in range(4)]  # all 4 slots
    too_many = ElasticRayExecutor(settings, min_workers=5, elastic_timeout=2)
    with pytest.raises(LaunchError, match="minimum number of slots"):
        too_many.run(_train, args=[str(tmp_path), 3])
    with pytest.raises(ValueError, match="min_workers"):
        ElasticRayExecutor(settings, min_workers=3, max_workers=2)


def _train_and_log(epochs):
    import numpy as np

    import hora as hvd
    from hora.elastic import ObjectState, run
    from hora.ray import ray_logger

    hvd.init()
    state = ObjectState(hvd.broadcast_object, hvd.rank, epoch=0)

    @run
    def loop(state):
        while state.epoch < epochs:
            total = float(hvd.allreduce(np.ones(1), op=hvd.Sum, name="grad")[0])
            ray_logger.log({"epoch": state.epoch, "size": total})
            state.epoch += 1
            state.commit()

    loop(state)
    return hvd.rank()


def test_callbacks_get_what_rank_zero_logs(cluster):
    settings = ElasticRayExecutor.create_settings(timeout_s=30)
    seen = []
    executor = ElasticRayExecutor(settings, min_workers=2, max_workers=2)
    assert executor.run(_train_and_log, args=[4], callbacks=[seen.append]) == [0, 1]
    assert seen == [{"epoch": e, "size": 2.0} for e in range(4)]


def test_ray_executor_with_min_workers_runs_elastically(cluster, tmp_path):
    from hora.ray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, min_workers=2, max_workers=2, elastic_timeout=60)
    executor.start()
    results = executor.run(_train, args=[str(tmp_path), 3])
    assert [r[:4] for r in results] == [(0, 2, 3, 3.0), (1, 2, 3, 3.0)]
    with pytest.raises(ValueError, match="only runs functions with run"):
        executor.execute(lambda _: None)
    with pytest.raises(ValueError, match="do not go together"):
        RayExecutor(settings, num_workers=2, min_workers=2)
    executor.shutdown()
    _assert_nothing_left(results[0][4])


def _train_without_arguments():
    """Horovod's worker_fn: no arguments; logs each epoch and returns what it saw."""
    import numpy as np

    import hora as hvd
    from hora.elastic import ObjectState, run
    from hora.ray import ray_logger
    from hora.settings import load

    hvd.init()
    state = ObjectState(hvd.broadcast_object, hvd.rank, epoch=0)

    @run
    def loop(state):
        while state.epoch < 3:
            total = float(hvd.allreduce(np.ones(1), op=hvd.Sum, name="grad")[0])
            ray_logger.log({"epoch": state.epoch, "size": total})
            state.epoch += 1
            state.commit()

    loop(state)
    return hvd.rank(), hvd.size(), os.environ.get("MY_RUN_TAG"), load().cycle_time_ms


def test_horovods_calling_style(cluster):
    """Horovod 0.28.1's way: the bounds in create_settings, the constructor's positional order,
    env_vars (a knob among them), start(), run(worker_fn, callbacks) with worker_fn()."""
    settings = ElasticRayExecutor.create_settings(2, 2, None, 60, 30, verbose=False)
    env = {"MY_RUN_TAG": "tagged", "HOROVOD_CYCLE_TIME": "7"}
    executor = ElasticRayExecutor(settings, False, 1, None, env)
    executor.start()
    seen = []
    results = executor.run(_train_without_arguments, [seen.append])
    # max_num_proc=2 of the settings bounds the job although the cluster has 4 slots
    assert results == [(0, 2, "tagged", 7.0), (1, 2, "tagged", 7.0)]
    assert seen == [{"epoch": e, "size": 2.0} for e in range(3)]
