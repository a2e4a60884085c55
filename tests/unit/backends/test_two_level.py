"""The hierarchical allreduce's groups and steps (hora.backends.two_level), with Gloo groups on
CPU standing in for NCCL's: four ranks as threads, laid out as two "hosts" of two ranks."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hora.backends import two_level
from hora.backends.gloo import StoreAdapter
from hora.rendezvous.client import StoreClient
from hora.rendezvous.server import RendezvousServer


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


@pytest.fixture
def clients() -> Iterator[list[StoreClient]]:
    secret = secrets.token_bytes(16)
    server = RendezvousServer(secret, host="127.0.0.1")
    port = server.start()
    made = [StoreClient("127.0.0.1", port, secret, timeout=10) for _ in range(4)]
    yield made
    for c in made:
        c.close()
    server.stop()


def _gloo(store: Any, rank: int, size: int) -> Any:
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _four_ranks(clients: list[StoreClient], hosts: list[int],
                work: Callable[[two_level.TwoLevel | None, int], Any]) -> list[Any]:  # fmt: skip
    results: list[Any] = [None] * 4
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            levels = two_level.build(
                hosts, r, _gloo, lambda key: StoreAdapter(clients[r], f"test/{key}")
            )
            results[r] = work(levels, r)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hosts", [[0, 0, 1, 1], [0, 1, 0, 1]], ids=["blocked", "round-robin"])
def test_two_level_allreduce_matches_the_flat_result(
    clients: list[StoreClient], hosts: list[int]
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

    results = _four_ranks(clients, hosts, work)
    for out in results:
        assert out["sizes"] == (2, 2, 2)
        for n in (1, 7, 8, 1001):
            np.testing.assert_array_equal(out[f"sum{n}"], np.arange(n, dtype=np.float32) * 10)
        assert out["max"] == [3, 0, 3]


@pytest.mark.timeout(60)
def test_an_uneven_layout_builds_no_groups(clients: list[StoreClient]) -> None:
    assert _four_ranks(clients, [0, 0, 0, 1], lambda levels, r: levels) == [None] * 4
