"""reduce_ops: element-wise reducers, scaling, and bfloat16 rounding."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from coll_helpers import to_storage

from hora.collectives import reduce_ops as ro
from hora.dtypes import DTYPES

ELEMENTWISE = [ro.AVERAGE, ro.SUM, ro.MIN, ro.MAX, ro.PRODUCT]


def _inputs(dtype: str) -> tuple[np.ndarray, np.ndarray]:
    if dtype == "bool":
        return np.array([0, 0, 1, 1], bool), np.array([0, 1, 0, 1], bool)
    a = np.array([1, 5, 7, 2, 0, 3], np.int64)
    b = np.array([2, 3, 7, 9, 4, 1], np.int64)
    if dtype.startswith("int") or dtype in ("float16", "bfloat16", "float32", "float64"):
        a[0], b[1] = -3, -2
    return a, b


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ELEMENTWISE)
def test_reducer_matches_numpy(dtype: str, op: int) -> None:
    a, b = _inputs(dtype)
    if dtype == "bool":
        expect = np.logical_or(a, b) if op in (ro.SUM, ro.AVERAGE, ro.MAX) else a & b
    else:
        fn = {ro.SUM: np.add, ro.AVERAGE: np.add, ro.MIN: np.minimum, ro.MAX: np.maximum}
        expect = fn.get(op, np.multiply)(a, b)
    acc, incoming = to_storage(a, dtype), to_storage(b, dtype)
    out = np.zeros_like(acc)
    ro.reducer(op, dtype)(acc, incoming, out=out)  # apart: both inputs only read
    np.testing.assert_array_equal(out, to_storage(expect, dtype))
    np.testing.assert_array_equal(acc, to_storage(a, dtype))
    ro.reducer(op, dtype)(acc, incoming)
    np.testing.assert_array_equal(acc, to_storage(expect, dtype))
    np.testing.assert_array_equal(incoming, to_storage(b, dtype))  # incoming untouched


@pytest.mark.timeout(30)
def test_reducer_rejects_adasum_unknown_op_and_dtype() -> None:
    with pytest.raises(ValueError, match="adasum"):
        ro.reducer(ro.ADASUM, "float32")
    with pytest.raises(ValueError, match="unknown reduce op"):
        ro.reducer(9, "float32")
    with pytest.raises(TypeError, match="complex64"):
        ro.reducer(ro.SUM, "complex64")


@pytest.mark.timeout(30)
def test_bf16_round_trip_of_every_bit_pattern() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    wide = ro.bf16_to_f32(bits)
    np.testing.assert_array_equal(wide, bits.view(ml_dtypes.bfloat16).astype(np.float32))
    back = ro.f32_to_bf16(wide)
    nan = np.isnan(wide)
    np.testing.assert_array_equal(back[~nan], bits[~nan])
    assert np.isnan(ro.bf16_to_f32(back[nan])).all()


@pytest.mark.timeout(30)
def test_f32_to_bf16_rounds_to_nearest_even() -> None:
    one = np.float32(1.0).view(np.uint32)
    cases = np.array(
        [one + 0x8000, one + 0x18000, one + 0x8001, one + 0x7FFF, 0x7F7FFFFF, 0x7F800001],
        np.uint32,
    ).view(np.float32)
    got = ro.f32_to_bf16(cases)
    # ties go to the even neighbour, above the tie rounds up, the largest float overflows to inf
    assert list(got[:5]) == [0x3F80, 0x3F82, 0x3F81, 0x3F80, 0x7F80]
    assert np.isnan(ro.bf16_to_f32(got[5:])).all()
    rng = np.random.default_rng(1)
    values = (rng.standard_normal(100_000) * 10.0 ** rng.integers(-30, 30, 100_000)).astype(
        np.float32
    )
    np.testing.assert_array_equal(
        ro.f32_to_bf16(values), values.astype(ml_dtypes.bfloat16).view(np.uint16)
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale(dtype: str) -> None:
    if dtype == "bool":
        buf = np.array([True, False, True])
        ro.scale(buf, dtype, 0.5)
        assert not buf.any()
        return
    values = np.array([4, -6, 7, 0]) if not dtype.startswith("uint") else np.array([4, 6, 7, 0])
    buf = to_storage(values, dtype)
    ro.scale(buf, dtype, 1.0)
    np.testing.assert_array_equal(buf, to_storage(values, dtype))
    ro.scale(buf, dtype, 0.5)
    expect = np.trunc(values * 0.5) if dtype[0] in "iu" else values * 0.5
    np.testing.assert_array_equal(buf, to_storage(expect, dtype))
    ro.scale(buf, dtype, 3.0)
    np.testing.assert_array_equal(buf, to_storage(expect * 3, dtype))


@pytest.mark.timeout(30)
def test_scale_rounds_half_precision_once() -> None:
    buf = np.array([1.0, 3.0], np.float16)
    ro.scale(buf, "float16", 1 / 3)
    np.testing.assert_array_equal(buf, np.array([1 / 3, 1.0]).astype(np.float16))
    with pytest.raises(TypeError, match="storage dtype"):
        ro.scale(np.ones(2, np.float32), "float64", 2.0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("factor", [0.5, 1 / 3, 7.25])
def test_a_scaled_reducer_gives_the_bits_of_reducing_then_scaling(dtype: str,
                                                                   factor: float) -> None:
    st = np.dtype(dtype)
    step = ro.SCALE_PIECE_BYTES // st.itemsize
    rng = np.random.default_rng(7)
    for count in (0, 1, 999, step, 2 * step + 17):  # one piece, exactly one, several and a tail
        a, b = rng.standard_normal(count).astype(st), rng.standard_normal(count).astype(st)
        want = a + b
        ro.scale(want, dtype, factor)
        red = ro.scaled(ro.reducer(ro.SUM, dtype), dtype, factor)
        assert red is not None
        out, before = np.full(count, np.nan, st), a.copy()
        red(a, b, out=out)  # apart: a stays as it was
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(a, before)
        red(a, b)  # in place
        np.testing.assert_array_equal(a, want)


@pytest.mark.timeout(30)
def test_a_reduction_is_scaled_in_its_pass_only_between_two_members_and_exactly() -> None:
    plain = ro.reducer(ro.SUM, "float32")
    # more members fold an element in several calls: the factor is left to scale after
    assert ro.reducer_scaled(3, ro.SUM, "float32", 0.5) == (plain, 0.5)
    assert ro.reducer_scaled(2, ro.SUM, "float32", 1.0) == (plain, 1.0)
    # integers scale truncated: apart, as before (16-bit floats: test_coll_half_floats.py)
    assert ro.scaled(ro.reducer(ro.SUM, "int32"), "int32", 0.5) is None
    assert ro.reducer_scaled(2, ro.SUM, "int32", 0.5)[1] == 0.5
    red, left = ro.reducer_scaled(2, ro.MAX, "float64", 0.25)
    assert left == 1.0 and red is ro.reducer_scaled(2, ro.MAX, "float64", 0.25)[0]  # made once
    acc = np.array([1.0, -8.0, 4.0])
    red(acc, np.array([2.0, -12.0, 3.0]))
    np.testing.assert_array_equal(acc, [0.5, -2.0, 1.0])
