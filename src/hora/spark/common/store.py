"""Stores (``horovod.spark.common.store``): where an estimator keeps the training data Spark
writes as Parquet, and each run's checkpoints.

:class:`LocalStore` is a directory that the driver and every executor see at the same path (a
local path on one machine, a shared file system on a cluster). :meth:`Store.create` picks the
store from the path; HDFS, S3, GCS and DBFS stores are not supported yet and say so. Plain
path arithmetic and file reads; thread-safe.
"""

from __future__ import annotations

import os

_REMOTE = {
    "hdfs://": "HDFSStore",
    "s3://": "S3Store",
    "s3a://": "S3Store",
    "s3n://": "S3Store",
    "gs://": "GCSStore",
    "dbfs:/": "DBFSLocalStore",
}


class Store:
    """The base: paths of the data and of the runs under one prefix."""

    def __init__(self, prefix_path: str):
        self.prefix_path = prefix_path

    @staticmethod
    def create(prefix_path: str, *args: object, **kwargs: object) -> Store:
        """The store for ``prefix_path``: a :class:`LocalStore` for a local path (or
        ``file://``); NotImplementedError naming the store for HDFS, S3, GCS and DBFS."""
        for scheme, name in _REMOTE.items():
            if prefix_path.startswith(scheme):
                raise NotImplementedError(
                    f"Store.create({prefix_path!r}): hora has no {name} yet; use a directory "
                    "that the driver and every executor see at the same path (LocalStore)"
                )
        return LocalStore(prefix_path, *args, **kwargs)  # type: ignore[arg-type]

    def get_train_data_path(self, idx: int | None = None) -> str:
        raise NotImplementedError

    def get_val_data_path(self, idx: int | None = None) -> str:
        raise NotImplementedError

    def get_run_path(self, run_id: str) -> str:
        raise NotImplementedError


class LocalStore(Store):
    """A directory seen at the same path by the driver and the executors."""

    def __init__(
        self,
        prefix_path: str,
        train_path: str | None = None,
        val_path: str | None = None,
        runs_path: str | None = None,
        save_runs: bool = True,
    ):
        path = prefix_path[len("file://") :] if prefix_path.startswith("file://") else prefix_path
        path = os.path.abspath(path)
        super().__init__(path)
        self._train = train_path or os.path.join(path, "intermediate_train_data")
        self._val = val_path or os.path.join(path, "intermediate_val_data")
        self._runs = runs_path or os.path.join(path, "runs")
        self._save_runs = save_runs

    def get_train_data_path(self, idx: int | None = None) -> str:
        return self._train if idx is None else f"{self._train}.{idx}"

    def get_val_data_path(self, idx: int | None = None) -> str:
        return self._val if idx is None else f"{self._val}.{idx}"

    def saving_runs(self) -> bool:
        return self._save_runs

    def get_runs_path(self) -> str:
        return self._runs

    def get_run_path(self, run_id: str) -> str:
        return os.path.join(self._runs, run_id)

    def get_checkpoint_path(self, run_id: str) -> str:
        return os.path.join(self.get_run_path(run_id), "checkpoint.pt")

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def to_spark_path(self, path: str) -> str:
        """``path`` as Spark's writers take it (``file://`` + the absolute path)."""
        return "file://" + os.path.abspath(path)
