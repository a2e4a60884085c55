"""torch's vectorised float16/bfloat16 conversions, installed for hora's reductions at import.

hora reduces and scales 16-bit floats in float32 pieces (:mod:`hora.collectives.half_floats`).
NumPy converts float16 an element at a time (3 to 7 ns); torch's CPU kernels use F16C/AVX (about
0.2 ns), with the same bits: exact widening, narrowing to nearest even. Importing ``hora.torch``
installs these, so that ``Compression.fp16``/``.bf16`` cost less arithmetic than they save
bytes. Called from the engine thread (any thread may call them); thread-safe.
"""

from __future__ import annotations

import numpy as np
import torch

from hora.collectives.half_floats import NumpyCasts, use_casts

_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}


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


use_casts(TorchCasts())
