"""hora.ray.ElasticRayExecutor takes Horovod 0.28.1's calls (create_settings with the elastic
bounds, the constructor's positional order, run(worker_fn, callbacks)) and hora's keywords
after them; checked in this process, without starting Ray (tests/integration/test_ray_elastic.py
runs jobs)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install 'hora[ray]')")

from hora.ray import ElasticRayExecutor, RayExecutor  # noqa: E402
from hora.ray.elastic_settings import ElasticRaySettings  # noqa: E402


def test_create_settings_carries_the_elastic_bounds() -> None:
    s = ElasticRayExecutor.create_settings(
        2, 6, 3, 120, 45, None, "eth0,eth1", verbose=True, cooldown_range=(5, 50), ssh_port=22
    )
    assert isinstance(s, ElasticRaySettings)
    assert (s.min_num_proc, s.max_num_proc, s.reset_limit, s.elastic_timeout) == (2, 6, 3, 120)
    assert (s.timeout_s, s.nics, s.num_proc) == (45, ("eth0", "eth1"), 2)
    assert (s.verbose, s.cooldown_range, s.extra) == (1, (5, 50), {"ssh_port": 22})
    with pytest.warns(DeprecationWarning, match="_np is deprecated, use m.._num_proc"):
        old = ElasticRayExecutor.create_settings(min_np=3, max_np=4)
    assert (old.min_num_proc, old.max_num_proc) == (3, 4)


def test_create_settings_refuses_what_cannot_work() -> None:
    with pytest.raises(TypeError, match="no_such_option"):
        ElasticRayExecutor.create_settings(no_such_option=1)
    with pytest.raises(ValueError, match="minimum 3, maximum 2"):
        ElasticRayExecutor.create_settings(min_num_proc=3, max_num_proc=2)
    with pytest.raises(ValueError, match="cooldown_range"):
        ElasticRayExecutor.create_settings(cooldown_range=(9, 1))


def test_the_executor_takes_its_bounds_from_the_settings() -> None:
    s = ElasticRayExecutor.create_settings(
        min_num_proc=2, max_num_proc=5, reset_limit=1, elastic_timeout=30
    )
    ex = ElasticRayExecutor(s, False, 2, None, {"MY_FLAG": 7})  # Horovod's positional order
    assert (ex.min_workers, ex.max_workers, ex.reset_limit, ex.elastic_timeout) == (2, 5, 1, 30)
    assert (ex.cpus_per_slot, ex.gpus_per_slot, ex.use_gpu) == (2, 0, False)
    assert ex.env_vars == {"MY_FLAG": "7"}
    # hora's keywords win over the settings
    mine = ElasticRayExecutor(s, min_workers=3, max_workers=3, cpus_per_worker=0.5)
    assert (mine.min_workers, mine.max_workers, mine.cpus_per_worker) == (3, 3, 0.5)
    gpu = ElasticRayExecutor(s, use_gpu=True, cpus_per_slot=1, gpus_per_slot=2)
    assert gpu.gpus_per_worker == 2


def test_the_executor_refuses_what_horovod_refuses() -> None:
    s = ElasticRayExecutor.create_settings(min_num_proc=2)
    with pytest.raises(ValueError, match="needs use_gpu=True"):
        ElasticRayExecutor(s, use_gpu=False, gpus_per_slot=1)
    with pytest.raises(ValueError, match="min_workers=2, max_workers=1"):
        ElasticRayExecutor(s, max_workers=1)
    with pytest.raises(ValueError, match="host_discovery_script"):
        ElasticRayExecutor(s, override_discovery=False)


def test_run_names_arguments_passed_where_callbacks_go() -> None:
    ex = ElasticRayExecutor(ElasticRayExecutor.create_settings())
    with pytest.raises(TypeError, match=r"args=\[\.\.\.\]"):
        ex.run(print, [1, 2])  # hora's old run(fn, args): the arguments now go by keyword


def test_ray_executors_elastic_form_still_builds_one() -> None:
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), min_workers=2, max_workers=4)
    assert ex._elastic is not None
    assert (ex._elastic.min_workers, ex._elastic.max_workers) == (2, 4)
