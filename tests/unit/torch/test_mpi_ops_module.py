"""hora.torch.mpi_ops holds every public name of Horovod's horovod.torch.mpi_ops (v0.28.1),
the blocking differentiable ops included, as the very objects hora.torch exports."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

# The public names of horovod.torch.mpi_ops at v0.28.1 (module imports such as torch left out).
HOROVOD_MPI_OPS = """
Adasum Average Compression HorovodAllgather HorovodAllreduce HorovodAlltoall HorovodBroadcast
HorovodGroupedAllgather HorovodGroupedAllreduce HorovodGroupedReducescatter HorovodInternalError
HorovodReducescatter Max Min ProcessSet Product Sum add_process_set allgather allgather_async
allreduce allreduce_ allreduce_async allreduce_async_ alltoall alltoall_async barrier broadcast
broadcast_ broadcast_async broadcast_async_ ccl_built check_installed_version cross_rank
cross_size cuda_built ddl_built get_average_backwards_compatibility_fun global_process_set
gloo_built gloo_enabled gpu_available grouped_allgather grouped_allgather_async
grouped_allreduce grouped_allreduce_ grouped_allreduce_async grouped_allreduce_async_
grouped_reducescatter grouped_reducescatter_async handle_average_backwards_compatibility init
is_homogeneous is_initialized join local_rank local_size mpi_built mpi_enabled
mpi_threads_supported nccl_built num_rank_is_power_2 poll rank reducescatter
reducescatter_async remove_process_set rocm_built shutdown size sparse_allreduce_async
start_timeline stop_timeline synchronize
""".split()  # noqa: SIM905

FUNCTIONS = [
    "HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather", "HorovodGroupedAllgather",
    "HorovodBroadcast", "HorovodAlltoall", "HorovodReducescatter", "HorovodGroupedReducescatter",
]  # fmt: skip


def test_every_horovod_name_is_there() -> None:
    from hora.torch import mpi_ops

    missing = [n for n in HOROVOD_MPI_OPS if not hasattr(mpi_ops, n)]
    assert missing == []
    assert set(HOROVOD_MPI_OPS) <= set(mpi_ops.__all__)


def test_the_blocking_ops_import_as_horovod_scripts_write_them() -> None:
    from hora.torch.mpi_ops import allreduce, grouped_reducescatter, rank  # noqa: F401


def test_the_same_objects_as_hora_torch() -> None:
    import hora.torch as hvd
    from hora.torch import mpi_ops

    shared = [n for n in HOROVOD_MPI_OPS if hasattr(hvd, n)]
    assert len(shared) > 60
    assert [n for n in shared if getattr(hvd, n) is not getattr(mpi_ops, n)] == []


def test_function_classes_are_autograd_functions() -> None:
    import torch

    from hora.torch import mpi_ops

    for name in FUNCTIONS:
        assert issubclass(getattr(mpi_ops, name), torch.autograd.Function), name
    params = list(inspect.signature(mpi_ops.HorovodAllreduce.forward).parameters)
    assert params[:8] == ["ctx", "tensor", "average", "name", "op", "prescale_factor",
                          "postscale_factor", "process_set"]  # fmt: skip
    params = list(inspect.signature(mpi_ops.HorovodGroupedAllreduce.forward).parameters)
    assert params[:2] == ["ctx", "average"]


def test_handle_average_backwards_compatibility() -> None:
    from hora.torch import mpi_ops

    fn = mpi_ops.handle_average_backwards_compatibility
    assert fn(None, None) == mpi_ops.Average
    assert fn(mpi_ops.Max, None) == mpi_ops.Max
    with pytest.warns(DeprecationWarning):
        assert fn(None, False) == mpi_ops.Sum
    with pytest.raises(ValueError):
        fn(mpi_ops.Sum, True)


@pytest.mark.parametrize("first", ["hora.torch.mpi_ops", "hora.torch.autograd", "hora.torch"])
def test_any_import_order_works(first: str) -> None:
    """A fresh interpreter importing one module of the layers first (no import cycle)."""
    code = (
        f"import importlib; importlib.import_module({first!r}); "
        "from hora.torch.mpi_ops import allreduce, HorovodAllreduce; "
        "import hora.torch as hvd; assert hvd.allreduce is allreduce"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_priority_is_keyword_only() -> None:
    from hora.torch import mpi_ops

    names = ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce_",
             "grouped_allreduce_async", "grouped_allreduce_async_"]  # fmt: skip
    for name in names:
        p = inspect.signature(getattr(mpi_ops, name)).parameters["priority"]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, name
    assert importlib.import_module("hora.torch.async_ops").join is mpi_ops.join
