"""float16/bfloat16 reduced and scaled in float32 pieces: the bits of one float32 operation per
element rounded to nearest even, with NumPy's casts and with torch's vectorised ones."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from hora.collectives import half_floats as hf
from hora.collectives import reduce_ops as ro

pytest.importorskip("torch")
from hora.torch import casts as torch_casts  # noqa: E402

OPS = {ro.SUM: np.add, ro.MIN: np.minimum, ro.MAX: np.maximum, ro.PRODUCT: np.multiply}
# a piece, exactly one, several with a tail
COUNTS = (1, 1000, hf.PIECE, 2 * hf.PIECE + 17)


@pytest.fixture(params=["numpy", "torch"])
def casts(request: pytest.FixtureRequest) -> Iterator[hf.Casts]:
    before = hf.casts()
    chosen = hf.NumpyCasts() if request.param == "numpy" else torch_casts.TorchCasts()
    hf.use_casts(chosen)
    try:
        yield chosen
    finally:
        hf.use_casts(before)


def _values(count: int, seed: int) -> np.ndarray:
    """float32 values over float16's whole range: subnormals, overflow, inf, NaN, signed zero."""
    rng = np.random.default_rng(seed)
    scale = rng.choice(np.array([1e-7, 1e-3, 1.0, 300.0, 3e4], np.float32), count)
    v = (rng.standard_normal(count).astype(np.float32) * scale).astype(np.float32)
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 65504.0, 6e-8], np.float32)
    v[: min(count, len(special))] = special[: min(count, len(special))]
    return v


def _storage(values: np.ndarray, dtype: str) -> np.ndarray:
    with np.errstate(over="ignore"):
        return values.astype(np.float16) if dtype == "float16" else ro.f32_to_bf16(values)


def _wide(bits: np.ndarray, dtype: str) -> np.ndarray:
    return bits.astype(np.float32) if dtype == "float16" else ro.bf16_to_f32(bits)


def _same(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    """Equal bits, except that any NaN may stand for any NaN, and min/max of +0 and -0 may
    give either zero (NumPy's float16 and float32 kernels pick differently)."""
    g, w = _wide(got, dtype), _wide(want, dtype)
    nan, zero = np.isnan(w), w == 0
    np.testing.assert_array_equal(np.isnan(g), nan)
    np.testing.assert_array_equal(g[zero], 0.0)
    keep = ~(nan | zero)
    np.testing.assert_array_equal(got.view(np.uint16)[keep], want.view(np.uint16)[keep])


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", hf.HALF_FLOATS)
@pytest.mark.parametrize("op", sorted(OPS))
def test_reduction_is_one_float32_operation_rounded_once(casts: hf.Casts, dtype: str,
                                                         op: int) -> None:  # fmt: skip
    for count in COUNTS:
        a, b = _storage(_values(count, 1), dtype), _storage(_values(count, 2), dtype)
        want = _storage(OPS[op](_wide(a, dtype), _wide(b, dtype)), dtype)
        if dtype == "float16":  # NumPy's own float16 ufunc, and so Horovod's float16 sum
            _same(OPS[op](a, b), want, dtype)
        red = ro.reducer(op, dtype)
        out, before = np.zeros_like(a), a.copy()
        red(a, b, out=out)
        _same(out, want, dtype)
        np.testing.assert_array_equal(a, before)  # apart: the input only read
        red(a, b)
        _same(a, want, dtype)


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", hf.HALF_FLOATS)
@pytest.mark.parametrize("factor", [0.5, 1 / 3])
def test_a_scaled_reduction_rounds_the_sum_then_the_scaled_sum(casts: hf.Casts, dtype: str,
                                                               factor: float) -> None:  # fmt: skip
    red, left = ro.reducer_scaled(2, ro.SUM, dtype, factor)
    assert left == 1.0  # scaled in the reduction's pieces, not in a pass of its own after
    for count in COUNTS:
        a, b = _storage(_values(count, 3), dtype), _storage(_values(count, 4), dtype)
        want = ro.reducer(ro.SUM, dtype)
        summed = a.copy()
        want(summed, b)
        ro.scale(summed, dtype, factor)
        expect = _storage(_wide(_storage(_wide(a, dtype) + _wide(b, dtype), dtype), dtype)
                          * np.float32(factor), dtype)  # fmt: skip
        _same(summed, expect, dtype)
        out = np.zeros_like(a)
        red(a, b, out=out)
        _same(out, expect, dtype)


@pytest.mark.timeout(60)
def test_torch_casts_read_read_only_memory_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only source (a peer's mapped block, an out-of-place input) is converted by
    NumPy, since torch warns on read-only NumPy memory; the bits are the same."""
    c = torch_casts.TorchCasts()
    src = _storage(_values(5000, 5), "float16")
    src.flags.writeable = False
    dst = np.empty(5000, np.float32)
    monkeypatch.setattr(torch_casts.torch, "from_numpy", None)  # any use of torch would raise
    c.widen(src, dst, "float16")
    np.testing.assert_array_equal(dst, src.astype(np.float32))


@pytest.mark.timeout(60)
def test_importing_hora_torch_installs_its_casts_and_new_reducers_follow() -> None:
    import hora.torch  # noqa: F401

    before = hf.casts()
    try:
        hf.use_casts(hf.NumpyCasts())
        numpy_red = ro.reducer(ro.SUM, "float16")
        hf.use_casts(torch_casts.TorchCasts())
        assert ro.reducer(ro.SUM, "float16") is not numpy_red  # the cache was forgotten
    finally:
        hf.use_casts(before)
    assert isinstance(hf.casts(), torch_casts.TorchCasts)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_empty_buffers_reduce_and_scale_to_nothing(dtype: str) -> None:
    store = np.uint16 if dtype == "bfloat16" else np.float16
    acc, incoming = np.empty(0, store), np.empty(0, store)
    hf.wide_reducer(np.add, dtype, 0.5)(acc, incoming)
    hf.scale_wide(acc, dtype, 2.0)
    assert acc.size == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", hf.HALF_FLOATS)
def test_torch_reduces_and_scales_a_piece_in_one_kernel(monkeypatch: pytest.MonkeyPatch,
                                                        dtype: str) -> None:  # fmt: skip
    """With torch's casts, a writable piece is summed and scaled by torch's 16-bit kernels,
    never through the float32 pieces (whose widening would raise here); the bits are the
    pieces' (the tests above run both ways)."""
    c = torch_casts.TorchCasts()
    before = hf.casts()
    hf.use_casts(c)
    try:
        a, b = _storage(_values(3 * hf.PIECE, 6), dtype), _storage(_values(3 * hf.PIECE, 7), dtype)
        want = _storage(_wide(a, dtype) + _wide(b, dtype), dtype)

        def no_pieces(*args: object) -> None:
            raise AssertionError("went through the float32 pieces")

        monkeypatch.setattr(c, "widen", no_pieces)
        monkeypatch.setattr(c, "narrow", no_pieces)
        got = a.copy()
        hf.wide_reducer(np.add, dtype)(got, b)
        _same(got, want, dtype)
        hf.scale_wide(got, dtype, 0.5)
        _same(got, _storage(_wide(want, dtype) * np.float32(0.5), dtype), dtype)
        hf.wide_reducer(np.add, dtype, 0.5)(a, b)
        _same(a, got, dtype)
    finally:
        hf.use_casts(before)
    assert not hf.NumpyCasts().combine(np.add, a, b, a, dtype)  # NumPy's: the pieces


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("error")  # torch warns on read-only NumPy memory: never reached
@pytest.mark.parametrize("dtype", hf.HALF_FLOATS)
def test_torch_casts_reduce_read_only_operands_through_the_pieces(dtype: str) -> None:
    """A read-only operand (header bytes, an out-of-place input) is not handed to torch's
    kernels: the piece goes through float32 instead, with the same bits."""
    c = torch_casts.TorchCasts()
    before = hf.casts()
    hf.use_casts(c)
    try:
        a, b = _storage(_values(5000, 8), dtype), _storage(_values(5000, 9), dtype)
        b.flags.writeable = False
        assert not c.combine(np.add, a, b, a, dtype)
        want = _storage(_wide(a, dtype) + _wide(b, dtype), dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            ro.reducer(ro.SUM, dtype)(a, b)
        _same(a, want, dtype)
        a.flags.writeable = False
        assert not c.multiply(a, np.float32(0.5), dtype)
    finally:
        hf.use_casts(before)
