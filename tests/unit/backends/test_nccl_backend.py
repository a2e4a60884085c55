"""The NCCL backend's collectives on both kinds of buffer (host arrays and device tensors).

Without a GPU, the backend's buffer handling and stream ordering run over a Gloo group on CPU
tensors, with torch.cuda's streams and events replaced by a fake that logs their order (the
fake stands in only for the GPU). With a GPU, every op runs through real NCCL at np=1 and is
checked against the CPU result."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from backend_ranks import run_two_ranks

from cuda_fakes import FakeStreams, cuda_only, nccl_on_cpu
from hora.backends import nccl
from hora.backends.base import SetComm
from hora.backends.nccl import NcclBackend
from hora.backends.registry import BackendContext
from hora.collectives.reduce_ops import MAX, MIN, SUM
from hora.identity import Identity
from hora.rendezvous.client import StoreClient
from hora.settings import load


def two_ranks(store: list[StoreClient], fake: FakeStreams,
              work: Callable[[NcclBackend, SetComm], Any]) -> list[Any]:  # fmt: skip
    def make(ctx: BackendContext) -> NcclBackend:
        b = nccl_on_cpu(ctx, fake)
        b.add_process_set(0, [0, 1])
        return b

    return run_two_ranks(store, make, work)


def battery(b: NcclBackend, comm: SetComm, wrap: Callable[[np.ndarray], Any],
            back: Callable[[Any], list[Any]]) -> dict[str, Any]:  # fmt: skip
    """Every collective on buffers made by ``wrap`` (host arrays or tensors)."""
    r, out = comm.rank, {}
    x = wrap((np.arange(4) + r + 1).astype(np.float32))
    b.allreduce(comm, x, "float32", SUM)
    out["sum"] = back(x)
    m = wrap(np.array([r, 5 - r], dtype=np.int64))
    b.allreduce(comm, m, "int64", MAX)
    out["max"] = back(m)
    flags = wrap(np.array([r, 0, 1], dtype=np.bool_))
    b.allreduce(comm, flags, "bool", MIN)
    out["and"] = back(flags)
    bf = wrap(np.array([0x3F80, 0x4000], dtype=np.uint16))  # bfloat16 1.0, 2.0
    b.allreduce(comm, bf, "bfloat16", SUM)
    out["bf16"] = back(bf)
    recv = wrap(np.zeros(3, np.float64))
    b.allgatherv(comm, wrap(np.full(1 + r, 10.0 + r)), recv, [1, 2])  # uneven: padded
    out["gather"] = back(recv)
    even = wrap(np.zeros(4, np.int32))
    b.allgatherv(comm, wrap(np.array([r, r], np.int32)), even, [2, 2])
    out["gather_even"] = back(even)
    buf = wrap(np.array([r, r], dtype=np.int16))
    b.broadcast(comm, buf, 1)
    out["bcast"] = back(buf)
    counts = [1, 2] if r == 0 else [2, 1]
    got = wrap(np.zeros(3, np.int32))
    b.alltoallv(comm, wrap(np.arange(3, dtype=np.int32) + 10 * r), counts, got, counts)
    out["a2a"] = back(got)
    part = wrap(np.zeros(2 - r, np.float32))
    b.reducescatterv(comm, wrap(np.arange(3, dtype=np.float32)), part, [2, 1], "float32", SUM)
    out["rs"] = back(part)
    b.barrier(comm)
    return out


def check(o0: dict[str, Any], o1: dict[str, Any]) -> None:
    assert o0["sum"] == o1["sum"] == [3.0, 5.0, 7.0, 9.0]
    assert o0["max"] == [1, 5] and o0["and"] == [False, False, True]
    assert o0["bf16"] == [0x4000, 0x4080]  # 2.0, 4.0
    assert o0["gather"] == o1["gather"] == [10.0, 11.0, 11.0]
    assert o1["gather_even"] == [0, 0, 1, 1]
    assert o0["bcast"] == o1["bcast"] == [1, 1]
    assert o0["a2a"] == [0, 10, 11] and o1["a2a"] == [1, 2, 12]
    assert o0["rs"] == [0.0, 2.0] and o1["rs"] == [4.0]


@pytest.mark.timeout(60)
def test_every_collective_on_host_arrays(store: list[StoreClient], fake_cuda: FakeStreams) -> None:
    o0, o1 = two_ranks(store, fake_cuda, lambda b, c: battery(b, c, lambda a: a, np.ndarray.tolist))
    check(o0, o1)


@pytest.mark.timeout(60)
def test_every_collective_on_tensors_in_place(
    store: list[StoreClient], fake_cuda: FakeStreams
) -> None:
    """Tensors are worked on where they lie: the results land in the tensors handed in."""

    def work(b: NcclBackend, c: SetComm) -> dict[str, Any]:
        ptrs: dict[int, int] = {}

        def wrap(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(a.copy())
            ptrs[id(t)] = t.data_ptr()
            return t

        def back(t: torch.Tensor) -> list[Any]:
            assert t.data_ptr() == ptrs[id(t)]  # never replaced, never moved
            return t.tolist()

        return battery(b, c, wrap, back)

    check(*two_ranks(store, fake_cuda, work))


@pytest.mark.timeout(60)
def test_each_collective_runs_on_horas_stream_between_two_events(
    store: list[StoreClient], fake_cuda: FakeStreams
) -> None:
    def work(b: NcclBackend, c: SetComm) -> None:
        b.allreduce(c, torch.ones(3), "float32", SUM)

    two_ranks(store, fake_cuda, work)
    mine = [(what, s) for who, what, s in fake_cuda.log if who == "r0"]
    assert mine == [
        ("record", "caller"),  # the caller's work so far...
        ("wait", "hora"),  # ...comes before anything on hora's stream
        ("enter", "hora"),
        ("exit", "hora"),
        ("record", "hora"),  # the done event
        ("wait", "caller"),  # the caller's stream waits for it; the host does not
    ]


def test_world_of_one_int16_falls_back_to_horas_algorithm_and_copies_back(
    fake_cuda: FakeStreams,
) -> None:
    ctx = BackendContext(Identity(rank=0, size=1), load({}), None, None, "t")
    b = nccl_on_cpu(ctx, fake_cuda)
    b.add_process_set(0, [0])
    comm = SetComm([0], 0, None, 0)  # type: ignore[arg-type]
    t = torch.tensor([1, -2, 3], dtype=torch.int16)
    b.allreduce(comm, t, "int16", SUM)
    assert t.tolist() == [1, -2, 3]
    bf = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    b.adasum(comm, bf, "bfloat16", [(0, 2)])
    assert bf.tolist() == [1.0, 2.0]
    b.scale(bf, 0.5)
    arr = np.array([2.0, 4.0], np.float32)
    b.scale(arr, 0.5)
    assert bf.tolist() == [0.5, 1.0] and arr.tolist() == [1.0, 2.0]


def test_a_tensor_on_another_device_is_a_clear_error(fake_cuda: FakeStreams) -> None:
    ctx = BackendContext(Identity(rank=0, size=1), load({}), None, None, "t")
    b = nccl_on_cpu(ctx, fake_cuda)
    b._device = torch.device("cuda", 0)  # what a GPU rank would have; nothing runs there
    b.add_process_set(0, [0])
    with pytest.raises(ValueError, match=r"works on cuda:0, got a tensor on cpu.*set_device"):
        b.broadcast(SetComm([0], 0, None, 0), torch.ones(2), 0)  # type: ignore[arg-type]


def test_buffer_helpers() -> None:
    a, t = np.zeros(3, np.float64), torch.zeros(3, dtype=torch.float16)
    assert (nccl.numel(a), nccl.itemsize(a), nccl.numel(t), nccl.itemsize(t)) == (3, 8, 3, 2)
    assert nccl.as_type(torch.zeros(2, dtype=torch.int16), "bfloat16").dtype == torch.bfloat16
    assert nccl.as_type(torch.zeros(2, dtype=torch.bool), "bool").dtype == torch.uint8
    assert nccl.as_type(t, None).shape == (6,)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without a GPU")
def test_without_a_gpu_the_backend_says_what_to_do() -> None:
    ctx = BackendContext(Identity(rank=0, size=1), load({}), None, None, "t")
    with pytest.raises(ValueError, match="NCCL backend needs an NVIDIA GPU.*unset HOROVOD_GPU"):
        NcclBackend(ctx)


# -- on a GPU: real NCCL at np=1 against the CPU result -------------------------------------------
@cuda_only
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["host", "device"])
def test_every_op_through_nccl_at_np1(kind: str) -> None:
    ctx = BackendContext(Identity(rank=0, size=1), load({}), None, None, "t")
    b = NcclBackend(ctx)
    b.add_process_set(0, [0])
    comm = SetComm([0], 0, None, 0)  # type: ignore[arg-type]
    dev = torch.device("cuda", 0)

    def wrap(a: np.ndarray) -> Any:
        return a.copy() if kind == "host" else torch.from_numpy(a.copy()).to(dev)

    def back(x: Any) -> list[Any]:
        if kind == "device":
            assert x.device == dev  # stayed on the GPU
            x = x.cpu()
        return x.tolist()  # type: ignore[no-any-return]

    rng = np.random.default_rng(0)
    x = rng.standard_normal(1 << 16).astype(np.float32)
    got = wrap(x)
    b.allreduce(comm, got, "float32", SUM)
    np.testing.assert_array_equal(np.array(back(got), np.float32), x)  # a world of one
    for dtype in ("float16", "float64", "int32", "int64", "uint8", "int8", "int16"):
        a = (np.arange(10) % 7).astype(dtype)
        g = wrap(a)
        b.allreduce(comm, g, dtype, MAX)
        assert back(g) == a.tolist(), dtype
    recv = wrap(np.zeros(5, np.float64))
    b.allgatherv(comm, wrap(np.arange(5.0)), recv, [5])
    assert back(recv) == list(np.arange(5.0))
    buf = wrap(np.array([7, 8], np.int32))
    b.broadcast(comm, buf, 0)
    assert back(buf) == [7, 8]
    out = wrap(np.zeros(3, np.int64))
    b.alltoallv(comm, wrap(np.array([1, 2, 3], np.int64)), [3], out, [3])
    assert back(out) == [1, 2, 3]
    part = wrap(np.zeros(4, np.float32))
    b.reducescatterv(comm, wrap(np.arange(4, dtype=np.float32)), part, [4], "float32", SUM)
    assert back(part) == [0.0, 1.0, 2.0, 3.0]
    bf = wrap(np.array([0x3F80, 0x4000], dtype=np.uint16))
    b.allreduce(comm, bf, "bfloat16", SUM)
    assert back(bf) == [0x3F80, 0x4000]
    b.barrier(comm)
    assert b.last_done is not None and b.last_done.query() in (True, False)
    b.close()
