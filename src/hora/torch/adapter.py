"""Torch tensors as the NumPy buffers the op surface works on, and results back as tensors.

A contiguous CPU tensor is viewed, not copied: the engine reads and (for in-place ops) writes the
tensor's own memory. bfloat16 has no NumPy dtype, so its storage is viewed as ``uint16`` and
tagged ``dtype="bfloat16"``. Non-contiguous CPU tensors are staged through a contiguous copy; in
place ops copy the result back into the user's tensor.

CUDA tensors travel through pinned host memory without stopping the device
(``hora.torch.device``): staging records an event on the caller's current stream, makes hora's
copy stream wait on it, copies asynchronously into a pinned buffer from a small pool and records
a "copied" event; :meth:`Staged.ready` waits on that event only. The way back copies the result
into pinned memory and then to the device on hora's copy stream, and makes the caller's stream
(the one current when the tensor was staged) wait on a "done" event: nothing waits on the host.
A pinned buffer goes back to its pool when its NumPy view is dropped, and is reused only after
the last copy out of it has completed. With ``defer`` the engine calls ``ready()`` just before it
first reads the buffer, in its own thread; else :func:`stage` calls it itself.

When the job's backend takes device buffers (NCCL; ``hora.core.buffers``), a tensor on that
backend's device is not staged at all (:func:`stage_direct`): the engine gets the tensor itself,
wrapped as a ``DeviceArray``, and an event recorded on the caller's stream that the engine
thread's stream waits on before it touches the tensor (``ready()``: no host wait). Results come
back as device tensors; the engine thread's stream, which the backend made wait for the
collective, records an event that the caller's stream waits on (:func:`to_tensor`,
:func:`write_back`).

In a process set of one (``stage(alone=True)``; ``hora.core.solo``) the op runs in the
caller's thread with nobody to talk to: a tensor on a device is handed over as it is, with
torch's buffer operations for its device (:func:`local_ops`), so it never goes through host
memory, and its work goes on the caller's current stream (no event is needed).

``stage`` runs in the caller's thread; ``to_tensor``/``write_back`` run wherever the result is
finalized (the engine thread). All functions are pure apart from the in-place write-back and the
pinned-buffer pools, and thread-safe.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hora.core import runtime as _rt
from hora.core.buffers import BufferOps, DeviceArray
from hora.errors import HoraInternalError, UnsupportedTypeError
from hora.torch import device as _device
from hora.torch.device import DeviceRuntime, PinnedPool

_WIRE_NAMES: dict[torch.dtype, str] = {
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bool: "bool",
}
if hasattr(torch, "uint16"):
    _WIRE_NAMES[torch.uint16] = "uint16"

# one pool of pinned buffers per device runtime
_pools: weakref.WeakKeyDictionary[Any, PinnedPool] = weakref.WeakKeyDictionary()
# id(device tensor) -> (the tensor, the stream current when it was staged), for to_tensor's
# way back; keyed by id because tensors compare element-wise
_user_streams: dict[int, tuple[weakref.ref[torch.Tensor], Any]] = {}
_user_streams_lock = threading.Lock()


def pool(rt: DeviceRuntime) -> PinnedPool:
    """The pinned-buffer pool of ``rt`` (made on first use)."""
    p = _pools.get(rt)
    if p is None:
        p = _pools.setdefault(rt, PinnedPool(rt))
    return p


class _Lease:
    """A pinned buffer lent to one staged tensor and the event after which it is free again."""

    def __init__(self, buf: torch.Tensor, event: Any) -> None:
        self.buf, self.event = buf, event


@dataclass(slots=True)  # not frozen: a frozen dataclass takes 1 us to make, this 0.2
class Staged:
    """A tensor prepared for the op surface (not changed once made).

    ``array`` is what the engine reads (and writes, for in-place ops); it aliases ``tensor``
    unless ``copied``. ``dtype`` is the hora dtype override to pass along (``"bfloat16"``) or None.
    For a device tensor, ``runtime``, ``stream`` (the caller's stream), ``event`` (the copy into
    ``array`` is complete) and ``lease`` (the pinned buffer under ``array``) are set. ``direct``:
    ``array`` is a ``DeviceArray`` of the tensor's own memory (a backend that takes device
    buffers), and ``event`` marks the caller's work on it so far.
    """

    tensor: torch.Tensor
    array: np.ndarray | DeviceArray
    dtype: str | None
    copied: bool
    runtime: DeviceRuntime | None = None
    stream: Any = None
    event: Any = None
    lease: _Lease | None = None
    direct: bool = False

    def ready(self) -> None:
        """Wait until ``array`` holds the tensor's data (at once for CPU tensors). Called by
        whichever thread reads ``array`` first; cheap to call again. For a direct tensor, the
        calling thread's stream waits on the caller's event instead (the host goes on)."""
        rt = self.runtime
        if rt is None or self.event is None:
            return
        if self.direct:
            rt.stream_wait_event(rt.current_stream(self.tensor.device), self.event)
        else:
            rt.event_synchronize(self.event)


def check_tensor(tensor: object, what: str = "tensor") -> torch.Tensor:
    """``tensor`` if it is a dense torch tensor of a supported dtype; TypeError otherwise
    (UnsupportedTypeError, also a ValueError as in Horovod, for a dtype that cannot travel)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(
            f"{what} has layout {tensor.layout}; only dense tensors are supported here "
            "(use sparse_allreduce_async for sparse tensors)"
        )
    if tensor.dtype not in _WIRE_NAMES:
        raise UnsupportedTypeError(f"Tensor type {tensor.dtype} is not supported.")
    return tensor


def _numpy(host: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """A host tensor's memory as NumPy, and the dtype override (bfloat16 as uint16 storage)."""
    if host.dtype == torch.bfloat16:
        return host.view(torch.int16).numpy().view(np.uint16), "bfloat16"
    return host.numpy(), None


def stage(
    tensor: torch.Tensor,
    what: str = "tensor",
    runtime: DeviceRuntime | None = None,
    defer: bool = False,
    alone: bool = False,
) -> Staged:
    """Expose ``tensor``'s data as a NumPy array: a view when possible, else a host copy.

    A CUDA tensor goes through pinned memory with ``runtime`` (default: the CUDA runtime); with
    ``defer`` the copy may still be in flight, and the reader must call ``ready()`` first.
    ``alone``: the op runs in a process set of one (``hora.core.solo``), in this thread: a
    tensor on a device stays there, handed over as it is with its device's buffer operations.
    """
    check_tensor(tensor, what)
    if alone and not tensor.is_cpu:
        return stage_direct(tensor, None, local_ops(tensor.device))
    direct = direct_device()
    if direct is not None and tensor.device == direct:
        return stage_direct(tensor, runtime or _device.runtime())
    if tensor.is_cuda:
        rt = runtime or _device.runtime()
        if rt is not None:
            return stage_device(tensor, rt, defer)
    # a tensor autograd does not track is its own host view (detach() makes a new one: 1 us)
    host = tensor.detach() if tensor.requires_grad else tensor
    copied = False
    if not host.is_cpu:  # a device without a stream runtime here: a blocking copy
        host = host.to("cpu")
        copied = True
    if not host.is_contiguous():
        host = host.contiguous()
        copied = True
    if host.is_conj() or host.is_neg():  # a lazy view: its values are made apart
        host = host.resolve_conj().resolve_neg()
        copied = True
    array, dtype = _numpy(host)
    return Staged(tensor, array, dtype, copied)


def host_view(tensor: torch.Tensor) -> np.ndarray | None:
    """``tensor``'s memory as the NumPy view :func:`stage` would make of it, where that is a
    view of a CPU tensor's own memory as it is (no copy, no dtype given apart); else None."""
    if (not tensor.is_cpu or tensor.layout is not torch.strided  # is_cpu: a fifth of .device
            or not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg()):  # fmt: skip
        return None
    array, dtype = _numpy(tensor.detach() if tensor.requires_grad else tensor)
    return array if dtype is None else None


def direct_device() -> torch.device | None:
    """The device whose tensors the job's backend takes as they are (NCCL's GPU), else None."""
    if not _rt.is_initialized():
        return None
    try:
        ops = _rt.runtime().engine.executor.device_ops
    except ValueError:  # shut down meanwhile: the op itself says so
        return None
    return None if ops is None else ops.device  # type: ignore[no-any-return]


def stage_direct(tensor: torch.Tensor, rt: DeviceRuntime | None,
                 ops: BufferOps | None = None) -> Staged:  # fmt: skip
    """A tensor on the job's device handed to the engine as it is: no copy unless it is not
    contiguous (the copy runs on the caller's stream). With ``rt``, an event on the caller's
    stream marks its work on the tensor so far; the engine's stream waits on it (``ready()``,
    called by the engine through ``engine_waits``). A tensor without streams in ``rt`` (a CPU
    tensor with the CUDA runtime) needs no event. ``ops``: its device's buffer operations, for
    an op that runs in this thread (a set of one). Caller's thread."""
    own = tensor.detach()
    src = own.contiguous().resolve_conj().resolve_neg()
    copied = src.data_ptr() != own.data_ptr()
    user = event = None
    if rt is not None and not rt.serves(tensor.device):
        rt = None
    if rt is not None:
        user = rt.current_stream(tensor.device)
        event = rt.record_event(user)
        _remember_stream(tensor, user)
    array = DeviceArray(src, _WIRE_NAMES[src.dtype], ops)
    return Staged(tensor, array, None, copied, rt, user, event, None, True)


_local_ops: dict[torch.device, BufferOps] = {}


def local_ops(device: torch.device) -> BufferOps:
    """The buffer operations on ``device``'s tensors for an op of a set of one: torch's own,
    on the calling thread's current stream, scaling with the NCCL backend's rules (those of
    ``reduce_ops.scale``). One per device, made on first use."""
    ops = _local_ops.get(device)
    if ops is None:
        from hora.backends.nccl import DeviceBufferOps, scale_tensor

        def scale(buf: torch.Tensor, factor: float, dtype: str) -> None:
            scale_tensor(buf, dtype, factor)

        ops = _local_ops.setdefault(device, DeviceBufferOps(device, scale))
    return ops


def _hand_back(rt: DeviceRuntime | None, user: Any, result: torch.Tensor, new: bool) -> None:
    """Order the caller's stream ``user`` after the engine's work on a direct ``result``
    (engine thread): this thread's stream, which the backend made wait for the collective,
    records an event the caller's stream waits on; a ``new`` tensor is marked in use there."""
    if rt is None or user is None:
        return
    here = rt.current_stream(result.device)
    if user != here:
        rt.stream_wait_event(user, rt.record_event(here))
        if new:
            rt.keep_alive(result, user)


def stage_device(tensor: torch.Tensor, rt: DeviceRuntime, defer: bool = False) -> Staged:
    """Stage a device tensor through a pinned buffer on hora's copy stream (any tensor when
    ``rt`` is a fake). Caller's thread."""
    dev = tensor.device
    src = tensor.detach()
    if not src.is_contiguous():
        src = src.contiguous()  # on the caller's stream, like the rest of its work
    src = src.resolve_conj().resolve_neg().reshape(-1)
    user, copy = rt.current_stream(dev), rt.copy_stream(dev)
    rt.stream_wait_event(copy, rt.record_event(user))  # the copy starts after the caller's work
    buf = pool(rt).take(src.numel(), src.dtype)
    rt.keep_alive(src, copy)
    rt.copy_async(buf, src, copy)
    copied = rt.record_event(copy)
    lease = _Lease(buf, copied)
    array, dtype = _numpy(buf.view(tensor.shape))
    weakref.finalize(array, _give_back, pool(rt), lease)
    _remember_stream(tensor, user)
    staged = Staged(tensor, array, dtype, True, rt, user, copied, lease)
    if not defer:
        staged.ready()
    return staged


def _remember_stream(tensor: torch.Tensor, stream: Any) -> None:
    with _user_streams_lock:
        if len(_user_streams) > 4096:  # forget the tensors that are gone
            for k in [k for k, (ref, _) in _user_streams.items() if ref() is None]:
                del _user_streams[k]
        _user_streams[id(tensor)] = (weakref.ref(tensor), stream)


def _stream_of(tensor: torch.Tensor) -> Any:
    """The stream that was current when ``tensor`` was last staged, or None."""
    with _user_streams_lock:
        ref, stream = _user_streams.get(id(tensor), (None, None))
    return stream if ref is not None and ref() is tensor else None


def _give_back(p: PinnedPool, lease: _Lease) -> None:
    p.release(lease.buf, lease.event)


def _host_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """``array`` as a CPU tensor of ``dtype``, sharing its memory where the dtypes allow."""
    if not array.flags.writeable:
        array = array.copy()
    if dtype == torch.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    out = torch.from_numpy(array)
    return out if out.dtype == dtype else out.to(dtype)


def _to_pinned(p: PinnedPool, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A pinned 1-D copy of ``array`` as ``dtype`` (a host memcpy), from the pool."""
    host = _host_tensor(np.ascontiguousarray(array), dtype).reshape(-1)
    buf = p.take(host.numel(), dtype)
    buf.copy_(host)
    return buf


def _upload(rt: DeviceRuntime, dst: torch.Tensor, src: torch.Tensor, user: Any) -> Any:
    """Copy pinned ``src`` into ``dst`` on hora's stream, after the caller's stream's work so
    far, and make the caller's stream wait for it. The "done" event."""
    copy = rt.copy_stream(dst.device)
    rt.stream_wait_event(copy, rt.record_event(user))
    rt.keep_alive(dst, copy)
    rt.copy_async(dst, src, copy)
    done = rt.record_event(copy)
    rt.stream_wait_event(user, done)
    return done


def to_tensor(array: np.ndarray | torch.Tensor, like: torch.Tensor,
              runtime: DeviceRuntime | None = None) -> torch.Tensor:  # fmt: skip
    """Wrap a result array as a tensor with ``like``'s dtype and device (no copy on CPU); a
    device result (a direct tensor's) is already one, and the caller's stream waits for it."""
    if isinstance(array, torch.Tensor):
        _hand_back(runtime or _device.runtime(), _stream_of(like), array, True)
        return array
    if like.device.type == "cuda":
        rt = runtime or _device.runtime()
        if rt is not None:
            return to_device(array, like, rt)
    out = _host_tensor(array, like.dtype)
    return out if like.device.type == "cpu" else out.to(like.device)


def to_device(array: np.ndarray, like: torch.Tensor, rt: DeviceRuntime) -> torch.Tensor:
    """``array`` as a new tensor on ``like``'s device, copied asynchronously; the stream that
    was current when ``like`` was staged (else this thread's) waits for the copy. Engine thread.
    """
    p = pool(rt)
    buf = _to_pinned(p, array, like.dtype)
    user = _stream_of(like) or rt.current_stream(like.device)
    out = rt.device_empty(buf.numel(), like.dtype, like.device, user)
    p.release(buf, _upload(rt, out, buf, user))
    return out.view(array.shape)


def write_back(staged: Staged, result: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Finish an in-place op: the user's tensor, holding ``result``."""
    if isinstance(result, torch.Tensor):  # a direct tensor's: the engine wrote the tensor
        target = staged.tensor.data
        if result.data_ptr() != target.data_ptr():  # it was not contiguous
            target.copy_(result.view(target.shape))
        _hand_back(staged.runtime, staged.stream, target, False)
        return staged.tensor
    if staged.runtime is not None:
        return _write_back_device(staged, result)
    if staged.copied or not np.may_share_memory(result, staged.array):
        target = staged.tensor.data
        target.copy_(_host_tensor(result, target.dtype).view(target.shape))
    return staged.tensor


def _write_back_device(staged: Staged, result: np.ndarray) -> torch.Tensor:
    """Copy ``result`` into the device tensor on hora's stream (engine thread)."""
    rt, lease, target = staged.runtime, staged.lease, staged.tensor.data
    if rt is None or lease is None:  # set together by stage_device
        raise HoraInternalError("a device tensor was staged without its runtime and buffer")
    if np.may_share_memory(result, staged.array):  # the engine wrote the pinned buffer itself
        src = lease.buf
        lease.event = _upload(rt, target, src.view(target.shape), staged.stream)
    else:
        p = pool(rt)
        src = _to_pinned(p, result, target.dtype)
        p.release(src, _upload(rt, target, src.view(target.shape), staged.stream))
    return staged.tensor
