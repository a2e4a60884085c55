"""Device tensors through the engine with a backend that takes them as they are (NCCL).

hora.torch hands the engine the tensors themselves (no pinned staging, no NumPy view); the
executor fuses, scales and allocates on the device and hands back device tensors.

Without a GPU the ranks run the NCCL backend class over Gloo groups on CPU tensors, which stand
in for the GPU's: torch.cuda's streams and events are replaced by a fake (``FakeStreams``, from
tests/cuda_fakes.py, as the backend unit tests use) and hora.torch's stream runtime by
``FakeCudaRuntime``. Every backend call is recorded: each must get tensors, never host arrays,
and no pinned buffer is taken nor any tensor turned into NumPy. With a GPU, the same ops run
through real NCCL on CUDA tensors (one rank: NCCL takes one rank per GPU).
"""

from __future__ import annotations

from typing import Any

import pytest

from cuda_fakes import cuda_only, fake_gpu_process
from harness import run_ranks


def _fake_gpu(calls: list[str]) -> Any:
    """The fakes (cuda_fakes.fake_gpu_process), every collective recording its buffer."""
    return fake_gpu_process(
        calls, ("allreduce", "allgatherv", "broadcast", "alltoallv", "reducescatterv")
    )


def _device_ops(rank: int, mode: str) -> dict[str, Any]:
    """Every op of hora.torch on tensors of the job's device; results as lists."""
    import torch

    import hora.torch as hvd

    calls: list[str] = []
    numpy_calls = [0]
    rt = None
    if mode == "fake":
        rt = _fake_gpu(calls)
        real_numpy = torch.Tensor.numpy

        def counting(self: torch.Tensor, *a: Any, **kw: Any) -> Any:
            numpy_calls[0] += 1
            return real_numpy(self, *a, **kw)

        torch.Tensor.numpy = counting  # type: ignore[method-assign]
    hvd.init()
    from hora.core import runtime as core_runtime
    from hora.torch.adapter import direct_device

    executor = core_runtime.runtime().engine.executor
    dev = direct_device()
    assert dev is not None and executor.device_ops is not None, type(executor)

    class Timeline:
        def __init__(self) -> None:
            self.acts: set[str] = set()

        def activity_start(self, name: str, activity: str) -> None:
            self.acts.add(activity)

        def activity_end(self, name: str) -> None:
            pass

    executor.timeline = tl = Timeline()
    n, r1 = hvd.size(), rank + 1
    out: dict[str, Any] = {}

    def t(values: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=dev)

    def keep(label: str, value: Any) -> None:
        def as_list(x: Any) -> Any:
            if isinstance(x, (list, tuple)):
                return [as_list(v) for v in x]
            assert isinstance(x, torch.Tensor) and x.device == dev, (label, x)
            return x.cpu().tolist()

        out[label] = as_list(value)

    keep("sum", hvd.allreduce(t([r1, 2.0 * r1]), op=hvd.Sum, name="sum"))
    x = t([float(r1)] * 3)
    ptr = x.data_ptr()
    y = hvd.allreduce_(x, op=hvd.Average, name="avg_")
    out["in_place"] = y is x and x.data_ptr() == ptr
    keep("avg_", x)
    keep("scaled", hvd.allreduce(t([1.0, 3.0]), op=hvd.Sum, prescale_factor=2.0,
                                 postscale_factor=0.25, name="scaled"))  # fmt: skip
    keep("int_avg", hvd.allreduce(t([r1, 3 * r1 + 1], torch.int32), op=hvd.Average,
                                  name="int_avg"))  # fmt: skip
    keep("bf16", hvd.allreduce(t([1.0, 2.0 * r1], torch.bfloat16), op=hvd.Sum, name="bf16"))
    group = [t([float(r1)]), t([1.0, 2.0]), t([r1, r1], torch.float32)]
    keep("group", hvd.grouped_allreduce(group, op=hvd.Sum, name="group"))
    keep("group_avg", hvd.grouped_allreduce(group, op=hvd.Average, prescale_factor=3.0,
                                            name="group_avg"))  # fmt: skip
    g2 = [t([float(r1)] * 2), t([float(-r1)])]
    ptrs = [g.data_ptr() for g in g2]
    hvd.grouped_allreduce_(g2, op=hvd.Sum, name="group_")
    out["group_in_place"] = [g.data_ptr() for g in g2] == ptrs
    keep("group_", g2)
    big = torch.full((1 << 18,), float(r1), device=dev)  # 1 MiB: reduced where it lies
    res = hvd.grouped_allreduce([t([1.0]), big], op=hvd.Sum, name="big")
    keep("big", [res[0], res[1][:2], res[1][-1:]])
    keep("allgather", hvd.allgather(t([[float(rank)]] * r1), name="ag"))
    keep("broadcast", hvd.broadcast(t([float(r1)] * 2), n - 1, name="bc"))
    b = t([r1, r1], torch.int64)
    hvd.broadcast_(b, 0, name="bc_")
    keep("broadcast_", b)
    splits = [1] * n if n == 1 else ([1, 2] if rank == 0 else [2, 1])
    a2a, got = hvd.alltoall(t([10.0 * rank + i for i in range(sum(splits))]), splits,
                            name="a2a")  # fmt: skip
    keep("alltoall", a2a)
    out["alltoall_splits"] = got.tolist()
    keep("rs", hvd.reducescatter(t([[1.0 * r1]] * (2 * n)), op=hvd.Sum, name="rs"))
    keep("rs_avg", hvd.reducescatter(t([4.0, 8.0] * n), op=hvd.Average, prescale_factor=2.0,
                                     name="rs_avg"))  # fmt: skip
    keep("grs", hvd.grouped_reducescatter([t([1.0] * n), t([[2.0, 3.0]] * n)], op=hvd.Sum,
                                          name="grs"))  # fmt: skip
    if n > 1:  # the last rank joins; the others reduce with its device zeros
        if rank == n - 1:
            before = len(calls)
            out["joined"] = hvd.join()
            out["join_calls"] = calls[before:]  # what it contributed to the others' op
        else:
            keep("with_joined", hvd.allreduce(t([float(r1), 1.0]), op=hvd.Sum, name="j"))
            out["joined"] = hvd.join()
    out["acts"] = sorted(tl.acts)
    out["calls"] = sorted(set(calls))
    out["numpy_calls"] = numpy_calls[0]
    out["pinned"] = [] if rt is None else [e for e in rt.log if e[0] == "pinned"]
    hvd.shutdown()
    return out


def _check(outs: list[dict[str, Any]]) -> None:
    n = len(outs)
    s = n * (n + 1) // 2  # the sum of r1 over ranks
    for rank, out in enumerate(outs):
        r1 = rank + 1
        assert out["sum"] == [s, 2.0 * s]
        assert out["in_place"] and out["avg_"] == [s / n] * 3
        assert out["scaled"] == [0.5 * n, 1.5 * n]  # 2 * x, summed, / 4
        assert out["int_avg"] == [s // n, (3 * s + n) // n]  # truncated toward zero
        assert out["bf16"] == [float(n), 2.0 * s]
        assert out["group"] == [[s], [n, 2.0 * n], [s, s]]
        assert out["group_avg"] == [[3.0 * s / n], [3.0, 6.0], [3.0 * s / n] * 2]
        assert out["group_in_place"] and out["group_"] == [[s, s], [-s]]
        assert out["big"] == [[n], [s, s], [s]]
        assert out["allgather"] == [[float(r)] for r in range(n) for _ in range(r + 1)]
        assert out["broadcast"] == [float(n)] * 2
        assert out["broadcast_"] == [1, 1]
        if n == 2:
            assert out["alltoall"] == ([0.0, 10.0, 11.0] if rank == 0 else [1.0, 2.0, 12.0])
            assert out["alltoall_splits"] == ([1, 2] if rank == 0 else [2, 1])
        assert out["rs"] == [[s], [s]]
        assert out["rs_avg"] == [8.0, 16.0]  # 2 * x summed over n ranks, / n
        assert out["grs"] == [[n], [[2.0 * n, 3.0 * n]]]
        if n > 1 and rank < n - 1:
            assert out["with_joined"] == [r1, 1.0]  # the joined rank added zeros
        if n > 1 and rank == n - 1 and "join_calls" in out:
            assert out["join_calls"] == ["allreduce:tensor"]  # zeros on the device
        if n > 1:  # the rank that joined last, the same everywhere
            assert out["joined"] == outs[0]["joined"] and out["joined"] in range(n)
        for act in ("MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER", "NCCL_ALLREDUCE",
                    "NCCL_ALLGATHER", "NCCL_BCAST", "NCCL_ALLTOALL",
                    "NCCL_REDUCESCATTER"):  # fmt: skip
            assert act in out["acts"], (act, out["acts"])


@pytest.mark.timeout(150)
def test_device_tensors_go_through_the_engine_as_they_are() -> None:
    outs = run_ranks(_device_ops, 2, args=("fake",), timeout=120)
    _check(outs)
    for out in outs:
        # every collective got tensors: nothing was staged through host memory
        assert out["calls"] == ["allgatherv:tensor", "allreduce:tensor", "alltoallv:tensor",
                                "broadcast:tensor", "reducescatterv:tensor"], out["calls"]
        assert out["numpy_calls"] == 0 and out["pinned"] == []


@pytest.mark.gpu
@cuda_only
@pytest.mark.timeout(200)
def test_cuda_tensors_go_through_nccl_as_they_are_on_a_gpu() -> None:
    # through the engine: a world of one runs its ops itself (tests/integration/test_world_of_one)
    env = {"HOROVOD_GPU_OPERATIONS": "NCCL", "HORA_LOCAL_SETS": "0"}
    _check(run_ranks(_device_ops, 1, args=("cuda",), timeout=150, env=env))
