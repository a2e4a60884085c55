"""torch's vectorised float16/bfloat16 conversions, installed for hora's reductions at import.

hora reduces and scales 16-bit floats in float32 pieces (:mod:`hora.collectives.half_floats`).
NumPy converts float16 an element at a time (3 to 7 ns); torch's CPU kernels use F16C/AVX (about
0.2 ns), with the same bits: exact widening, narrowing to nearest even. Importing ``hora.torch``
installs these, so that ``Compression.fp16``/``.bf16`` cost less arithmetic than they save
bytes. A piece's sum, minimum, maximum, product or scaling is one of torch's 16-bit kernels,
which widen, operate in float32 and round to nearest even in registers: the bits of the
float32 pieces, in one pass instead of four. Pieces stay within torch's grain size
(:data:`hora.collectives.half_floats.PIECE`), so its kernels run on the calling thread and
start no thread pool beside the training's. Called from the engine thread (any thread may call
them); thread-safe.
"""

from __future__ import annotations

import numpy as np
import torch

from hora.collectives.half_floats import NumpyCasts, use_casts

_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# NumPy's element-wise ops and torch's kernels of the same arithmetic
_OPS = {np.add: torch.add, np.minimum: torch.minimum, np.maximum: torch.maximum,
        np.multiply: torch.mul}  # fmt: skip


class TorchCasts:
    """:class:`hora.collectives.half_floats.Casts` through ``Tensor.copy_`` on NumPy memory."""

    vectorised = True

    def __init__(self) -> None:
        self._numpy = NumpyCasts()

    def widen(self, src: np.ndarray, dst: np.ndarray, dtype: str) -> None:
        if not src.flags.writeable:  # torch.from_numpy warns on read-only memory
            self._numpy.widen(src, dst, dtype)
            return
        torch.from_numpy(dst).copy_(torch.from_numpy(src).view(_TORCH[dtype]))

    def narrow(self, src: np.ndarray, dst: np.ndarray, dtype: str) -> None:
        if not src.flags.writeable:
            self._numpy.narrow(src, dst, dtype)
            return
        torch.from_numpy(dst).view(_TORCH[dtype]).copy_(torch.from_numpy(src))

    def combine(self, ufunc: np.ufunc, acc: np.ndarray, incoming: np.ndarray, out: np.ndarray,
                dtype: str) -> bool:  # fmt: skip
        op = _OPS.get(ufunc)
        if op is None or not (acc.flags.writeable and incoming.flags.writeable):
            return False  # read-only memory: through the float32 pieces (widen's fallback)
        t = _TORCH[dtype]
        op(torch.from_numpy(acc).view(t), torch.from_numpy(incoming).view(t),
           out=torch.from_numpy(out).view(t))  # fmt: skip
        return True

    def multiply(self, buf: np.ndarray, factor: np.float32, dtype: str) -> bool:
        if not buf.flags.writeable:
            return False
        torch.from_numpy(buf).view(_TORCH[dtype]).mul_(float(factor))
        return True


use_casts(TorchCasts())
