"""Element-wise reduction and scaling of storage-dtype NumPy buffers, in place.

Reduction op ints follow Horovod (``AVERAGE=0 ... PRODUCT=5``). AVERAGE reduces as SUM: the
engine folds ``1/size`` into the postscale. bool reduces logically (SUM/MAX = or, MIN/PRODUCT =
and). bfloat16 (``uint16`` storage) is widened to float32, reduced, and rounded back to nearest
even. Every kernel is a vectorised NumPy call, which releases the GIL on large arrays.

Pure functions of their arguments; thread-safe.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

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


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 storage (``uint16``) to a new float32 array (exact)."""
    wide = bits.astype(np.uint32)
    np.left_shift(wide, 16, out=wide)
    return wide.view(np.float32)


def f32_to_bf16(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Round float32 to bfloat16 storage, to nearest even; NaN stays a (quiet) NaN.

    Writes into ``out`` (``uint16``, same length) when given, else returns a new array.
    """
    src = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = np.right_shift(src, 16)
    np.bitwise_and(rounded, 1, out=rounded)
    rounded += 0x7FFF
    rounded += src
    np.right_shift(rounded, 16, out=rounded)
    nan = np.isnan(src.view(np.float32))
    if nan.any():
        rounded[nan] = (src[nan] >> 16) | 0x0040
    if out is None:
        return rounded.astype(np.uint16)
    np.copyto(out, rounded, casting="unsafe")
    return out


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
        _check(op, dtype)
        if dtype == "bool":
            found = _ufunc_reducer(_BOOL_UFUNCS[op])
        elif dtype == "bfloat16":
            found = _bf16_reducer(_UFUNCS[op])
        else:
            found = _ufunc_reducer(_UFUNCS[op])
        _REDUCERS[op, dtype] = found
    return found


_REDUCERS: dict[tuple[int, str], Reducer] = {}  # made once per (op, dtype), checked then
_COUNTS, _REDUCED = tally.counts, tally.REDUCED  # every reducer counts what it folds in


def _ufunc_reducer(ufunc: np.ufunc) -> Reducer:
    def reduce(acc: np.ndarray, incoming: np.ndarray, out: np.ndarray | None = None) -> None:
        ufunc(acc, incoming, out=acc if out is None else out)
        _COUNTS[_REDUCED] += incoming.nbytes

    return reduce


def _bf16_reducer(ufunc: np.ufunc) -> Reducer:
    def reduce(acc: np.ndarray, incoming: np.ndarray, out: np.ndarray | None = None) -> None:
        wide = bf16_to_f32(acc)
        ufunc(wide, bf16_to_f32(incoming), out=wide)
        f32_to_bf16(wide, out=acc if out is None else out)
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
    if dtype == "bfloat16":
        wide = bf16_to_f32(buf)
        wide *= np.float32(factor)
        f32_to_bf16(wide, out=buf)
    elif dtype == "float16":
        wide = buf.astype(np.float32)
        wide *= np.float32(factor)
        np.copyto(buf, wide, casting="unsafe")
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
    left); else the plain reducer, and ``post``."""
    red = reducer(op, dtype)
    if size != 2 or post == 1.0:
        return red, post
    key = (op, dtype, post)
    once = _SCALED.get(key)
    if once is None:
        once = scaled(red, dtype, post)
        if once is None:
            return red, post
        if len(_SCALED) >= 64:  # postscale factors are few; never an unbounded table
            _SCALED.clear()
        _SCALED[key] = once
    return once, 1.0


_SCALED: dict[tuple[int, str, float], Reducer] = {}


def _fits_integer(factor: float, dtype: np.dtype) -> bool:
    info = np.iinfo(dtype)
    return float(factor).is_integer() and info.min <= factor <= info.max
