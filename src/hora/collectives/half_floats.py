"""float16 and bfloat16 reduced and scaled in float32, in cache-sized pieces.

A 16-bit float is a wire format, not an arithmetic: each piece of ``PIECE`` elements is widened
to float32 (exactly), reduced or scaled there, and narrowed back to nearest even, so a piece
never leaves the cache between the passes. The bits are those of one float32 operation per
element rounded once: for float16 the same as NumPy's float16 ufuncs and Horovod's float16 sum
on the CPU (each pair widened, added in float and rounded back); a scaled result is rounded
after the reduction and again after the scaling, as :func:`hora.collectives.reduce_ops.scale`
apart would make it. A NaN stays a NaN (its payload is not kept).

The widening and narrowing are a :class:`Casts`. NumPy's own (the default) convert float16 an
element at a time, 3 to 7 ns each on a current x86 core: about what a float16 ufunc costs, so
with them float16 is reduced by NumPy's ufunc directly. A binding whose framework has
vectorised conversions installs them with :func:`use_casts` (``hora.torch`` does: F16C/AVX,
0.2 ns an element), and 16-bit floats are then reduced through float32 pieces. Such a binding
may also do a piece's whole operation in one vectorised call (:meth:`Casts.combine`,
:meth:`Casts.multiply`: torch's 16-bit kernels widen, operate and round in registers, with the
same bits), which saves the float32 pieces' four passes: 1.6 M float16 elements summed in
0.9 ms against 2.8 ms through the pieces, scaled in 0.8 against 2.3 (one core).

Pure functions of their arguments, apart from the installed casts (a module global set at
import of a binding); thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

# elements per piece: two float32 pieces (256 KiB) and their 16-bit sources stay in L2
PIECE = 32 << 10

HALF_FLOATS = ("float16", "bfloat16")


class Casts(Protocol):
    """Widening of 16-bit float storage to float32 and narrowing back (to nearest even).

    ``src`` and ``dst`` are 1-D and of one length; ``dtype`` is ``"float16"`` (storage
    ``float16``) or ``"bfloat16"`` (storage ``uint16``). ``src`` may be read-only."""

    vectorised: bool  # fast enough that a piece-wise float32 pass beats NumPy's float16 ufuncs

    def widen(self, src: np.ndarray, dst: np.ndarray, dtype: str) -> None: ...

    def narrow(self, src: np.ndarray, dst: np.ndarray, dtype: str) -> None: ...

    def combine(self, ufunc: np.ufunc, acc: np.ndarray, incoming: np.ndarray, out: np.ndarray,
                dtype: str) -> bool:  # fmt: skip
        """``out = acc (ufunc) incoming`` on storage, each element one float32 operation rounded
        once, in one call; False where it cannot (then the caller goes through float32
        pieces). At most :data:`PIECE` elements (a framework's kernels stay on this thread)."""
        ...

    def multiply(self, buf: np.ndarray, factor: np.float32, dtype: str) -> bool:
        """``buf *= factor`` on storage (in float32, rounded once) in one call, or False, as
        :meth:`combine`."""
        ...


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


class NumpyCasts:
    """NumPy's conversions: float16 by its cast, bfloat16 by shifting and rounding bits."""

    vectorised = False

    def widen(self, src: np.ndarray, dst: np.ndarray, dtype: str) -> None:
        if dtype == "float16":
            np.copyto(dst, src)
        else:
            bits = dst.view(np.uint32)
            np.copyto(bits, src)
            np.left_shift(bits, 16, out=bits)

    def narrow(self, src: np.ndarray, dst: np.ndarray, dtype: str) -> None:
        if dtype == "float16":
            np.copyto(dst, src, casting="same_kind")
        else:
            f32_to_bf16(src, out=dst)

    def combine(self, ufunc: np.ufunc, acc: np.ndarray, incoming: np.ndarray, out: np.ndarray,
                dtype: str) -> bool:  # fmt: skip
        return False  # through float32 pieces

    def multiply(self, buf: np.ndarray, factor: np.float32, dtype: str) -> bool:
        return False


_casts: Casts = NumpyCasts()
_listeners: list[Callable[[], None]] = []  # told when the casts change (reducer caches)


def casts() -> Casts:
    """The installed :class:`Casts`."""
    return _casts


def use_casts(new: Casts) -> None:
    """Install ``new`` for every later reduction and scaling of 16-bit floats (a binding does
    this once, at import, before any collective runs)."""
    global _casts
    _casts = new
    for forget in _listeners:
        forget()


def on_casts_changed(forget: Callable[[], None]) -> None:
    """Call ``forget`` whenever :func:`use_casts` installs other casts."""
    _listeners.append(forget)


Reducer = Callable[..., None]  # reduce_ops.Reducer: (acc, incoming, out=None)


def wide_reducer(ufunc: np.ufunc, dtype: str, factor: float = 1.0) -> Reducer:
    """``acc (ufunc) incoming`` on 16-bit float storage, in place or into ``out``, made in
    float32 piece by piece; with ``factor``, each result rounded and then scaled by it."""
    f = np.float32(factor)

    def reduce(acc: np.ndarray, incoming: np.ndarray, out: np.ndarray | None = None) -> None:
        res = acc if out is None else out
        c, n = _casts, res.size
        step = max(1, min(PIECE, n))  # an empty buffer: no piece
        wa = wb = None
        for a in range(0, n, step):
            b = min(a + step, n)
            piece = res[a:b]
            if c.combine(ufunc, acc[a:b], incoming[a:b], piece, dtype):
                if factor != 1.0 and not c.multiply(piece, f, dtype):  # the sum rounded first
                    _scale_piece(c, piece, f, dtype, np.empty(b - a, np.float32))
                continue
            if wa is None or wb is None:
                wa, wb = np.empty(step, np.float32), np.empty(step, np.float32)
            x, y = wa[: b - a], wb[: b - a]
            c.widen(acc[a:b], x, dtype)
            c.widen(incoming[a:b], y, dtype)
            ufunc(x, y, out=x)
            if factor != 1.0:  # the sum's own rounding first, as scaling it apart would
                c.narrow(x, piece, dtype)
                c.widen(piece, x, dtype)
                np.multiply(x, f, out=x)
            c.narrow(x, piece, dtype)

    return reduce


def scale_wide(buf: np.ndarray, dtype: str, factor: float) -> None:
    """``buf *= factor`` on 16-bit float storage, in float32 piece by piece."""
    f, c, n = np.float32(factor), _casts, buf.size
    step = max(1, min(PIECE, n))  # an empty buffer: no piece
    wide = None
    for a in range(0, n, step):
        b = min(a + step, n)
        if c.multiply(buf[a:b], f, dtype):
            continue
        if wide is None:
            wide = np.empty(step, np.float32)
        _scale_piece(c, buf[a:b], f, dtype, wide[: b - a])


def _scale_piece(c: Casts, piece: np.ndarray, f: np.float32, dtype: str,
                 wide: np.ndarray) -> None:  # fmt: skip
    """``piece *= f`` through ``wide`` (float32, the piece's length)."""
    c.widen(piece, wide, dtype)
    np.multiply(wide, f, out=wide)
    c.narrow(wide, piece, dtype)
