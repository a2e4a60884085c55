"""hora.ray.RayExecutor on a real local Ray cluster (one per module: Ray starts slowly).

Results in rank order, local ranks grouped by node, exceptions carried back with the rank, the
driver's knobs and extra_env_vars reaching the workers, a rank whose actor is killed with
ray.kill mid-training ending the job with an error naming it, and nothing left running (actors,
the placement group's resources, the rendezvous store) after success or failure.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'hora[ray]')")

from harness import pid_alive  # noqa: E402
from hora.errors import LaunchError  # noqa: E402
from hora.ray import RayExecutor  # noqa: E402

# the workers cannot import this test module: send its functions and classes by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

NUM_CPUS = 3
pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def cluster():
    ray.init(
        address="local",  # a new local Ray, whatever cluster this machine ran last
        num_cpus=NUM_CPUS,
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
    )
    yield
    ray.shutdown()


def _settings(**kw):
    return RayExecutor.create_settings(timeout_s=60, **kw)


def _identity():
    """Rank, local rank, size and a sum over all ranks, with hora's NumPy API; the worker's
    pid and the rendezvous port it was given."""
    import numpy as np

    import hora as hvd

    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)
    out = (hvd.rank(), hvd.local_rank(), hvd.size(), float(total[0]))
    hvd.shutdown()
    return out + (os.getpid(), int(os.environ["HORA_RENDEZVOUS_PORT"]))


def _assert_nothing_left(pids, port, deadline_s=60.0):
    """Every worker process has exited, Ray has all its CPUs back, the store is closed."""
    end = time.monotonic() + deadline_s
    alive = list(pids)
    while time.monotonic() < end:
        alive = [pid for pid in pids if pid_alive(pid)]
        cpus = ray.available_resources().get("CPU", 0)
        if not alive and cpus == NUM_CPUS:
            break
        time.sleep(0.2)
    assert not alive, f"worker processes {alive} still run"
    assert ray.available_resources().get("CPU", 0) == NUM_CPUS, ray.available_resources()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_run_returns_results_in_rank_order_and_stops_everything(cluster, monkeypatch):
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "3.5")  # a knob of the driver's
    executor = RayExecutor(_settings(), num_workers=2)
    executor.start(extra_env_vars={"RAY_TEST_VALUE": "given"})
    try:
        first = executor.run(_identity)
        assert [r[:4] for r in first] == [(0, 0, 2, 3.0), (1, 1, 2, 3.0)]
        envs = executor.run(
            lambda name: tuple(
                os.environ.get(n) for n in (name, "HOROVOD_CYCLE_TIME", "HORA_RENDEZVOUS_ADDR")
            ),
            args=["RAY_TEST_VALUE"],
        )
        # every rank on the driver's node: the store listens on loopback only
        assert envs == [("given", "3.5", "127.0.0.1")] * 2
        # a second job generation in the same actors; keyword arguments
        second = executor.run(lambda add=0: _identity()[0] + add, kwargs={"add": 10})
        assert second == [10, 11]
        refs = executor.run_remote(lambda: int(os.environ["HORA_RANK"]) * 2)
        assert ray.get(refs) == [0, 2]
    finally:
        executor.shutdown()
    assert executor.workers == []
    _assert_nothing_left([r[4] for r in first], first[0][5])
    with pytest.raises(LaunchError, match="call start"):
        executor.run(_identity)


class _Trainer:
    """An executable object: built in each actor after its environment is in place."""

    def __init__(self, scale):
        import hora as hvd

        hvd.init()
        self.scale = scale
        self.rank = hvd.rank()


def test_execute_and_execute_single_use_the_executable(cluster):
    with RayExecutor(_settings(), num_hosts=1, num_workers_per_host=2) as executor:
        executor.start(executable_cls=_Trainer, executable_args=[5])
        assert executor.execute(lambda t: t.rank * t.scale) == [0, 5]
        assert executor.execute_single(lambda t: (t.rank, os.environ["HORA_LOCAL_SIZE"])) == (
            0,
            "2",
        )
    assert executor.workers == []


def _raise_on_rank_one():
    import numpy as np

    import hora as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("bad batch on rank one")
    hvd.allreduce(np.ones(4))  # rank 0 waits for rank 1, which will never come
    return os.getpid()


def test_exception_is_carried_back_with_the_rank_and_ends_the_job(cluster):
    executor = RayExecutor(_settings(), num_workers=2)
    executor.start()
    pids = [p for p, _ in executor.run(lambda: (os.getpid(), 0))]
    port = executor.run(lambda: int(os.environ["HORA_RENDEZVOUS_PORT"]))[0]
    with pytest.raises(LaunchError, match="rank 1 raised an exception") as info:
        executor.run(_raise_on_rank_one)
    assert isinstance(info.value.__cause__, ValueError)
    assert "bad batch on rank one" in str(info.value)
    assert executor.workers == []
    _assert_nothing_left(pids, port)
    executor.shutdown()  # again: nothing to do


def _report_steps(steps):
    """Each rank logs one dict per step for the driver's callbacks; only rank 0's arrive."""
    import numpy as np

    import hora as hvd
    from hora.ray import ray_logger

    hvd.init()
    for step in range(steps):
        total = float(hvd.allreduce(np.ones(1), op=hvd.Sum)[0])
        ray_logger.log({"step": step, "rank": hvd.rank(), "total": total})
    rank = hvd.rank()
    ray_logger.log({"everyone": rank}, chief_only=False)
    hvd.shutdown()
    return rank


def _steps(seen):
    """The step entries among what the callbacks saw, in the order they saw them."""
    return [i for i in seen if "step" in i]


def test_callbacks_get_what_rank_zero_logs_in_order(cluster):
    seen, also = [], []

    class Counter:  # a class with __call__ is a callback too
        def __call__(self, info):
            also.append(info)

    with RayExecutor(_settings(), num_workers=2) as executor:
        executor.start()
        assert executor.run(_report_steps, args=[5], callbacks=[seen.append, Counter()]) == [0, 1]
        steps = [{"step": s, "rank": 0, "total": 2.0} for s in range(5)]
        # rank 0's steps in its order; each rank's last entry may come between them (rank 1
        # logs as soon as the last allreduce ends, which may be before rank 0's last step)
        assert _steps(seen) == steps and seen == also
        assert sorted(i["everyone"] for i in seen if "everyone" in i) == [0, 1]
        assert len(seen) == 7
        # the executable's way: execute() feeds the callbacks the same way
        got = []
        executor.execute(lambda _: _report_steps(2), callbacks=[got.append])
        assert _steps(got) == steps[:2] and len(got) == 4
        # without callbacks, log() drops the value (with a warning in the worker)
        assert executor.run(_report_steps, args=[1]) == [0, 1]

        def broken(info):
            raise RuntimeError(f"callback saw {info}")

        with pytest.raises(RuntimeError, match="callback saw"):
            executor.run(_report_steps, args=[2], callbacks=[broken])
        # the job itself went on: the workers are still there
        assert executor.run(lambda: 7) == [7, 7]


def _train(flag_dir):
    import numpy as np

    import hora as hvd

    hvd.init()
    for step in range(100000):
        hvd.allreduce(np.ones(16), name="grad")
        if step == 20:
            Path(flag_dir, f"training.{hvd.rank()}").write_text(str(os.getpid()))
        time.sleep(0.001)
    return "finished"


def test_actor_killed_mid_training_ends_the_job_naming_the_rank(cluster, tmp_path):
    executor = RayExecutor(_settings(), num_workers=2)
    executor.start()
    port = executor.run(lambda: int(os.environ["HORA_RENDEZVOUS_PORT"]))[0]
    victim = executor.workers[1]
    killed = threading.Event()

    def kill_when_training():
        while not (tmp_path / "training.1").exists():
            time.sleep(0.05)
        ray.kill(victim)
        killed.set()

    killer = threading.Thread(target=kill_when_training, daemon=True)
    killer.start()
    with pytest.raises(LaunchError, match="actor of rank 1 .* died") as info:
        executor.run(_train, args=[str(tmp_path)])
    assert killed.is_set()
    assert isinstance(info.value.__cause__, ray.exceptions.RayActorError)
    pids = [int((tmp_path / f"training.{r}").read_text()) for r in (0, 1)]
    _assert_nothing_left(pids, port)


def test_bad_input_is_refused_with_both_sides_named(cluster):
    with pytest.raises(ValueError, match="num_workers .* num_hosts"):
        RayExecutor(_settings(), num_workers=2, num_hosts=1)
    with pytest.raises(ValueError, match="positive"):
        RayExecutor.create_settings(timeout_s=0)
    with pytest.raises(ValueError, match="elastic"):
        RayExecutor(_settings(), num_workers=2, min_workers=1)
    executor = RayExecutor(
        _settings(placement_group_timeout_s=1), num_workers=2, cpus_per_worker=NUM_CPUS
    )
    with pytest.raises(LaunchError, match="could not reserve 2 x"):
        executor.start()
    assert executor.workers == []
    end = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) != NUM_CPUS and time.monotonic() < end:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == NUM_CPUS


def test_mnist_example_trains_on_ray(cluster, tmp_path):
    examples = Path(__file__).resolve().parents[2] / "examples"
    sys.path.insert(0, str(examples))
    try:
        import ray_torch_mnist
    finally:
        sys.path.remove(str(examples))
    argv = ["--epochs", "1", "--no-cuda", "--data-dir", str(tmp_path), "--log-interval", "1000"]
    accuracies, _, _ = ray_torch_mnist.run_on_ray(2, argv)
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1]  # averaged over the ranks
    assert accuracies[0] > 30.0  # one epoch on the digits: far above chance (10%)


def _executor_inside_the_group():
    """Run from a task of a placement group: the executor must use that group's bundles."""
    settings = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=5)
    with RayExecutor(settings, num_workers=2) as executor:
        executor.start()
        return executor.run(lambda: int(os.environ["HORA_RANK"]))


def test_use_current_placement_group(cluster):
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"CPU": 1}, {"CPU": 1}])
    ray.get(group.ready(), timeout=60)
    try:
        # one CPU is left outside the group: a new group of two would not fit
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True)
        task = ray.remote(num_cpus=0)(_executor_inside_the_group)
        assert ray.get(task.options(scheduling_strategy=strategy).remote(), timeout=120) == [0, 1]
    finally:
        remove_placement_group(group)


def test_nics_reach_the_workers_and_carry_the_job(cluster):
    with RayExecutor(_settings(nics="lo"), num_workers=2) as executor:
        executor.start()
        ifaces = executor.run(lambda: os.environ.get("HOROVOD_GLOO_IFACE"))
        assert ifaces == ["lo", "lo"]
        assert [r[:4] for r in executor.run(_identity)] == [(0, 0, 2, 3.0), (1, 1, 2, 3.0)]
