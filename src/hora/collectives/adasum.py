"""Adasum allreduce by recursive vector halving and distance doubling.

Two gradients ``a`` and ``b`` combine as ``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b``
(a zero vector contributes nothing and leaves the other one as it is), separately for every
tensor of a fused buffer, with the dot products in float64. Over ``2^L`` ranks the pairs are
(0,1), (2,3), ... then (01,23), ...: at level ``k`` rank ``r`` meets ``r ^ 2^k``; the two
split their current range in half, each keeps one half and sends the other, so each rank
combines a quarter, an eighth, ... of the buffer. The partial dot products of a level are
summed over the ``2^(k+1)`` ranks that hold pieces of the same two vectors (recursive doubling
of ``3 x tensors`` float64 values). Finally the pieces are gathered back by distance halving.
Cost per rank: about ``2 nbytes`` on the wire, plus ``L (L + 1) / 2`` small scalar exchanges.

Float dtypes only; float16/bfloat16 are combined in float32 and rounded back.

Runs on the calling (engine) thread; thread-safe for distinct Comms and buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hora.collectives.allreduce_recursive_doubling import exchange
from hora.collectives.base import Comm, as_bytes, check_buffer
from hora.collectives.reduce_ops import bf16_to_f32, f32_to_bf16
from hora.dtypes import FLOATING
from hora.transport.base import Pair


def _tensor_bounds(segments: Sequence[tuple[int, int]], size: int) -> np.ndarray:
    """Sorted start offsets of the tensors tiling ``[0, size)``; gaps count as tensors."""
    starts: list[int] = []
    end = 0
    for offset, count in sorted((int(o), int(c)) for o, c in segments if c):
        if offset < end or count < 0 or offset + count > size:
            raise ValueError(
                f"adasum segments must be disjoint (offset, count) ranges inside the buffer of "
                f"{size} elements; got {list(segments)}"
            )
        if offset > end:
            starts.append(end)
        starts.append(offset)
        end = offset + count
    if end < size:
        starts.append(end)
    starts.append(size)
    return np.asarray(starts, dtype=np.int64)


def _widen(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return bf16_to_f32(x)
    if dtype == "float16":
        return x.astype(np.float32)
    return x


def _store(dst: np.ndarray, values: np.ndarray, dtype: str) -> None:
    if dtype == "bfloat16":
        f32_to_bf16(values, out=dst)
    elif values is not dst:
        np.copyto(dst, values, casting="unsafe")


def _partials(a: np.ndarray, b: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """Per-piece ``[a.b, a.a, b.b]`` (float64, shape ``(3, pieces)``), pieces cut at ``cuts``."""
    a64 = a.astype(np.float64, copy=False)
    b64 = b.astype(np.float64, copy=False)
    out = np.zeros((3, len(cuts)), np.float64)
    if a.size:
        out[0] = np.add.reduceat(a64 * b64, cuts)
        out[1] = np.add.reduceat(a64 * a64, cuts)
        out[2] = np.add.reduceat(b64 * b64, cuts)
    return out


def _coefficient(dot: np.ndarray, norm2: np.ndarray) -> np.ndarray:
    """``1 - dot / (2 norm2)``, and 1 where ``norm2`` is 0 (that vector is zero anyway)."""
    ratio = np.divide(dot, 2.0 * norm2, out=np.zeros_like(dot), where=norm2 != 0)
    return 1.0 - ratio


def adasum(comm: Comm, buf: np.ndarray, dtype: str, segments: Sequence[tuple[int, int]]) -> None:
    """Adasum-reduce ``buf`` across the group, in place; ``segments`` are its tensors."""
    if dtype not in FLOATING:
        raise TypeError(f"Adasum needs a floating-point dtype ({sorted(FLOATING)}), got {dtype}")
    check_buffer(buf, dtype)
    n, rank = comm.size, comm.rank
    if n & (n - 1):
        raise ValueError(f"Adasum needs a power-of-two number of ranks, got {n}")
    starts = _tensor_bounds(segments, buf.size)
    if n == 1 or buf.size == 0:
        return
    tmp = np.empty((buf.size + 1) // 2, buf.dtype)
    lo, hi = 0, buf.size
    ranges: list[tuple[int, int, int, int]] = []  # per level: kept and given-away halves
    dist = 1
    while dist < n:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if rank & dist == 0 else ((mid, hi), (lo, mid))
        ranges.append((*keep, *give))
        pair = comm.pair(rank ^ dist)
        mine, theirs = buf[keep[0] : keep[1]], tmp[: keep[1] - keep[0]]
        _swap(pair, buf[give[0] : give[1]], theirs)
        lo, hi = keep
        _combine(comm, dist, mine, theirs, starts, lo, hi, dtype)
        dist <<= 1
    for keep_lo, keep_hi, give_lo, give_hi in reversed(ranges):
        dist >>= 1
        _swap(comm.pair(rank ^ dist), buf[keep_lo:keep_hi], buf[give_lo:give_hi])


def _swap(pair: Pair, out: np.ndarray, into: np.ndarray) -> None:
    """Exchange with a peer whose halves mirror ours (sizes may differ by one element)."""
    if out.size and into.size:
        work = pair.isend(as_bytes(out))
        pair.recv_into(as_bytes(into))
        work.wait()
    elif out.size:
        pair.send(as_bytes(out))
    elif into.size:
        pair.recv_into(as_bytes(into))


def _combine(
    comm: Comm,
    dist: int,
    mine: np.ndarray,
    theirs: np.ndarray,
    starts: np.ndarray,
    lo: int,
    hi: int,
    dtype: str,
) -> None:
    """Combine this rank's ``mine`` with the partner's ``theirs`` over elements ``[lo, hi)``."""
    ntensors = len(starts) - 1
    first = int(np.searchsorted(starts, lo, side="right")) - 1 if hi > lo else 0
    last = int(np.searchsorted(starts, hi, side="left")) if hi > lo else 0
    cuts = np.maximum(starts[first:last], lo) - lo
    # The lower half-group's vector is ``a`` on every rank, so that partials add up.
    rank = comm.rank
    lower, upper = (mine, theirs) if rank & dist == 0 else (theirs, mine)
    a, b = _widen(lower, dtype), _widen(upper, dtype)
    sums = np.zeros((3, ntensors), np.float64)
    sums[:, first:last] = _partials(a, b, cuts)
    # Sum the partials over the 2*dist ranks that hold pieces of the same pair of vectors.
    incoming = np.empty_like(sums)
    step = 1
    while step <= dist:
        exchange(comm.pair(rank ^ step), sums.reshape(-1), incoming.reshape(-1))
        sums += incoming
        step <<= 1
    if hi == lo:
        return
    local = sums[:, first:last]
    lengths = np.diff(np.append(cuts, hi - lo))
    ca = np.repeat(_coefficient(local[0], local[1]), lengths).astype(a.dtype, copy=False)
    cb = np.repeat(_coefficient(local[0], local[2]), lengths).astype(a.dtype, copy=False)
    result = a * ca
    result += b * cb
    _store(mine, result, dtype)
