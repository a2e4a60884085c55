"""PowerSGD and top-k against NumPy references (tests/compression_reference.py), in a world of
one: the exact first iterations, error feedback across steps, what is left uncompressed, state.
Several ranks: tests/integration/test_grad_compression_ranks.py."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import hora
from compression_reference import powersgd_step, topk_step
from hora.frameworks import topk
from hora.frameworks.powersgd import PowerSGD
from hora.frameworks.topk import TopK


@pytest.fixture(scope="module", autouse=True)
def world_of_one() -> Iterator[None]:
    hora.init()
    try:
        yield
    finally:
        hora.shutdown()


def _grads(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {
        "fc.weight": rng.standard_normal((40, 30)).astype(np.float32),
        "conv.weight": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
        "fc.bias": rng.standard_normal(40).astype(np.float32),
        "thin.weight": rng.standard_normal((2, 300)).astype(np.float32),
    }


@pytest.mark.timeout(60)
def test_powersgd_exact_first_then_low_rank_with_error_feedback_and_warm_start() -> None:
    c = PowerSGD(rank=2, start_iter=2)
    errors: dict[str, np.ndarray] = {}
    qs: dict[str, np.ndarray | None] = {}
    for step in range(6):
        grads = _grads(step)
        before = {n: g.copy() for n, g in grads.items()}
        c.reduce(grads)
        if step < 2:  # exact averaging (a world of one: the gradient itself), no memory
            for n in grads:
                np.testing.assert_array_equal(grads[n], before[n])
            assert c.local == {} and c.shared == {}
            continue
        # the bias (a vector) and the 2 x 300 matrix (rank 2 saves less than 2x) stay exact
        np.testing.assert_array_equal(grads["fc.bias"], before["fc.bias"])
        np.testing.assert_array_equal(grads["thin.weight"], before["thin.weight"])
        for n in ("fc.weight", "conv.weight"):
            err = errors.get(n, np.zeros_like(before[n]))
            want, (new_err,), qs[n] = powersgd_step([before[n]], [err], qs.get(n), 2, n)
            errors[n] = new_err
            np.testing.assert_allclose(grads[n], want, rtol=1e-4, atol=1e-5)
            kept = c.local[n]["error"]
            np.testing.assert_allclose(kept, new_err.reshape(kept.shape), rtol=1e-4, atol=1e-5)
            assert np.linalg.matrix_rank(grads[n].reshape(grads[n].shape[0], -1)) <= 2
    assert c.step == 6


@pytest.mark.timeout(60)
def test_topk_sends_the_largest_and_carries_the_rest() -> None:
    c = TopK(ratio=0.05, min_elements=100)
    errors: dict[str, np.ndarray] = {}
    for step in range(4):
        grads = _grads(10 + step)
        before = {n: g.copy() for n, g in grads.items()}
        c.reduce(grads)
        np.testing.assert_array_equal(grads["fc.bias"], before["fc.bias"])  # 40 < 100: exact
        for n in ("fc.weight", "conv.weight", "thin.weight"):
            err = errors.get(n, np.zeros_like(before[n]))
            k = max(1, round(0.05 * before[n].size))
            want, (errors[n],) = topk_step([before[n]], [err], k)
            np.testing.assert_allclose(grads[n], want, rtol=1e-6, atol=1e-7)
            assert np.count_nonzero(grads[n]) == k
            # nothing is lost: what was sent and what is carried make up gradient + memory
            sent_and_kept = grads[n].reshape(-1) + c.local[n]["error"]
            np.testing.assert_allclose(sent_and_kept, (before[n] + err).reshape(-1), atol=1e-6)


def _exact_top(values: np.ndarray, k: int) -> np.ndarray:
    return np.argpartition(np.abs(values), values.size - k)[values.size - k :]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", ["normal", "heavy", "ties", "sampled-high", "nan"])
def test_top_indices_of_a_large_gradient_are_the_k_largest(shape: str) -> None:
    """Past the sampled threshold's size, the entries chosen have the magnitudes of the k
    largest (ties at the k-th magnitude may pick other indices), ascending. Where the threshold
    lets too few through (the largest entries exactly where the sample looks), and with a NaN,
    the selection over every entry decides."""
    rng = np.random.default_rng(7)
    n = topk._SAMPLED_FROM * topk._SAMPLE + 12345
    step = n // topk._SAMPLE
    values = {
        "normal": lambda: rng.standard_normal(n),
        "heavy": lambda: rng.standard_cauchy(n),
        "ties": lambda: np.repeat(rng.integers(-50, 50, n // 16 + 1), 16)[:n],
        "sampled-high": lambda: np.where(np.arange(n) % step == 0, 1e6, rng.standard_normal(n)),
        "nan": lambda: rng.standard_normal(n),
    }[shape]().astype(np.float32)
    if shape == "nan":
        values[4321] = np.nan
    for k in (1, n // 1000, n // 100, n // 4):
        got = topk.top_indices(values, k)
        assert got.size == k and np.all(np.diff(got) > 0)
        want = _exact_top(values, k)
        np.testing.assert_array_equal(np.sort(np.abs(values[got])), np.sort(np.abs(values[want])))
        if shape == "nan":
            assert 4321 in got


@pytest.mark.timeout(60)
def test_state_round_trips_and_a_broadcast_keeps_local_memory() -> None:
    c = PowerSGD(rank=1, start_iter=0)
    c.reduce(_grads(0))
    saved = c.state_dict()
    c.reduce(_grads(1))
    assert c.step == 2
    c.load_state_dict(saved)
    assert c.step == 1
    np.testing.assert_array_equal(c.shared["fc.weight"]["q"], saved["shared"]["fc.weight"]["q"])
    other = PowerSGD(rank=1, start_iter=0)
    other.load_shared_state(c.shared_state())
    assert other.step == 1 and other.local == {}  # a newcomer: factors, no error memory
    np.testing.assert_array_equal(other.shared["fc.weight"]["q"], c.shared["fc.weight"]["q"])


@pytest.mark.timeout(60)
def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="rank"):
        PowerSGD(rank=0)
    with pytest.raises(ValueError, match="start_iter"):
        PowerSGD(start_iter=-1)
    with pytest.raises(ValueError, match="ratio"):
        TopK(ratio=0.0)
    with pytest.raises(TypeError, match="C-contiguous"):
        TopK().reduce({"w": np.ones((4, 4), np.float32).T[:, :2]})
