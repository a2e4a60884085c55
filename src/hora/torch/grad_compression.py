"""torch's gradients through a stateful compressor (PowerSGD, top-k) at ``synchronize()``.

:class:`hora.frameworks.grad_compression.GradientCompressor` works on NumPy arrays. A CPU
gradient of float32/float64 is handed over as a view (the compressor writes the average into
it); any other (a GPU tensor, a 16-bit float) is staged through a float32 copy and copied back.
Runs in the training thread.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from hora.core.process_sets import ProcessSet
from hora.frameworks.grad_compression import GradientCompressor

_VIEWED = (torch.float32, torch.float64)


def compressed_step(
    compressor: GradientCompressor,
    params: list[torch.Tensor],
    names: dict[torch.Tensor, str],
    prepare: Callable[[torch.Tensor], torch.Tensor],
    finish: Callable[[torch.Tensor, torch.Tensor], None],
    process_set: ProcessSet,
) -> None:
    """Average every parameter's gradient (``prepare(p)``) through ``compressor`` over
    ``process_set``, and hand each result to ``finish(p, result)``."""
    grads: dict[str, np.ndarray] = {}
    staged: dict[torch.Tensor, torch.Tensor] = {}
    for p in params:
        g = prepare(p).detach()
        if g.device.type == "cpu" and g.dtype in _VIEWED and g.is_contiguous():
            grads[names[p]] = g.numpy()
        else:
            staged[p] = g.to("cpu", torch.float32).contiguous()
            grads[names[p]] = staged[p].numpy()
    compressor.reduce(grads, process_set)
    for p in params:
        s = staged.get(p)
        finish(p, p.grad if s is None else s.to(p.grad.device, p.grad.dtype))
