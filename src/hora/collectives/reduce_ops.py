"""Element-wise reduction and scaling of storage-dtype NumPy buffers, in place.

Reduction op ints follow Horovod (``AVERAGE=0 ... PRODUCT=5``). AVERAGE reduces as SUM: the
engine folds ``1/size`` into the postscale. bool reduces logically (SUM/MAX = or, MIN/PRODUCT =
and). float16 and bfloat16 (``uint16`` storage) are reduced and scaled in float32, piece by
piece, and rounded back to nearest even (:mod:`hora.collectives.half_floats`). Every kernel is a
vectorised NumPy call, which releases the GIL on large arrays.

Pure functions of their arguments; thread-safe.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from hora.collectives.half_floats import (
    HALF_FLOATS,
    casts,
    on_casts_changed,
    scale_wide,
    wide_reducer,
)
from hora.collectives.half_floats import bf16_to_f32 as bf16_to_f32  # re-exported: adasum, tests
from hora.collectives.half_floats import f32_to_bf16 as f32_to_bf16
from hora.dtypes import DTYPES, FLOATING, storage_dtype
from hora.transport import tally

AVERAGE = 0
SUM = 1
ADASUM = 2
MIN = 3
MAX = 4
PRODUCT = 5

OP_NAMES: dict[int, str] = {
    AVERAGE: "Average",
    SUM: "Sum",
    ADASUM: "Adasum",
    MIN: "Min",
    MAX: "Max",
    PRODUCT: "Product",
}



class Reducer(Protocol):
    """``acc = acc (op) incoming`` in place on storage-dtype arrays; with ``out``, the result
    goes there instead and ``acc`` is only read (an out-of-place reduction in one pass)."""

    def __call__(
        self, acc: np.ndarray, incoming: np.ndarray, out: np.ndarray | None = None
    ) -> None: ...


_UFUNCS: dict[int, np.ufunc] = {
    AVERAGE: np.add,
    SUM: np.add,
    MIN: np.minimum,
    MAX: np.maximum,
    PRODUCT: np.multiply,
}
_BOOL_UFUNCS: dict[int, np.ufunc] = {
    AVERAGE: np.logical_or,
    SUM: np.logical_or,
    MAX: np.logical_or,
    MIN: np.logical_and,
    PRODUCT: np.logical_and,
}


def _check(op: int, dtype: str) -> None:
    if dtype not in DTYPES:
        raise TypeError(f"unsupported dtype {dtype!r}; hora carries {', '.join(DTYPES)}")
    if op == ADASUM:
        raise ValueError("Adasum is not an element-wise op; call collectives.adasum instead")
    if op not in _UFUNCS:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(OP_NAMES)}")


def reducer(op: int, dtype: str) -> Reducer:
    """A :class:`Reducer`: ``acc = acc (op) incoming`` (or into ``out``) on storage arrays."""
    found = _REDUCERS.get((op, dtype))
    if found is None:
        ufunc = plain_ufunc(op, dtype)
        found = _wide_reducer(_UFUNCS[op], dtype) if ufunc is None else _ufunc_reducer(ufunc)
        _REDUCERS[op, dtype] = found
    return found


def plain_ufunc(op: int, dtype: str) -> np.ufunc | None:
    """The ufunc whose one call on storage arrays is :func:`reducer`'s fold (which also
    counts the bytes); None where the fold widens (bfloat16, and float16 where NumPy's casts
    are vectorised)."""
    _check(op, dtype)
    if dtype == "bool":
        return _BOOL_UFUNCS[op]
    if dtype == "bfloat16" or dtype == "float16" and casts().vectorised:
        return None
    return _UFUNCS[op]  # float16 with NumPy's casts: its float16 ufuncs, the same bits, as fast


_REDUCERS: dict[tuple[int, str], Reducer] = {}  # made once per (op, dtype), checked then
_COUNTS, _REDUCED = tally.counts, tally.REDUCED  # every reducer counts what it folds in


def _ufunc_reducer(ufunc: np.ufunc) -> Reducer:
    def reduce(acc: np.ndarray, incoming: np.ndarray, out: np.ndarray | None = None) -> None:
        ufunc(acc, incoming, out=acc if out is None else out)
        _COUNTS[_REDUCED] += incoming.nbytes

    return reduce


def _wide_reducer(ufunc: np.ufunc, dtype: str, factor: float = 1.0) -> Reducer:
    wide = wide_reducer(ufunc, dtype, factor)

    def reduce(acc: np.ndarray, incoming: np.ndarray, out: np.ndarray | None = None) -> None:
        wide(acc, incoming, out)
        _COUNTS[_REDUCED] += incoming.nbytes

    return reduce


def scale(buf: np.ndarray, dtype: str, factor: float) -> None:
    """``buf *= factor`` in place; integers are truncated toward zero, bool stays 0/1."""
    if factor == 1.0 or buf.size == 0:
        return
    if dtype not in DTYPES:
        raise TypeError(f"unsupported dtype {dtype!r}; hora carries {', '.join(DTYPES)}")
    if buf.dtype != storage_dtype(dtype):
        raise TypeError(f"buffer dtype {buf.dtype} is not the storage dtype of {dtype}")
    if dtype in HALF_FLOATS:
        scale_wide(buf, dtype, factor)
    elif dtype in FLOATING:
        np.multiply(buf, buf.dtype.type(factor), out=buf)
    elif dtype != "bool" and _fits_integer(factor, buf.dtype):
        np.multiply(buf, buf.dtype.type(int(factor)), out=buf)
    else:
        wide64 = buf.astype(np.float64)
        wide64 *= factor
        np.trunc(wide64, out=wide64)
        np.copyto(buf, wide64, casting="unsafe")


# a scaled reducer works through large arrays in pieces of this many bytes: the scaling then
# reads each piece of the result from the cache the reduction just wrote it to
SCALE_PIECE_BYTES = 256 << 10


def scaled(reduce: Reducer, dtype: str, factor: float) -> Reducer | None:
    """``reduce``, with every result it makes multiplied by ``factor`` while in cache: the
    same bits as :func:`scale` over the whole result afterwards, in one pass less over memory
    (an Average of two members: 64 MiB took 1.65x as long as a Sum with the scaling apart).
    Only for a reduction that makes each element of the result in one call, as every
    algorithm between two members does (more members fold each element in several calls).
    None where :func:`scale` widens or truncates (not float32 or float64): scale apart."""
    if factor == 1.0:
        return reduce
    if dtype not in ("float32", "float64"):
        return None
    f = storage_dtype(dtype).type(factor)
    step = SCALE_PIECE_BYTES // storage_dtype(dtype).itemsize

    def reduce_scaled(acc: np.ndarray, incoming: np.ndarray, out: np.ndarray | None = None) -> None:
        res = acc if out is None else out
        if res.size <= step:
            reduce(acc, incoming, out=res)
            np.multiply(res, f, out=res)
            return
        for a in range(0, res.size, step):
            b = a + step
            piece = res[a:b]
            reduce(acc[a:b], incoming[a:b], out=piece)
            np.multiply(piece, f, out=piece)

    return reduce_scaled


def reducer_scaled(size: int, op: int, dtype: str, post: float) -> tuple[Reducer, float]:
    """The reducer of an allreduce among ``size`` members whose result is scaled by ``post``,
    and the factor left to :func:`scale` after it: between two members, each element of the
    result is made in one reduction, which then scales it while in cache (:func:`scaled`, 1.0
    left); else the plain reducer, and ``post``. 16-bit floats are scaled in the reduction's
    float32 pieces, each result rounded before and after (the bits of :func:`scale` apart)."""
    if size != 2:
        return reducer(op, dtype), post
    return finishing(op, dtype, post)


def finishing(op: int, dtype: str, post: float) -> tuple[Reducer, float]:
    """The reducer for the call that makes each element's final value (the last reduction
    step of a ring, or the one reduction between two members), scaling its results by
    ``post`` while in cache, and the factor left to :func:`scale` after it (1.0, or ``post``
    where it cannot: integers and bool). The bits of :func:`scale` over the result apart."""
    red = reducer(op, dtype)
    if post == 1.0:
        return red, post
    key = (op, dtype, post)
    once = _SCALED.get(key)
    if once is None:
        if dtype in HALF_FLOATS:
            once = _wide_reducer(_UFUNCS[op], dtype, post)
        else:
            once = scaled(red, dtype, post)
        if once is None:
            return red, post
        if len(_SCALED) >= 64:  # postscale factors are few; never an unbounded table
            _SCALED.clear()
        _SCALED[key] = once
    return once, 1.0


_SCALED: dict[tuple[int, str, float], Reducer] = {}


def _forget_reducers() -> None:
    _REDUCERS.clear()
    _SCALED.clear()


on_casts_changed(_forget_reducers)  # other casts may choose other reducers


def _fits_integer(factor: float, dtype: np.dtype) -> bool:
    info = np.iinfo(dtype)
    return float(factor).is_integer() and info.min <= factor <= info.max
