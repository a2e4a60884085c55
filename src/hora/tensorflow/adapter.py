"""TensorFlow tensors in and out of the op surface: one bridge for eager mode and tf.function.

In eager mode a collective calls the op surface directly on the tensors' NumPy values, so its
errors keep their Python types (``ValueError``, ``HorovodInternalError``). Inside
``tf.function`` it is one ``tf.numpy_function`` node, marked stateful, that calls the op surface
when the graph runs (an error there surfaces as TensorFlow's ``UnknownError`` carrying hora's
message).
Inputs reach the op surface as NumPy views of the tensors' CPU buffers (no copy; hora only reads
them); in eager mode results become tensors through DLPack (no copy either), in a graph
``numpy_function`` copies them into TensorFlow's buffers. Being stateful,
the nodes of one graph run in program order (TensorFlow's automatic control dependencies), so
every rank submits its collectives in the same order and unnamed ops get the same names.

``bridge`` runs in the caller's thread (eager) or in a TensorFlow executor thread (graph); the
wrapped function blocks that thread until the collective is done. Thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hora.errors import HoraInternalError

SUPPORTED = frozenset(
    {
        tf.uint8,
        tf.int8,
        tf.uint16,
        tf.int16,
        tf.int32,
        tf.int64,
        tf.float16,
        tf.bfloat16,
        tf.float32,
        tf.float64,
        tf.bool,
    }
)


def as_tensor(value: Any, what: str = "tensor") -> tf.Tensor:
    """``value`` (a tensor, variable, array or number) as a dense tensor of a wire dtype."""
    if isinstance(value, tf.IndexedSlices):
        raise TypeError(f"{what} is a tf.IndexedSlices; this op needs a dense tensor")
    t = tf.convert_to_tensor(value)
    if t.dtype not in SUPPORTED:
        raise TypeError(f"Tensor type {t.dtype.name} is not supported.")
    return t


def bridge(
    fn: Callable[..., Any],
    inputs: Sequence[tf.Tensor],
    tout: Sequence[tf.DType],
    shapes: Sequence[Any],
    what: str,
) -> list[tf.Tensor]:
    """Run ``fn(*arrays) -> arrays`` as one TensorFlow op; outputs get ``shapes`` (None: unknown).

    ``fn`` returns one array per entry of ``tout``, each of that dtype.
    """

    def call(*arrays: np.ndarray) -> list[np.ndarray]:
        try:
            outs = fn(*arrays)
        except HoraInternalError:
            raise
        except RuntimeError as e:  # a failed collective: Horovod's error type
            raise HoraInternalError(str(e)) from e
        return [np.asarray(o, dtype=d.as_numpy_dtype) for o, d in zip(outs, tout)]

    if tf.executing_eagerly():  # np.asarray views the tensor's buffer (.numpy() copies)
        results = call(*[np.asarray(t) for t in inputs])
        return [to_tensor(o, d) for o, d in zip(results, tout)]

    outs = tf.numpy_function(call, list(inputs), list(tout), stateful=True, name=f"Hora{what}")
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    for o, s in zip(outs, shapes):
        if s is not None:
            o.set_shape(s)
    return outs


ALIGN = 64  # bytes: the alignment TensorFlow's CPU kernels check


def aligned_empty(like: np.ndarray) -> np.ndarray:
    """An uninitialised array shaped and typed like ``like`` whose buffer is ALIGN-aligned, for
    results that ``to_tensor`` can then hand to TensorFlow without a copy."""
    nbytes = max(like.nbytes, 1)
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + like.nbytes].view(like.dtype).reshape(like.shape)


def to_tensor(array: np.ndarray, dtype: tf.DType) -> tf.Tensor:
    """``array`` as an eager tensor, sharing its memory through DLPack where it can (an
    aligned result array that nothing else writes), else copied."""
    if (
        array.size
        and array.flags.c_contiguous
        and array.flags.writeable
        and array.ctypes.data % ALIGN == 0  # TensorFlow's kernels need aligned buffers
    ):
        try:
            return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
        except Exception:  # a dtype or layout DLPack does not carry: copy
            pass
    return tf.convert_to_tensor(array, dtype=dtype)


def rows_unknown(shape: tf.TensorShape) -> tf.TensorShape:
    """``shape`` with an unknown first dimension (the result of a gather or an exchange)."""
    if shape.rank is None:
        return shape
    if shape.rank == 0:
        return tf.TensorShape([None])
    return tf.TensorShape([None]).concatenate(shape[1:])
