"""The NCCL backend's device-buffer ops and the executor that uses them.

Without a GPU, CPU tensors stand in for the GPU's and torch.cuda's streams are faked (the
fixtures of test_nccl_backend.py); two ranks run as two threads over Gloo."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from backend_ranks import run_two_ranks

from cuda_fakes import FakeStreams, cuda_only, nccl_on_cpu
from hora.backends.base import SetComm
from hora.backends.nccl import DeviceBufferOps, NcclBackend, scale_tensor
from hora.backends.registry import BackendContext
from hora.collectives.reduce_ops import AVERAGE, SUM, scale
from hora.core.executor import Executor, TensorEntry
from hora.core.messages import OpType, Request, Response, TensorSpec
from hora.dtypes import DTYPES, storage_dtype
from hora.rendezvous.client import StoreClient


def _tensor(arr: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(arr.copy().view(np.int16) if dtype == "bfloat16" else arr.copy())
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def _bits(t: torch.Tensor) -> list[Any]:
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("factor", [0.5, 2.0, -1.5, 3.0, 1 / 3])
def test_scaling_on_the_device_gives_the_host_bits(dtype: str, factor: float) -> None:
    """prescale, postscale and Average's division give the same bits on a device tensor as
    the engine's host scaling: integers truncated toward zero, bool 0/1, halves via float32."""
    rng = np.random.default_rng(7)
    raw = (rng.standard_normal(64) * 40).astype(np.float64)
    if dtype == "bfloat16":
        host = (raw.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    elif dtype == "bool":
        host = raw > 0
    else:
        host = raw.astype(storage_dtype(dtype)) if dtype not in ("uint8", "uint16") \
            else np.abs(raw).astype(storage_dtype(dtype))  # fmt: skip
    dev = _tensor(host, dtype)
    scale(host, dtype, factor)
    scale_tensor(dev, dtype, factor)
    want = host.view(np.int16) if dtype == "bfloat16" else host
    assert _bits(dev) == want.tolist()


def test_buffer_ops_fusion_buffer_grows_and_views_each_dtype() -> None:
    ops = DeviceBufferOps(torch.device("cpu"), lambda b, f, d: scale_tensor(b, d, f))
    a = ops.fusion(4, "float32")
    assert a.dtype == torch.float32 and a.numel() == 4
    b = ops.fusion(2, "bfloat16")
    assert b.dtype == torch.bfloat16 and b.data_ptr() == a.data_ptr()  # reused
    c = ops.fusion(1000, "float64")
    assert c.numel() == 1000 and ops.fusion(3, "bool").dtype == torch.bool
    up = ops.upload(np.array([0x3F80, 0x4000], np.uint16), "bfloat16")
    assert up.dtype == torch.bfloat16 and up.tolist() == [1.0, 2.0]
    out = np.zeros(2, np.uint16)
    assert ops.download(up, out) is out and out.tolist() == [0x3F80, 0x4000]
    ro = np.arange(3, dtype=np.int32)
    ro.flags.writeable = False
    assert ops.upload(ro, "int32").tolist() == [0, 1, 2]
    assert ops.zeros(3, "int64").tolist() == [0, 0, 0] and ops.owns(up) and not ops.owns(out)


def test_a_backend_that_takes_device_buffers_gets_the_device_executor(
    fake_cuda: FakeStreams,
) -> None:
    from hora.identity import Identity
    from hora.settings import load

    b = nccl_on_cpu(BackendContext(Identity(rank=0, size=1), load({}), None, None, "t"),
                    fake_cuda)  # fmt: skip
    ex = Executor(b)
    assert ex.device_ops is b.buffer_ops
    assert ex.device_ops.device == torch.device("cpu")

    class Host:
        name = "TCP"

    plain = Executor(Host())  # type: ignore[arg-type]
    assert plain.device_ops is None


def _entry(req: Request, array: Any, output: Any = None) -> TensorEntry:
    got: list[Any] = []  # what the entry completes or fails with
    return TensorEntry(req, array, output, got.append, got.append)


@pytest.mark.timeout(60)
def test_a_fused_allreduce_mixing_host_arrays_and_device_tensors(
    store: list[StoreClient], fake_cuda: FakeStreams
) -> None:
    """Rank 0 holds a device tensor and a host array in one fused response, rank 1 host arrays
    only (it runs the host path): the same backend call on both, every result where its input
    was, Average's division and a prescale on the device."""

    def work(b: NcclBackend, comm: SetComm) -> list[Any]:
        ex = Executor(b)
        r = comm.rank
        reqs = [Request(OpType.ALLREDUCE, f"allreduce.t{i}", "float32", (2,), reduce_op=AVERAGE,
                        prescale=2.0) for i in range(3)]  # fmt: skip
        resp = Response(OpType.ALLREDUCE, [TensorSpec(q) for q in reqs])
        x = np.full(2, r + 1.0, np.float32)
        if r == 0:
            dev = torch.full((2,), 1.0)
            entries: list[TensorEntry | None] = [_entry(reqs[0], dev, dev),
                                                 _entry(reqs[1], x), _entry(reqs[2], x.copy())]
        else:
            entries = [_entry(reqs[0], np.full(2, 3.0, np.float32)), _entry(reqs[1], x),
                       _entry(reqs[2], x.copy())]  # fmt: skip
        return ex.allreduce(comm, resp, entries)

    r0, r1 = two_ranks_of(store, fake_cuda, work)
    assert isinstance(r0[0], torch.Tensor) and r0[0].tolist() == [4.0, 4.0]  # (2*1 + 2*3) / 2
    assert isinstance(r0[1], np.ndarray) and r0[1].tolist() == [3.0, 3.0]  # (2*1 + 2*2) / 2
    assert isinstance(r1[0], np.ndarray) and r1[0].tolist() == [4.0, 4.0]


@pytest.mark.timeout(60)
def test_a_joined_rank_contributes_device_zeros_to_a_fused_allreduce(
    store: list[StoreClient], fake_cuda: FakeStreams
) -> None:
    def work(b: NcclBackend, comm: SetComm) -> Any:
        ex = Executor(b)
        reqs = [Request(OpType.ALLREDUCE, f"allreduce.j{i}", "int32", (3,), reduce_op=SUM)
                for i in range(2)]  # fmt: skip
        resp = Response(OpType.ALLREDUCE, [TensorSpec(q) for q in reqs])
        seen: list[Any] = []
        real = b.allreduce
        b.allreduce = lambda c, buf, *a: (seen.append(type(buf)), real(c, buf, *a))  # type: ignore[method-assign]
        if comm.rank == 1:  # joined: nothing submitted
            ex.allreduce(comm, resp, [None, None])
            return seen
        ins = [torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([4, 5, 6],
                                                                          dtype=torch.int32)]
        return [t.tolist() for t in ex.allreduce(comm, resp, [_entry(q, t) for q, t in
                                                            zip(reqs, ins)])] + seen  # fmt: skip

    r0, r1 = two_ranks_of(store, fake_cuda, work)
    assert r0 == [[1, 2, 3], [4, 5, 6], torch.Tensor] and r1 == [torch.Tensor]


def two_ranks_of(store: list[StoreClient], fake: FakeStreams, work: Any) -> list[Any]:
    def make(ctx: BackendContext) -> NcclBackend:
        b = nccl_on_cpu(ctx, fake)
        b.add_process_set(0, [0, 1])
        return b

    return run_two_ranks(store, make, work)


@cuda_only
def test_buffer_ops_on_a_gpu() -> None:
    dev = torch.device("cuda", 0)
    ops = DeviceBufferOps(dev, lambda b, f, d: scale_tensor(b, d, f))
    buf = ops.fusion(5, "float16")
    ops.concat_into([torch.ones(2, dtype=torch.float16, device=dev),
                     ops.upload(np.full(3, 2.0, np.float16), "float16")], buf)  # fmt: skip
    assert buf.device == dev
    ops.scale(buf, "float16", 0.5)
    assert ops.download(buf, None).tolist() == [0.5, 0.5, 1.0, 1.0, 1.0]
    ints = torch.tensor([3, -3, 7], dtype=torch.int32, device=dev)
    ops.scale(ints, "int32", 0.5)
    assert ints.cpu().tolist() == [1, -1, 3]
