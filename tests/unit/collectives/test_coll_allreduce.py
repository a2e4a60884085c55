"""Allreduce (ring, recursive doubling, and the registry's choice) over loopback threads."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import pytest
from coll_helpers import run_ranks, to_storage

from hora.collectives import allreduce_ring as allreduce_ring_module
from hora.collectives import hierarchical, registry
from hora.collectives.allreduce_recursive_doubling import (
    doubling,
    doubling_steps,
    fold_steps,
    reduce_like_doubling,
)
from hora.collectives.base import GroupComm
from hora.collectives.reduce_ops import (
    AVERAGE,
    MAX,
    MIN,
    PRODUCT,
    SUM,
    bf16_to_f32,
    plain_ufunc,
    reducer,
    scale,
)
from hora.dtypes import DTYPES, FLOATING
from hora.transport import tally
from hora.transport.loopback import LoopbackTransport

OPS = [AVERAGE, SUM, MIN, MAX, PRODUCT]
SIZES = [0, 1, 3, 4, 17, 1001]
ALGORITHMS: dict[str, Callable[..., None]] = {
    "ring": registry.allreduce_ring,
    "ring_small_segments": partial(registry.allreduce_ring, segment_bytes=24),
    "recursive_doubling": registry.allreduce_recursive_doubling,
    "registry": registry.allreduce,
}


def rank_input(rank: int, count: int, dtype: str, op: int) -> np.ndarray:
    """Small integers (or booleans), so that every op is exact in every dtype."""
    idx = np.arange(count)
    if dtype == "bool":
        return (idx * (rank + 3)) % 5 < 2
    if op == PRODUCT:
        return 1 + (idx + rank) % 2
    low = 0 if dtype.startswith("uint") else -5
    return low + (idx * 7 + rank * 3) % 11


def expected(size: int, count: int, dtype: str, op: int) -> np.ndarray:
    stack = np.stack([rank_input(r, count, dtype, op) for r in range(size)])
    if dtype == "bool":
        return stack.any(0) if op in (SUM, AVERAGE, MAX) else stack.all(0)
    reduce = {MIN: np.min, MAX: np.max, PRODUCT: np.prod}.get(op, np.sum)
    return reduce(stack, axis=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_op_dtype_and_length(algorithm: str, size: int, dtype: str) -> None:
    run = ALGORITHMS[algorithm]

    def body(t: LoopbackTransport) -> list[np.ndarray]:
        out = []
        for op in OPS:
            for count in SIZES:
                buf = to_storage(rank_input(t.rank, count, dtype, op), dtype)
                run(t, buf, dtype, op)
                out.append(buf)
        return out

    results = run_ranks(size, body)
    cases = [(op, count) for op in OPS for count in SIZES]
    for rank_results in results:
        for (op, count), got in zip(cases, rank_results):
            want = to_storage(expected(size, count, dtype, op), dtype)
            np.testing.assert_array_equal(got, want, err_msg=f"op {op} count {count}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("dtype", sorted(FLOATING))
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_random_floats_identical_on_every_rank(size: int, dtype: str, algorithm: str) -> None:
    count = (3 << 20) // 4 + 7 if algorithm == "ring" else 3001  # several pipeline segments
    inputs = [np.random.default_rng(r).standard_normal(count) for r in range(size)]
    run = ALGORITHMS[algorithm]

    def body(t: LoopbackTransport) -> np.ndarray:
        buf = to_storage(inputs[t.rank], dtype)
        run(t, buf, dtype, SUM)
        return buf

    results = run_ranks(size, body)
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])
    got64 = (bf16_to_f32(results[0]) if dtype == "bfloat16" else results[0]).astype(np.float64)
    rounded = [
        (bf16_to_f32(x) if dtype == "bfloat16" else x).astype(np.float64)
        for x in (to_storage(v, dtype) for v in inputs)
    ]
    tol = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}[dtype]
    np.testing.assert_allclose(got64, np.sum(rounded, axis=0), rtol=tol, atol=tol * size)


@pytest.mark.timeout(60)
def test_registry_threshold_picks_both_paths_and_validates() -> None:
    def body(t: LoopbackTransport) -> list[np.ndarray]:
        small = np.full(10, t.rank + 1, np.int32)
        large = np.full(10, t.rank + 1, np.int32)
        registry.allreduce(t, small, "int32", SUM, small_threshold=40)  # recursive doubling
        registry.allreduce(t, large, "int32", SUM, small_threshold=39)  # ring
        return [small, large]

    for small, large in run_ranks(3, body):
        np.testing.assert_array_equal(small, np.full(10, 6))
        np.testing.assert_array_equal(large, np.full(10, 6))

    def bad(t: LoopbackTransport) -> None:
        registry.allreduce(t, np.zeros(4, np.float32), "float64", SUM)

    with pytest.raises(TypeError, match="float64"):
        run_ranks(1, bad)
    with pytest.raises(ValueError, match="Adasum"):
        run_ranks(1, lambda t: registry.allreduce(t, np.zeros(4), "float64", 2))
    with pytest.raises(ValueError, match="1-D"):
        run_ranks(1, lambda t: registry.allreduce(t, np.zeros((2, 2)), "float64", SUM))


@pytest.mark.timeout(60)
def test_scratch_is_reused() -> None:
    scratch = [np.zeros(2 << 20, np.uint8) for _ in range(3)]

    def body(t: LoopbackTransport) -> np.ndarray:
        buf = np.arange(300_000, dtype=np.float32)
        registry.allreduce_ring(t, buf, "float32", SUM, scratch=scratch[t.rank])
        small = np.arange(100, dtype=np.float32)
        registry.allreduce_recursive_doubling(t, small, "float32", MAX, scratch=scratch[t.rank])
        np.testing.assert_array_equal(small, np.arange(100))
        return buf

    for got in run_ranks(3, body):
        np.testing.assert_array_equal(got, np.arange(300_000, dtype=np.float32) * 3)
    assert all(s.any() for s in scratch)  # the scratch held incoming segments


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_process_subset_through_group_comm(algorithm: str) -> None:
    members = [1, 3, 4]
    run = ALGORITHMS[algorithm]

    def body(t: LoopbackTransport) -> np.ndarray | None:
        if t.rank not in members:
            return None
        buf = np.full(5, t.rank, np.int64)
        run(GroupComm(t, members), buf, "int64", SUM)
        return buf

    results = run_ranks(5, body)
    for rank in members:
        np.testing.assert_array_equal(results[rank], np.full(5, sum(members)))
    with pytest.raises(ValueError, match="not a member"):
        run_ranks(2, lambda t: GroupComm(t, [1]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_mismatched_lengths_fail_instead_of_hanging(algorithm: str) -> None:
    from hora.errors import TransportError

    run = ALGORITHMS[algorithm]

    def body(t: LoopbackTransport) -> None:
        run(t, np.zeros(1000 + 8 * t.rank, np.float32), "float32", SUM)

    with pytest.raises(TransportError):
        run_ranks(3, body)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", range(1, 10))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op", [SUM, PRODUCT])
def test_reduce_like_doubling_gives_the_exchanges_bits(size: int, dtype: str, op: int) -> None:
    """What a round that hands every member's inputs to every other computes
    (hora.core.handover) has the bits of the exchanges, for folded and unfolded sizes alike,
    and leaves the inputs as they were; a plain left-to-right sum differs somewhere."""
    count = 4001
    inputs = [to_storage(np.random.default_rng(r).standard_normal(count), dtype)
              for r in range(size)]

    def body(t: LoopbackTransport) -> np.ndarray:
        buf = inputs[t.rank].copy()
        registry.allreduce_recursive_doubling(t, buf, dtype, op)
        return buf

    exchanged = run_ranks(size, body)[0]
    kept = [x.copy() for x in inputs]
    out = np.empty_like(inputs[0])
    reduce_like_doubling(inputs, reducer(op, dtype), out)
    np.testing.assert_array_equal(out, exchanged)
    for x, y in zip(inputs, kept):
        np.testing.assert_array_equal(x, y)
    for me in range(size):  # in place: the result over this member's own input
        mine = [x.copy() for x in inputs]
        reduce_like_doubling(mine, reducer(op, dtype), mine[me])
        np.testing.assert_array_equal(mine[me], exchanged, err_msg=f"in place over input {me}")
    if size >= 4 and op == SUM:  # the order is what makes the bits
        seq = inputs[0].copy()
        for x in inputs[1:]:
            reducer(op, dtype)(seq, x)
        assert not np.array_equal(seq, out)


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8, 11, 16, 17])
def test_reduce_like_doubling_keeps_its_bits_with_scratch_arrays_used_again(size: int) -> None:
    """Scratch arrays given (as the express lane keeps them from call to call, holding what
    the last call left) change nothing; the steps take a fold's scratch array per folded
    pair and k - 1 for a tree of 2^k, and every step's destination is written whole before
    it is read."""
    dtype, count = "float32", 1001
    inputs = [to_storage(np.random.default_rng(10 + r).standard_normal(count), dtype)
              for r in range(size)]
    fresh = np.empty_like(inputs[0])
    reduce_like_doubling(inputs, reducer(SUM, dtype), fresh)
    steps, needed = doubling_steps(size)
    p = 1 << (size.bit_length() - 1)
    assert needed == (size - p) + max(p.bit_length() - 2, 0)
    scratch = [np.full(count, np.nan, np.float32) for _ in range(needed)]
    for _ in range(2):
        out = np.full(count, np.nan, np.float32)
        reduce_like_doubling(inputs, reducer(SUM, dtype), out, scratch)
        np.testing.assert_array_equal(out, fresh)
    # the steps folded with the reducer's ufunc as is: the same bits, the same bytes counted
    before = tally.snapshot()
    reduce_like_doubling(inputs, reducer(SUM, dtype), out, scratch)
    counted = tally.since(before)
    assert counted == {"reduced": len(steps) * out.nbytes}
    ufunc = plain_ufunc(SUM, dtype)
    assert ufunc is np.add and plain_ufunc(SUM, "bfloat16") is None
    folded = np.full(count, np.nan, np.float32)
    before = tally.snapshot()
    fold_steps(steps, ufunc, inputs, folded, scratch)
    assert tally.since(before) == counted
    np.testing.assert_array_equal(folded, fresh)
    # made once (as the express lane keeps it), for a ufunc reducer and a widening one alike
    for kind in (dtype, "bfloat16"):
        theirs = [to_storage(np.random.default_rng(20 + r).standard_normal(count), kind)
                  for r in range(size)]
        want = np.empty_like(theirs[0])
        reduce_like_doubling(theirs, reducer(SUM, kind), want)
        made = doubling(size, SUM, kind, count)
        assert (made.ufunc is None) == (kind == "bfloat16")
        for _ in range(2):
            got = np.empty_like(theirs[0])
            made(theirs, got)
            np.testing.assert_array_equal(got, want)
    written = set(range(size))  # the inputs; then each step's destination
    for a, b, into in steps:
        assert a in written and b in written, (a, b, into)
        written.add(into)
    assert steps[-1][2] == size  # the last step makes the result


POST = 1 / 3  # an Average's factor that no dtype holds exactly: any second rounding shows


def _scaled_apart(t: LoopbackTransport, buf: np.ndarray, dtype: str,
                  run: Callable[..., None]) -> np.ndarray:  # fmt: skip
    """``buf`` reduced by ``run`` (a Sum), then scaled by ``POST`` over the whole result."""
    apart = buf.copy()
    run(t, apart, dtype, SUM)
    scale(apart, dtype, POST)
    return apart


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32"])
@pytest.mark.parametrize("count", [1001, (3 << 20) // 4 + 7])  # eager; several segments
def test_ring_scales_each_block_as_its_last_step_makes_it(size: int, dtype: str,
                                                          count: int) -> None:  # fmt: skip
    """``post`` scales each block in the ring's last reducing step, before it travels on: the
    bits of scaling the whole result afterwards, with each rank scaling only its block (a
    float's whole-buffer ``scale`` is never called)."""
    inputs = [np.random.default_rng(r).standard_normal(count) * 40 for r in range(size)]
    calls: list[int] = []

    def body(t: LoopbackTransport) -> tuple[np.ndarray, np.ndarray]:
        buf = to_storage(inputs[t.rank], dtype)
        apart = _scaled_apart(t, buf, dtype, registry.allreduce_ring)
        registry.allreduce_ring(t, buf, dtype, SUM, post=POST)
        return buf, apart

    real_scale = allreduce_ring_module.scale

    def counted(buf: np.ndarray, dtype_: str, factor: float) -> None:
        if factor != 1.0:
            calls.append(buf.size)
        real_scale(buf, dtype_, factor)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(allreduce_ring_module, "scale", counted)
        results = run_ranks(size, body)
    for got, apart in results:
        np.testing.assert_array_equal(got.view(np.uint8), apart.view(np.uint8))
    np.testing.assert_array_equal(results[0][0], results[-1][0])
    assert calls == ([count] * size if dtype == "int32" else []), calls  # integers: apart


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts", [[0, 0, 1, 1], [0, 0, 1]], ids=["columns", "leaders"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_hierarchical_allreduce_scales_across_the_hosts(hosts: list[int], dtype: str) -> None:
    """The hierarchical allreduce's ``post`` is applied in the allreduce across the hosts:
    the bits of scaling the whole result afterwards, on every rank."""
    count = (1 << 20) + 5
    inputs = [np.random.default_rng(r).standard_normal(count) * 40 for r in range(len(hosts))]

    def body(t: LoopbackTransport) -> tuple[np.ndarray, np.ndarray]:
        layout = hierarchical.HostLayout(tuple(hosts), t.rank)

        def run(t: LoopbackTransport, buf: np.ndarray, dtype: str, op: int,
                post: float = 1.0) -> None:  # fmt: skip
            hierarchical.allreduce_hierarchical(t, buf, dtype, op, layout, post=post)

        buf = to_storage(inputs[t.rank], dtype)
        apart = _scaled_apart(t, buf, dtype, run)
        run(t, buf, dtype, SUM, post=POST)
        return buf, apart

    results = run_ranks(len(hosts), body)
    for got, apart in results:
        np.testing.assert_array_equal(got.view(np.uint8), apart.view(np.uint8))
        np.testing.assert_array_equal(got, results[0][0])
