"""Gradient compression for TensorFlow: ``Compression.none``, ``.fp16``, ``.powersgd()``, ...

A compressor turns a tensor into the tensor that is sent plus a context (the original dtype),
and the received tensor back. ``fp16`` sends float32/float64 tensors as float16 (``bf16`` as
bfloat16); other tensors pass unchanged. Pure functions: thread-safe, usable in tf.function.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora.frameworks.powersgd import PowerSGD
from hora.frameworks.topk import TopK


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor


class _CastCompressor(Compressor):
    wire: tf.DType = tf.float16
    # bytes that stay on one host go uncompressed (hora.frameworks.ops.compression_for)
    on_one_host = False

    @classmethod
    def compress(cls, tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        dtype = tensor.dtype
        if dtype.is_floating and dtype.size > cls.wire.size:
            return tf.cast(tensor, cls.wire), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor if ctx is None or tensor.dtype == ctx else tf.cast(tensor, ctx)


class FP16Compressor(_CastCompressor):
    """Sends float32/float64 tensors as float16."""

    wire = tf.float16


class BF16Compressor(_CastCompressor):
    """Sends float32/float64 tensors as bfloat16."""

    wire = tf.bfloat16


class Compression:
    """The compression choices, as Horovod names them (plus ``bf16``)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    # stateful, all gradients at once (hora.frameworks.grad_compression): the gradient tape
    # and the Keras optimizer take them; one per tape or optimizer
    powersgd = PowerSGD  # Compression.powersgd(rank=4, start_iter=10)
    topk = TopK  # Compression.topk(ratio=0.01)
