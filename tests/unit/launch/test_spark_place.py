"""hora.spark's rank placement: ranks grouped by executor host, local ranks within a host."""

from __future__ import annotations

import inspect

import pytest

from hora.spark.task import place


def test_ranks_are_grouped_by_host_in_order_of_first_task() -> None:
    # partitions 0 and 2 run on host b, 1 and 3 on host a (b's first task comes first)
    slots = place(["b:7001", "a:7002", "b:7003", "a:7004"])
    assert [s.rank for s in slots] == [0, 2, 1, 3]
    assert [s.hostname for s in slots] == ["b", "a", "b", "a"]
    assert [s.local_rank for s in slots] == [0, 0, 1, 1]
    assert all(s.local_size == 2 and s.size == 4 and s.cross_size == 2 for s in slots)
    assert [s.cross_rank for s in slots] == [0, 1, 0, 1]


def test_uneven_hosts() -> None:
    slots = place(["h1:1", "h2:1", "h1:2"])
    by_rank = sorted(slots, key=lambda s: s.rank)
    assert [(s.hostname, s.local_rank, s.local_size) for s in by_rank] == [
        ("h1", 0, 2),
        ("h1", 1, 2),
        ("h2", 0, 1),
    ]
    assert [s.cross_size for s in by_rank] == [2, 1, 2]


def test_run_refuses_mpi_before_needing_spark() -> None:
    import hora.spark

    with pytest.raises(ValueError, match="use_mpi=True is not supported"):
        hora.spark.run(print, use_mpi=True)
    with pytest.raises(ValueError, match="use_gloo and use_mpi"):
        hora.spark.run(print, use_mpi=True, use_gloo=True)


# horovod.spark.run's parameters and defaults, in its order (horovod/spark/runner.py, 0.28.1)
HOROVOD_SPARK_RUN = [
    ("fn", inspect.Parameter.empty), ("args", ()), ("kwargs", {}), ("num_proc", None),
    ("start_timeout", None), ("use_mpi", None), ("use_gloo", None), ("extra_mpi_args", None),
    ("env", None), ("stdout", None), ("stderr", None), ("verbose", 1), ("nics", None),
    ("prefix_output_with_timestamp", False), ("executable", None),
]  # fmt: skip


def test_signature_is_horovod_spark_runs() -> None:
    import hora.spark

    params = inspect.signature(hora.spark.run).parameters.values()
    # kwargs=None stands for Horovod's {} (no shared mutable default); it means the same
    got = [(p.name, {} if p.name == "kwargs" and p.default is None else p.default) for p in params]
    assert got == HOROVOD_SPARK_RUN


# horovod.spark.run_elastic's parameters and defaults, in its order (0.28.1)
HOROVOD_SPARK_RUN_ELASTIC = [
    ("fn", inspect.Parameter.empty), ("args", ()), ("kwargs", {}), ("num_proc", None),
    ("min_num_proc", None), ("max_num_proc", None), ("start_timeout", None),
    ("elastic_timeout", None), ("reset_limit", None), ("env", None), ("stdout", None),
    ("stderr", None), ("verbose", 1), ("nics", None), ("prefix_output_with_timestamp", False),
    ("min_np", None), ("max_np", None),  # Horovod's deprecated names, last
]  # fmt: skip


def test_signature_is_horovod_spark_run_elastics() -> None:
    import hora.spark

    params = inspect.signature(hora.spark.run_elastic).parameters.values()
    got = [(p.name, {} if p.name == "kwargs" and p.default is None else p.default) for p in params]
    assert got == HOROVOD_SPARK_RUN_ELASTIC


def test_store_create_local_and_unsupported(tmp_path) -> None:
    from hora.spark.common.store import LocalStore, Store

    store = Store.create(f"file://{tmp_path}")
    assert isinstance(store, LocalStore)
    assert store.get_train_data_path().startswith(str(tmp_path))
    assert store.get_checkpoint_path("r1") == str(tmp_path / "runs" / "r1" / "checkpoint.pt")
    assert store.get_val_data_path(2).endswith("intermediate_val_data.2")
    for path, name in (("hdfs://nn/x", "HDFSStore"), ("s3a://b/x", "S3Store")):
        with pytest.raises(NotImplementedError, match=name):
            Store.create(path)
