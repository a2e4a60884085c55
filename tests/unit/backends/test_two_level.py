"""The hierarchical allreduce's groups and steps (hora.backends.two_level), and the NCCL backend
running it under HOROVOD_HIERARCHICAL_ALLREDUCE, with Gloo groups on CPU standing in for NCCL's
and a fake of torch.cuda's streams (no GPU here): four ranks as threads, laid out as two "hosts"
of two ranks."""

from __future__ import annotations

import gc
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from backend_ranks import run_threads

from cuda_fakes import FakeStreams, nccl_on_cpu
from hora.backends import two_level
from hora.backends.base import SetComm
from hora.backends.gloo import StoreAdapter
from hora.backends.registry import BackendContext
from hora.collectives.reduce_ops import MIN, SUM
from hora.identity import Identity
from hora.rendezvous.client import StoreClient
from hora.settings import load


def test_plan_groups_by_host_and_local_index() -> None:
    hosts = [0, 0, 1, 1, 2, 2]
    assert two_level.plan(hosts, 0) == ([0, 1], [0, 2, 4])
    assert two_level.plan(hosts, 3) == ([2, 3], [1, 3, 5])
    # hosts need not be contiguous in rank order: the set's order is kept
    assert two_level.plan([0, 1, 0, 1], 2) == ([0, 2], [2, 3])


@pytest.mark.parametrize(
    "hosts",
    [[0, 0, 0, 0], [0, 1, 2, 3], [0, 0, 0, 1], [0, 0, 1, 1, 1, 2]],
    ids=["one-host", "one-rank-per-host", "uneven", "uneven-three-hosts"],
)
def test_plan_refuses_what_the_flat_allreduce_serves_better(hosts: list[int]) -> None:
    assert all(two_level.plan(hosts, me) is None for me in range(len(hosts)))


def _gloo(store: Any, rank: int, size: int) -> Any:
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _prefixed(client: StoreClient, key: str) -> StoreAdapter:
    return StoreAdapter(client, f"test/{key}")


def _four_ranks(clients: list[StoreClient], hosts: list[int],
                work: Callable[[two_level.TwoLevel | None, int], Any]) -> list[Any]:  # fmt: skip
    def rank(r: int) -> Any:
        levels = two_level.build(hosts, r, _gloo, partial(_prefixed, clients[r]))
        return work(levels, r)

    return run_threads(4, rank, timeout=30)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hosts", [[0, 0, 1, 1], [0, 1, 0, 1]], ids=["blocked", "round-robin"])
def test_two_level_allreduce_matches_the_flat_result(
    store4: list[StoreClient], hosts: list[int]
) -> None:
    def work(levels: two_level.TwoLevel | None, r: int) -> dict[str, Any]:
        assert levels is not None
        out: dict[str, Any] = {
            "sizes": (levels.local.size(), levels.cross.size(), levels.local_size)
        }
        for n in (1, 7, 8, 1001):  # fewer elements than ranks, uneven and even pieces
            t = torch.arange(n, dtype=torch.float32) * (r + 1)
            levels.allreduce(t, dist.ReduceOp.SUM)
            out[f"sum{n}"] = t.numpy().copy()
        m = torch.tensor([r, -r, 3], dtype=torch.int64)
        levels.allreduce(m, dist.ReduceOp.MAX)
        out["max"] = m.tolist()
        return out

    results = _four_ranks(store4, hosts, work)
    for out in results:
        assert out["sizes"] == (2, 2, 2)
        for n in (1, 7, 8, 1001):
            np.testing.assert_array_equal(out[f"sum{n}"], np.arange(n, dtype=np.float32) * 10)
        assert out["max"] == [3, 0, 3]


@pytest.mark.timeout(60)
def test_an_uneven_layout_builds_no_groups(store4: list[StoreClient]) -> None:
    assert _four_ranks(store4, [0, 0, 0, 1], lambda levels, r: levels) == [None] * 4


class TwoHosts:
    """The host table hora's transport publishes (``host_ids``, ``shares_memory``), for four
    ranks of this machine laid out as two hosts of two: all that ``layout_of`` reads of it."""

    HOSTS = (0, 0, 1, 1)

    def host_ids(self, ranks: list[int]) -> list[int]:
        return [self.HOSTS[r] for r in ranks]

    def shares_memory(self, peer: int) -> bool:
        return False


def _nccl_backend(r: int, store: StoreClient, fake: FakeStreams, knob: str) -> Any:
    """Rank ``r``'s NcclBackend of the two hosts (``knob`` set to 1 unless empty), its groups
    Gloo's and its streams faked (no GPU here), with the set of all four added."""
    me = Identity(rank=r, size=4, local_rank=r % 2, local_size=2, cross_rank=r // 2,
                  cross_size=2)  # fmt: skip
    env = {"HORA_GLOO_TIMEOUT_SECONDS": "10", **({knob: "1"} if knob else {})}
    b = nccl_on_cpu(BackendContext(me, load(env), store, "test", "test"), fake)
    b.add_process_set(0, [0, 1, 2, 3])
    return b


@pytest.mark.timeout(60)
@pytest.mark.parametrize("knob", ["HOROVOD_HIERARCHICAL_ALLREDUCE", "HOROVOD_TORUS_ALLREDUCE", ""])
def test_the_nccl_backend_reduces_inside_each_host_then_across(
    store4: list[StoreClient], fake_cuda: FakeStreams, knob: str
) -> None:
    """NcclBackend with the knob set, its groups Gloo's and its streams faked (no GPU here):
    every allreduce of the set goes the two-level way and gives the flat result; without the
    knob, the flat way."""
    def rank(r: int) -> Any:
        b = _nccl_backend(r, store4[r], fake_cuda, knob)
        comm = SetComm([0, 1, 2, 3], r, TwoHosts(), 0)  # type: ignore[arg-type]
        x = torch.arange(9, dtype=torch.float32) + r
        b.allreduce(comm, x, "float32", SUM)
        flags = torch.tensor([r != 3, True], dtype=torch.bool)
        b.allreduce(comm, flags, "bool", MIN)
        levels = b._levels[0] if b._levels else None
        b.close()
        return x.tolist(), flags.tolist(), levels is not None and levels.local_size

    results = run_threads(4, rank, timeout=30)
    want = [float(4 * i + 6) for i in range(9)]
    assert results == [(want, [False, True], 2 if knob else False)] * 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("knob", ["HOROVOD_HIERARCHICAL_ALLREDUCE", ""], ids=["two-level", "flat"])
def test_the_nccl_backends_groups_outlive_gc_before_their_first_op(
    store4: list[StoreClient], fake_cuda: FakeStreams, knob: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NCCL uses a group's store lazily, at its first op: the backend must hold every store it
    gave a group for as long as that group lives. Gloo under ``TORCH_GLOO_LAZY_INIT=1`` stands
    in for NCCL here (no GPU); the two-level groups are made at the first allreduce and used at
    once, the flat group is made when the set is added and first used after a collection."""
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")

    def rank(r: int) -> Any:
        b = _nccl_backend(r, store4[r], fake_cuda, knob)
        gc.collect()
        comm = SetComm([0, 1, 2, 3], r, TwoHosts(), 0)  # type: ignore[arg-type]
        x = torch.arange(5, dtype=torch.float32) + r
        b.allreduce(comm, x, "float32", SUM)
        gc.collect()
        b.allreduce(comm, x, "float32", SUM)
        two_level = bool(b._levels and b._levels[0])
        b.close()
        return x.tolist(), two_level

    results = run_threads(4, rank, timeout=30)
    want = [4 * (4.0 * i + 6) for i in range(5)]
    assert results == [(want, bool(knob))] * 4
