"""Top-k sparsification with error feedback: each rank sends only its largest entries.

For each compressed gradient ``g`` of ``n`` elements, with this rank's error memory ``e``:
``a <- g + e``; the ``k = max(1, round(ratio n))`` entries of largest magnitude are sent (their
indices and values, through one allgather each for all gradients together); ``e <- a`` with
those entries zeroed, carried to the next step. Every rank then sums what all ranks sent, in
rank order (the same bits everywhere), and divides by the set's size.

A rank sends ``k`` (int32 or int64 index, value) pairs instead of ``n`` values, and receives
``(size - 1) k`` pairs. Gradients with fewer than ``min_elements`` elements, and non-float
ones, are averaged exactly. Error memory is local state.

Called from the training thread; not thread-safe.
"""

from __future__ import annotations

import numpy as np

from hora.core.process_sets import ProcessSet
from hora.frameworks import ops
from hora.frameworks.grad_compression import COMPRESSIBLE, GradientCompressor

# top_indices first keeps the entries at or above a threshold read off a sample of about this
# many (strided) magnitudes, where the whole is at least _SAMPLED_FROM times larger, and then
# selects among those: a comparison pass instead of a selection over every entry (3.2 million
# float32 entries, k = 1%: 22.8 ms for the selection over all of them)
_SAMPLE = 1 << 14
_SAMPLED_FROM = 16


def top_indices(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` entries of ``values`` (1-D) of largest magnitude, ascending (ties
    at the k-th magnitude broken arbitrarily; NaNs count as the largest)."""
    n = values.size
    if k >= n:
        return np.arange(n)
    mags = np.abs(values)
    if n >= _SAMPLED_FROM * _SAMPLE and not np.isnan(mags.max()):
        sample = mags[:: n // _SAMPLE].copy()
        # a threshold about twice as many entries pass as k, from the sample's order statistic
        above = min(sample.size, 2 * k * sample.size // n + 8)
        at = sample.size - above
        threshold = np.partition(sample, at)[at]
        kept = np.flatnonzero(mags >= threshold)
        if kept.size >= k:  # the k largest are all among them
            pick = np.argpartition(mags[kept], kept.size - k)[kept.size - k :]
            return np.sort(kept[pick])
    return np.sort(np.argpartition(mags, n - k)[n - k :])


class TopK(GradientCompressor):
    """``hvd.Compression.topk(ratio=0.01)``: top-k sparsification with error feedback."""

    kind = "topk"

    def __init__(self, ratio: float = 0.01, start_iter: int = 0, min_elements: int = 1024) -> None:
        super().__init__(start_iter)
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio!r}")
        if min_elements < 1:
            raise ValueError(f"min_elements must be >= 1, got {min_elements}")
        self.ratio, self.min_elements = float(ratio), int(min_elements)

    def compresses(self, grad: np.ndarray) -> bool:
        return grad.dtype in COMPRESSIBLE and grad.size >= self.min_elements

    def k_of(self, n: int) -> int:
        return max(1, min(n, round(self.ratio * n)))

    def _reduce_compressed(self, grads: dict[str, np.ndarray], ps: ProcessSet) -> None:
        flats = [g.reshape(-1) for g in grads.values()]
        total = sum(f.size for f in flats)
        index_dtype = np.int32 if total < 2**31 else np.int64
        wide = np.result_type(*flats)
        idx_parts, val_parts, at = [], [], 0
        for name, flat in zip(grads, flats):
            err = self._memory(name, "error", flat)
            flat += err  # error feedback
            top = top_indices(flat, self.k_of(flat.size))
            idx_parts.append((top + at).astype(index_dtype))
            val_parts.append(flat[top].astype(wide))
            np.copyto(err, flat)
            err[top] = 0  # what was sent leaves the memory; the rest is carried
            at += flat.size
        idx, vals = np.concatenate(idx_parts), np.concatenate(val_parts)
        all_idx, all_vals = ops.grouped_allgather([idx, vals], process_set=ps,
                                                  name="hora.topk.sent")  # fmt: skip
        # the entries some rank sent, each summed in float64 in rank order (the same bits
        # everywhere), then averaged; every other entry of the average is zero
        sent, slot = np.unique(all_idx, return_inverse=True)
        summed = np.bincount(slot, weights=all_vals, minlength=sent.size)
        summed = np.divide(summed, ps.size(), dtype=np.float64)
        at = 0
        for flat in flats:
            lo, hi = np.searchsorted(sent, (at, at + flat.size))
            flat.fill(0)
            flat[sent[lo:hi] - at] = summed[lo:hi]
            at += flat.size
        self.bytes_sent += idx.nbytes + vals.nbytes
