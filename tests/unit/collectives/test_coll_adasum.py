"""Adasum against a local NumPy reference of the pairwise rule applied recursively."""

from __future__ import annotations

import numpy as np
import pytest
from coll_helpers import run_ranks, to_storage

from hora.collectives import registry
from hora.collectives.reduce_ops import bf16_to_f32
from hora.dtypes import FLOATING
from hora.transport.loopback import LoopbackTransport

TOLERANCE = {"float64": 1e-10, "float32": 1e-4, "float16": 2e-2, "bfloat16": 8e-2}


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The pairwise rule on one tensor, in float64 (a zero vector leaves the other one)."""
    dot, aa, bb = a @ b, a @ a, b @ b
    ca = 1.0 - dot / (2 * aa) if aa else 1.0
    cb = 1.0 - dot / (2 * bb) if bb else 1.0
    return ca * a + cb * b


def reference(inputs: list[np.ndarray], tensors: list[tuple[int, int]]) -> np.ndarray:
    """Ranks 0+1, 2+3, ... then (01)+(23), ... per tensor."""
    vecs = [v.astype(np.float64) for v in inputs]
    while len(vecs) > 1:
        nxt = []
        for a, b in zip(vecs[::2], vecs[1::2]):
            out = np.empty_like(a)
            for off, count in tensors:
                out[off : off + count] = combine(a[off : off + count], b[off : off + count])
            nxt.append(out)
        vecs = nxt
    return vecs[0]


def as_f64(buf: np.ndarray, dtype: str) -> np.ndarray:
    return (bf16_to_f32(buf) if dtype == "bfloat16" else buf).astype(np.float64)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", sorted(FLOATING))
def test_adasum_matches_reference(size: int, dtype: str) -> None:
    rng = np.random.default_rng(size)
    tensors = [(0, 7), (7, 1), (8, 0), (8, 500), (508, 3001), (3509, 2)]
    total = 3511
    inputs = []
    for r in range(size):
        v = rng.standard_normal(total) * (r + 1)
        v[500:900] += 3.0  # correlated part
        inputs.append(as_f64(to_storage(v, dtype), dtype))
    inputs[0][8:508] = 0.0  # a zero tensor on one rank
    if size > 1:
        inputs[1][8:508] = 0.0
    for v in inputs:
        v[3509:] = 0.0  # a tensor that is zero everywhere

    def body(t: LoopbackTransport) -> np.ndarray:
        buf = to_storage(inputs[t.rank], dtype)
        registry.adasum(t, buf, dtype, tensors)
        return buf

    results = run_ranks(size, body)
    want = reference(inputs, [s for s in tensors if s[1]])
    tol = TOLERANCE[dtype]
    for got in results:
        np.testing.assert_array_equal(got, results[0])
        np.testing.assert_allclose(as_f64(got, dtype), want, rtol=tol, atol=tol * size)
    assert not np.isnan(as_f64(results[0], dtype)).any()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("total", [0, 1, 3, 9])
def test_adasum_tiny_buffers_and_gaps(total: int) -> None:
    size = 4
    tensors = [(1, total - 2)] if total > 2 else []  # elements outside: their own tensors
    inputs = [np.arange(total, dtype=np.float64) * (r % 2 + 1) - r for r in range(size)]

    def body(t: LoopbackTransport) -> np.ndarray:
        buf = inputs[t.rank].copy()
        registry.adasum(t, buf, "float64", tensors)
        return buf

    pieces = [(1, total - 2), (0, 1), (total - 1, 1)] if total > 2 else []
    pieces = pieces or [(i, 1) for i in range(total)]
    want = reference(inputs, pieces)
    for got in run_ranks(size, body):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(60)
def test_adasum_of_equal_vectors_is_the_vector_and_orthogonal_ones_add() -> None:
    def body(t: LoopbackTransport) -> list[np.ndarray]:
        same = np.array([1.0, 2.0, 3.0, 4.0])
        registry.adasum(t, same, "float64", [(0, 4)])
        ortho = np.zeros(4)
        ortho[t.rank] = 1.0
        registry.adasum(t, ortho, "float64", [(0, 4)])
        return [same, ortho]

    for same, ortho in run_ranks(4, body):
        np.testing.assert_allclose(same, [1.0, 2.0, 3.0, 4.0])
        np.testing.assert_allclose(ortho, [1.0, 1.0, 1.0, 1.0])


@pytest.mark.timeout(60)
def test_adasum_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        run_ranks(3, lambda t: registry.adasum(t, np.ones(4), "float64", [(0, 4)]))
    with pytest.raises(TypeError, match="floating-point"):
        run_ranks(2, lambda t: registry.adasum(t, np.ones(4, np.int32), "int32", [(0, 4)]))
    with pytest.raises(ValueError, match="disjoint"):
        run_ranks(1, lambda t: registry.adasum(t, np.ones(4), "float64", [(0, 3), (2, 2)]))
    with pytest.raises(ValueError, match="disjoint"):
        run_ranks(1, lambda t: registry.adasum(t, np.ones(4), "float64", [(2, 3)]))
