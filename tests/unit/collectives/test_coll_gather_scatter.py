"""Allgatherv, reducescatterv, alltoallv, broadcast and barrier over loopback threads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from coll_helpers import run_ranks, to_storage

from hora.collectives import registry
from hora.collectives.broadcast_tree import tree_links
from hora.collectives.reduce_ops import MAX, PRODUCT, SUM
from hora.dtypes import DTYPES
from hora.transport.loopback import LoopbackTransport

WORLD_SIZES = [1, 2, 3, 4, 5]


def count_patterns(size: int) -> list[list[int]]:
    return [
        [3] * size,
        [(r * 5) % 7 for r in range(size)],  # uneven, rank 0 has none
        [0] * size,
        [0] * (size - 1) + [300_001],  # one big block: many segments below
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgatherv(size: int, dtype: str) -> None:
    def part(rank: int, count: int) -> np.ndarray:
        return to_storage((np.arange(count) + 10 * rank) % 100 > 40, dtype)

    def body(t: LoopbackTransport) -> list[np.ndarray]:
        out = []
        for counts in count_patterns(size):
            recv = np.empty(sum(counts), part(0, 0).dtype)
            registry.allgatherv_ring(t, part(t.rank, counts[t.rank]), recv, counts)
            out.append(recv)
        # in place: send is already this rank's slice of recv
        counts = [r + 1 for r in range(size)]
        recv = np.concatenate([part(r, c) for r, c in enumerate(counts)])
        mine = recv[sum(counts[: t.rank]) : sum(counts[: t.rank + 1])]
        recv[: sum(counts[: t.rank])] = 0
        registry.allgatherv_ring(t, mine, recv, counts, segment_bytes=1)
        out.append(recv)
        return out

    patterns = count_patterns(size) + [[r + 1 for r in range(size)]]
    for rank_results in run_ranks(size, body):
        for counts, got in zip(patterns, rank_results):
            want = np.concatenate([part(r, c) for r, c in enumerate(counts)])
            np.testing.assert_array_equal(got, want)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reducescatterv(size: int, dtype: str) -> None:
    ops = [SUM, MAX, PRODUCT]
    row = 3
    row_counts = [0, 1, size - 1, size + 2, 2 * size + 1, 70_001]

    def rank_input(rank: int, rows: int, op: int) -> np.ndarray:
        idx = np.arange(rows * row)
        if dtype == "bool":
            return idx % (rank + 2) == 0
        return 1 + (idx + rank) % 2 if op == PRODUCT else (idx * 3 + rank) % 9

    def body(t: LoopbackTransport) -> list[np.ndarray]:
        out = []
        for op in ops:
            for rows in row_counts:
                counts = [c * row for c in registry.reducescatter_counts(rows, size)]
                send = to_storage(rank_input(t.rank, rows, op), dtype)
                recv = np.empty(counts[t.rank], send.dtype)
                registry.reducescatterv_ring(t, send, recv, counts, dtype, op)
                out.append(recv)
        return out

    for rank, rank_results in enumerate(run_ranks(size, body)):
        cases = [(op, rows) for op in ops for rows in row_counts]
        for (op, rows), got in zip(cases, rank_results):
            stack = np.stack([rank_input(r, rows, op) for r in range(size)])
            if dtype == "bool":
                full = stack.all(0) if op == PRODUCT else stack.any(0)
            else:
                full = {SUM: np.sum, MAX: np.max, PRODUCT: np.prod}[op](stack, axis=0)
            split = registry.reducescatter_counts(rows, size)
            lo = sum(split[:rank]) * row
            want = to_storage(full[lo : lo + split[rank] * row], dtype)
            np.testing.assert_array_equal(got, want, err_msg=f"op {op} rows {rows}")


@pytest.mark.timeout(30)
def test_reducescatter_counts_follow_horovod() -> None:
    assert registry.reducescatter_counts(10, 4) == [3, 3, 2, 2]
    assert registry.reducescatter_counts(2, 4) == [1, 1, 0, 0]
    assert registry.reducescatter_counts(8, 4) == [2, 2, 2, 2]
    with pytest.raises(ValueError):
        registry.reducescatter_counts(3, 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_alltoallv(size: int) -> None:
    rng = np.random.default_rng(size)
    # counts[i][j]: elements rank i sends to rank j (zeros included, one big pair)
    counts = rng.integers(0, 4, (size, size))
    counts[0, size - 1] = 100_000

    def block(src: int, dst: int) -> np.ndarray:
        return (np.arange(counts[src, dst]) + 1000 * src + dst).astype(np.int64)

    def body(t: LoopbackTransport) -> np.ndarray:
        r = t.rank
        send = np.concatenate([block(r, j) for j in range(size)])
        recv = np.full(counts[:, r].sum(), -1, np.int64)
        registry.alltoallv_pairwise(t, send, list(counts[r]), recv, list(counts[:, r]))
        return recv

    for r, got in enumerate(run_ranks(size, body)):
        np.testing.assert_array_equal(got, np.concatenate([block(i, r) for i in range(size)]))


@pytest.mark.timeout(60)
def test_alltoallv_rejects_inconsistent_counts() -> None:
    with pytest.raises(ValueError, match="send_counts"):
        run_ranks(1, lambda t: registry.alltoallv_pairwise(t, np.zeros(3), [2], np.zeros(3), [3]))
    with pytest.raises(ValueError, match="sends itself"):
        run_ranks(1, lambda t: registry.alltoallv_pairwise(t, np.zeros(3), [3], np.zeros(2), [2]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_broadcast_every_root(size: int) -> None:
    lengths = [0, 1, 5, 250_001]

    def body(t: LoopbackTransport) -> list[np.ndarray]:
        out = []
        for root in range(size):
            for n in lengths:
                buf = np.arange(n, dtype=np.float32) + root if t.rank == root else np.zeros(n)
                buf = buf.astype(np.float32)
                registry.broadcast_tree(t, buf, root, segment_bytes=64 << 10)
                out.append(buf)
        return out

    cases = [(root, n) for root in range(size) for n in lengths]
    for rank_results in run_ranks(size, body):
        for (root, n), got in zip(cases, rank_results):
            np.testing.assert_array_equal(got, np.arange(n, dtype=np.float32) + root)
    with pytest.raises(ValueError, match="root 3"):
        run_ranks(2, lambda t: registry.broadcast_tree(t, np.zeros(2), 3))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", range(1, 12))
def test_binomial_tree_reaches_every_rank_once(size: int) -> None:
    seen = {0}
    for v in range(size):
        parent, children = tree_links(v, size)
        assert (parent is None) == (v == 0)
        for c in children:
            assert tree_links(c, size)[0] == v and c not in seen
            seen.add(c)
    assert seen == set(range(size))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_barrier_waits_for_everyone(size: int) -> None:
    arrived: list[int] = []
    lock = threading.Lock()

    def body(t: LoopbackTransport) -> list[int]:
        time.sleep(0.02 * (size - t.rank))  # arrive in reverse rank order
        with lock:
            arrived.append(t.rank)
        registry.barrier(t)
        with lock:
            return list(arrived)

    for seen in run_ranks(size, body):
        assert sorted(seen) == list(range(size))
