"""PowerSGD: gradients averaged through rank-r factors, with error feedback and warm start.

After Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization" (NeurIPS 2019), Algorithm 1 with one power iteration per step. Each
gradient with two or more dimensions is a matrix ``M`` (its first dimension by the rest); with
this rank's error memory ``E`` and the last step's factor ``Q`` (m x r):

1. ``M <- M + E``; ``P <- M Q``; allreduce-average ``P`` (all matrices' in one grouped op);
2. ``P <- orthonormal columns of P`` (a QR factorisation: the same on every rank, as the
   averaged ``P`` is);
3. ``Q <- M^T P``; allreduce-average ``Q``;
4. the averaged gradient is ``P Q^T``; ``E <- M - P Q^T`` is kept for the next step, and ``Q``
   starts the next step's power iteration (warm start).

``Q`` starts as a standard normal matrix drawn from a seed and the parameter's name, so every
rank starts alike. Each rank sends ``r (n + m)`` numbers for an ``n x m`` matrix instead of
``n m``. A matrix is compressed only if that saves at least ``min_compression_rate`` times
(vectors, and small or thin matrices, are averaged exactly). State: ``Q`` is shared (every rank
holds the same), ``E`` is local.

Called from the training thread; not thread-safe.
"""

from __future__ import annotations

import zlib

import numpy as np

from hora.collectives.reduce_ops import AVERAGE
from hora.core.process_sets import ProcessSet
from hora.frameworks import ops
from hora.frameworks.grad_compression import COMPRESSIBLE, GradientCompressor

# a pass over a matrix goes this many bytes of rows at a time, so that its next operation
# reads them from the caches: adding the error memory and multiplying by Q, one pass instead of
# two; making the rows of P Q^T and writing them into the error memory and the gradient, one
# instead of three. The MLP's 1024 x 3072 gradient, one thread: 4.2 -> 3.6 ms and 7.6 -> 4.5 ms.
CHUNK_BYTES = 768 << 10


def row_chunks(n: int, m: int, itemsize: int) -> list[slice]:
    """The rows of an ``n x m`` matrix, cut into slices of about :data:`CHUNK_BYTES`."""
    rows = max(1, CHUNK_BYTES // max(1, m * itemsize))
    return [slice(a, min(a + rows, n)) for a in range(0, n, rows)]


def orthonormalize(p: np.ndarray) -> np.ndarray:
    """``p``'s columns made orthonormal (the Q of a reduced QR factorisation), in place."""
    q, _ = np.linalg.qr(p)
    p[...] = q
    return p


class PowerSGD(GradientCompressor):
    """``hvd.Compression.powersgd(rank=4, start_iter=10)``: rank-``rank`` PowerSGD."""

    kind = "powersgd"

    def __init__(self, rank: int = 4, start_iter: int = 10, min_compression_rate: float = 2.0,
                 seed: int = 0) -> None:  # fmt: skip
        super().__init__(start_iter)
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD rank must be an int >= 1, got {rank!r}")
        if min_compression_rate < 1.0:
            raise ValueError(f"min_compression_rate must be >= 1, got {min_compression_rate}")
        self.rank, self.min_compression_rate, self.seed = rank, min_compression_rate, seed

    def matrix_shape(self, grad: np.ndarray) -> tuple[int, int]:
        return grad.shape[0], grad.size // grad.shape[0]

    def compresses(self, grad: np.ndarray) -> bool:
        if grad.ndim < 2 or grad.dtype not in COMPRESSIBLE or grad.size == 0:
            return False
        n, m = self.matrix_shape(grad)
        r = min(self.rank, n, m)
        return n * m >= self.min_compression_rate * r * (n + m)

    def _factor(self, name: str, m: int, r: int, dtype: np.dtype) -> np.ndarray:
        slot = self.shared.setdefault(name, {})
        q = slot.get("q")
        if q is None or q.shape != (m, r) or q.dtype != dtype:
            rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
            q = slot["q"] = rng.standard_normal((m, r)).astype(dtype)
        return q

    def _reduce_compressed(self, grads: dict[str, np.ndarray], ps: ProcessSet) -> None:
        mats, errs, qs, ps_, cuts = [], [], [], [], []
        for name, g in grads.items():
            n, m = self.matrix_shape(g)
            r = min(self.rank, n, m)
            mat = g.reshape(n, m)  # a view: the result is written into the gradient
            err = self._memory(name, "error", mat)
            q = self._factor(name, m, r, mat.dtype)
            p = np.empty((n, r), mat.dtype)
            chunks = row_chunks(n, m, mat.itemsize)
            for c in chunks:
                np.add(mat[c], err[c], out=mat[c])  # error feedback: what was not sent yet
                np.matmul(mat[c], q, out=p[c])
            mats.append(mat)
            errs.append(err)
            qs.append(q)
            ps_.append(p)
            cuts.append(chunks)
        ops.grouped_allreduce(ps_, outputs=ps_, op=AVERAGE, process_set=ps, name="hora.powersgd.p")
        for p, mat, q in zip(ps_, mats, qs):
            orthonormalize(p)
            # Q^T = P^T M reads M's rows in order: 1.7 ms where M^T P took 5.0 (1024 x 3072)
            q[...] = np.matmul(p.T, mat).T
        ops.grouped_allreduce(qs, outputs=qs, op=AVERAGE, process_set=ps, name="hora.powersgd.q")
        for p, mat, q, err, chunks in zip(ps_, mats, qs, errs, cuts):
            rows = np.empty((chunks[0].stop, mat.shape[1]), mat.dtype)
            for c in chunks:  # the rows of P Q^T: the average, and what it leaves out
                approx = np.matmul(p[c], q.T, out=rows[: c.stop - c.start])
                np.subtract(mat[c], approx, out=err[c])
                mat[c] = approx
        self.bytes_sent += sum(p.nbytes + q.nbytes for p, q in zip(ps_, qs))
