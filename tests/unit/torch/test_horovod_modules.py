"""Horovod scripts import from submodules too (``horovod.common.exceptions``,
``horovod.torch.mpi_ops``); the same imports work with ``hora`` in place of ``horovod``."""

from __future__ import annotations

import pytest

import hora
import hora.torch as hvd
from hora import errors


def test_common_exceptions_are_horas_error_classes() -> None:
    from hora.common.exceptions import (
        HorovodInternalError,
        HorovodVersionMismatchError,
        HostsUpdatedInterrupt,
    )

    assert HorovodInternalError is errors.HorovodInternalError
    assert HostsUpdatedInterrupt is errors.HostsUpdatedInterrupt
    assert HorovodVersionMismatchError is errors.HorovodVersionMismatchError
    assert issubclass(HorovodInternalError, RuntimeError)


def test_common_process_sets() -> None:
    from hora.common.process_sets import (
        ProcessSet,
        add_process_set,
        global_process_set,
        remove_process_set,
    )

    assert ProcessSet is hora.ProcessSet and global_process_set is hora.global_process_set
    assert add_process_set is hora.add_process_set
    assert remove_process_set is hora.remove_process_set


def test_mpi_ops_holds_horovods_names() -> None:
    from hora.torch.mpi_ops import (  # all of them live in horovod.torch.mpi_ops
        HorovodInternalError,
        ProcessSet,
        allreduce_async_,
        global_process_set,
        init,
        local_rank,
        mpi_threads_supported,
        rank,
        size,
        synchronize,
    )

    assert (init, rank, size, local_rank) == (hvd.init, hvd.rank, hvd.size, hvd.local_rank)
    assert mpi_threads_supported is hvd.mpi_threads_supported
    assert (allreduce_async_, synchronize) == (hvd.allreduce_async_, hvd.synchronize)
    assert HorovodInternalError is hvd.HorovodInternalError and ProcessSet is hvd.ProcessSet
    assert global_process_set is hvd.global_process_set
    with pytest.raises(ImportError):
        from hora.torch.mpi_ops import no_such_name  # noqa: F401
