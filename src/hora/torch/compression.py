"""Gradient compression: ``Compression.none``, ``.fp16``, ``.bf16``, ``.powersgd()``, ``.topk()``.

A compressor turns a tensor into the tensor that is sent plus a context, and turns the received
tensor back with that context. ``fp16`` and ``bf16`` halve the bytes of 32- and 64-bit
floating-point tensors (the context is the original dtype); other tensors pass unchanged.
Pure functions of their inputs: thread-safe.

``powersgd(rank=4, start_iter=10)`` and ``topk(ratio=0.01)`` make stateful compressors
(:mod:`hora.frameworks.grad_compression`): passed as ``DistributedOptimizer(compression=...)``,
they average all gradients at ``synchronize()`` with collectives and error memory of their own.
One per optimizer.
"""

from __future__ import annotations

from typing import Any

import torch

from hora.frameworks.powersgd import PowerSGD
from hora.frameworks.topk import TopK


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    """Casts floating-point tensors wider than ``wire`` to ``wire`` and back."""

    wire: torch.dtype = torch.float16
    # decompress() is only a cast back to the tensor's dtype: DistributedOptimizer makes it as
    # it copies the result into the gradient, instead of into a new tensor first
    casts_back = True
    # bytes that stay on one host go uncompressed (hora.frameworks.ops.compression_for)
    on_one_host = False

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype.itemsize > cls.wire.itemsize:
            return tensor.to(cls.wire), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None or tensor.dtype == ctx else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Sends float32/float64 tensors as float16."""

    wire = torch.float16


class BF16Compressor(_CastCompressor):
    """Sends float32/float64 tensors as bfloat16: fp32's range, fewer mantissa bits than fp16."""

    wire = torch.bfloat16


class Compression:
    """The compression choices, as Horovod names them (plus ``bf16``, ``powersgd``, ``topk``)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    powersgd = PowerSGD  # Compression.powersgd(rank=4, start_iter=10): a new compressor
    topk = TopK  # Compression.topk(ratio=0.01)
