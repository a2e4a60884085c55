"""The NCCL backend: the engine's collectives through torch.distributed's NCCL process groups.

Chosen with ``HOROVOD_GPU_OPERATIONS=nccl`` (or ``HOROVOD_GPU_ALLREDUCE=NCCL``) when no CPU
backend is named. The engine hands every backend host (NumPy) buffers: ``hora.torch`` stages
CUDA tensors through host memory before they reach it. This backend therefore copies each
buffer to this rank's GPU (``cuda:<local rank>``), runs the NCCL collective there, and copies
the result back, on one CUDA stream per process. Everything else (process groups per process
set through hora's store, dtype and op mapping, int16/uint16 and Adasum through hora's own
algorithms) is the Gloo backend's; see ``gloo.py``.

Threads: as the Gloo backend (engine thread only after ``init``). Not thread-safe.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hora.backends.gloo import GlooBackend
from hora.backends.registry import BackendContext

NEEDS_GPU = (
    "the NCCL backend needs an NVIDIA GPU and a CUDA build of PyTorch with NCCL ({}); "
    "unset HOROVOD_GPU_OPERATIONS/HOROVOD_GPU_ALLREDUCE to use the CPU backends"
)


class NcclBackend(GlooBackend):
    name = "NCCL"

    def __init__(self, ctx: BackendContext) -> None:
        if not torch.cuda.is_available():
            raise ValueError(NEEDS_GPU.format("torch.cuda.is_available() is False"))
        if not dist.is_available() or not dist.is_nccl_available():
            raise ValueError(NEEDS_GPU.format("torch.distributed has no NCCL"))
        super().__init__(ctx)
        self._device = torch.device("cuda", ctx.identity.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(self._device)

    def _make_group(self, store: Any, rank: int, size: int) -> Any:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self._timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)

    def _tensor(self, buf: np.ndarray, dtype: str) -> torch.Tensor:
        return super()._tensor(buf, dtype).to(self._device)

    def _bytes(self, buf: np.ndarray) -> torch.Tensor:
        return super()._bytes(buf).to(self._device)

    def _done(self, t: torch.Tensor, buf: np.ndarray) -> None:
        host = t.cpu()
        if host.dtype == torch.bfloat16:
            host = host.view(torch.int16)
        np.copyto(buf.view(host.numpy().dtype), host.numpy())
