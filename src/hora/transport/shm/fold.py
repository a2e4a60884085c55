"""Reducing receives of the shared-memory pair: a frame folded into typed parts as it arrives.

A frame's bytes may span several parts of the receiving buffer (a scatter), each part a 1-D
typed array; :func:`fold_into` and :func:`fold_piece` reduce bytes of the frame into the parts
they fall in, in place or, with the parts' own inputs given, apart from them (an out-of-place
reduction in the same pass). Pure functions; run by whichever thread receives the frame.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence

import numpy as np

Reduce = Callable[..., None]  # reduce_ops.Reducer: (acc, incoming, out=None)
# typed parts, reduction, uint8 scratch, and the parts' inputs when they are not in the parts
# (an out-of-place reduction: part = source (op) frame)
Fold = tuple[list[np.ndarray], Reduce, np.ndarray, list[np.ndarray] | None]


def ranges(offsets: list[int], start: int, size: int) -> list[tuple[int, int, int]]:
    """The parts that bytes ``[start, start + size)`` of a concatenation fall in, as
    ``(part index, offset in the part, bytes)``; ``offsets`` are the parts' starts, then the
    total."""
    out = []
    i = bisect.bisect_right(offsets, start) - 1
    end = start + size
    while start < end:
        n = min(offsets[i + 1], end) - start
        if n:
            out.append((i, start - offsets[i], n))
        start += n
        i += 1
    return out


def offsets_of_parts(sizes: Sequence[int]) -> list[int]:
    return [0, *itertools.accumulate(sizes)]


def fold_into(fold: Fold, offsets: list[int], start: int, incoming: np.ndarray) -> None:
    """Reduce ``incoming`` (bytes ``[start, start + len)`` of the frame) into the parts."""
    at = 0
    for i, off, n in ranges(offsets, start, incoming.nbytes):
        fold_piece(fold, i, off, n, incoming[at : at + n])
        at += n


def fold_piece(fold: Fold, i: int, off: int, n: int, incoming: np.ndarray) -> None:
    """Reduce ``incoming`` (``n`` bytes) into bytes ``[off, off + n)`` of part ``i``."""
    arrays, reduce, _, sources = fold
    arr = arrays[i]
    per = arr.itemsize
    at = slice(off // per, (off + n) // per)
    if sources is None:
        reduce(arr[at], incoming.view(arr.dtype))
    else:
        reduce(sources[i][at], incoming.view(arr.dtype), out=arr[at])


def beside(scratch: np.ndarray, addr: int, per: int) -> np.ndarray:
    """The part of ``scratch`` (uint8, at least a reducing step + 4 KiB) that starts at the
    same offset in a 4 KiB page as ``addr``, to an element of ``per`` bytes. A copy whose
    destination lies a few bytes past its source's offset in the page stalls every load on
    the store before it (4K aliasing): a page-aligned torch tensor pulled into scratch that
    lies 16 bytes into its page took 14.2-14.5 ms to allreduce at 64 MiB, 10.7-11.3 at any
    other offset (np=2, one host)."""
    lead = (addr - scratch.ctypes.data) % 4096
    return scratch[lead - lead % per :]
