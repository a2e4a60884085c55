"""Buffers through the engine: the seam between the executor and the memory it works on.

The executor works on buffers through a :class:`BufferOps`: host (NumPy) buffers through
:class:`HostBufferOps`. A backend that can work on a device's memory itself (NCCL on a GPU)
says so with ``device_buffers = True`` and offers ``buffer_ops``, a :class:`BufferOps` for the
buffers of its device; the executor then takes such buffers as they are
(``executor.Executor``): it fuses them into a buffer on the device, scales them there,
gives joined ranks device zeros to contribute, allocates gathered outputs there and hands back
device buffers, never copying through host memory. The core never imports the framework: to
it a device buffer is opaque, reached only through ``BufferOps`` and the two methods NumPy
arrays and torch tensors share (``reshape`` and slicing).

A framework binding hands such a buffer to the op surface wrapped in :class:`DeviceArray`, with
its hora dtype name (``"float32"``, ``"bfloat16"``, ...): the op surface validates its shape and
dtype as it does an array's and submits the buffer itself (``frameworks.submit``).

Thread: ``DeviceArray`` is made in the caller's thread; ``BufferOps`` runs in the engine thread,
or in the caller's for a process set of one (``hora.core.solo``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from hora.collectives.reduce_ops import scale
from hora.dtypes import storage_dtype


class DeviceArray:
    """A device buffer handed to the op surface as it is, for a backend that takes device
    buffers: ``data`` (contiguous, shaped as the tensor) and its hora dtype name. ``ops``: the
    :class:`BufferOps` of its device, for an op that runs outside the backend (a process set
    of one: ``hora.core.solo``); None where the backend's ``buffer_ops`` serve it."""

    __slots__ = ("data", "dtype", "ops")

    def __init__(self, data: Any, dtype: str, ops: BufferOps | None = None) -> None:
        self.data, self.dtype, self.ops = data, dtype, ops


class BufferOps(Protocol):
    """What the executor does to one device's buffers; all work is ordered on the engine
    thread's current stream of that device (the backend orders its own stream after it and it
    after the collective). Buffers are 1-D unless said otherwise."""

    device: Any  # where the buffers live (a ``torch.device``)

    def owns(self, x: Any) -> bool:
        """Whether ``x`` is a buffer of this kind (else a host array)."""

    def empty(self, shape: tuple[int, ...], like: Any) -> Any:
        """A new buffer of ``shape`` with ``like``'s element type."""

    def zeros(self, count: int, dtype: str) -> Any:
        """``count`` zeros of hora dtype ``dtype`` (a joined rank's contribution)."""

    def fusion(self, count: int, dtype: str) -> Any:
        """A view of ``count`` elements of the persistent fusion buffer (grown on demand)."""

    def concat_into(self, parts: Sequence[Any], out: Any) -> None:
        """Copy ``parts`` one after another into ``out``."""

    def copy(self, dst: Any, src: Any) -> None:
        """``dst[...] = src``."""

    def clone(self, x: Any) -> Any:
        """A new buffer holding ``x``."""

    def scale(self, buf: Any, dtype: str, factor: float) -> None:
        """``buf *= factor`` on the device, with ``reduce_ops.scale``'s rules (integers truncated
        toward zero, bool stays 0/1, float16 and bfloat16 through float32)."""

    def ptr(self, x: Any) -> int:
        """The address of ``x``'s first element (to tell a buffer from its copy)."""

    def upload(self, host: Any, dtype: str) -> Any:
        """A host array of hora dtype ``dtype`` as a new buffer on the device (a fused response
        that mixes host arrays with device buffers)."""

    def download(self, x: Any, out: Any) -> Any:
        """``x`` as a host array: written into the host array ``out`` if given, else new."""


class FusionBuffer:
    """One persistent host byte buffer reused for every fused response (grown on demand)."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)

    def get(self, count: int, dtype: str) -> np.ndarray:
        st = storage_dtype(dtype)
        need = count * st.itemsize
        if self._buf.nbytes < need:
            self._buf = np.empty(need, dtype=np.uint8)
        return self._buf[:need].view(st)


class HostBufferOps:
    """:class:`BufferOps` over NumPy arrays in host memory (every backend's buffers)."""

    device = "cpu"
    scale = staticmethod(scale)  # reduce_ops.scale: the rules every BufferOps follows

    def __init__(self) -> None:
        self._fusion = FusionBuffer()

    def owns(self, x: Any) -> bool:
        return isinstance(x, np.ndarray)

    def empty(self, shape: tuple[int, ...], like: Any) -> np.ndarray:
        return np.empty(shape, dtype=like.dtype)

    def zeros(self, count: int, dtype: str) -> np.ndarray:
        return np.zeros(count, dtype=storage_dtype(dtype))

    def fusion(self, count: int, dtype: str) -> np.ndarray:
        return self._fusion.get(count, dtype)

    def concat_into(self, parts: Sequence[Any], out: Any) -> None:
        np.concatenate(parts, out=out)

    def copy(self, dst: Any, src: Any) -> None:
        dst[...] = src

    def clone(self, x: Any) -> np.ndarray:
        return x.copy()

    def ptr(self, x: Any) -> int:
        return int(x.ctypes.data)

    def upload(self, host: Any, dtype: str) -> Any:
        return host

    def download(self, x: Any, out: Any) -> Any:
        if out is None:
            return x
        out[...] = x
        return out
