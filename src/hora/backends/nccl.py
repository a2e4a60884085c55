"""The NCCL backend: the engine's collectives through torch.distributed's NCCL process groups.

Chosen with ``HOROVOD_GPU_OPERATIONS=nccl`` (or a per-op ``HOROVOD_GPU_ALLREDUCE=NCCL``, ...)
when no CPU backend is named. Every collective takes either kind of buffer:

- a torch CUDA tensor on this rank's GPU (``cuda:<local rank>``), used where it lies: no host
  round trip;
- a host (NumPy) buffer (a CPU tensor's, or a tensor staged through host memory): copied to
  the GPU, reduced there and copied back.

The backend takes device buffers (``device_buffers``): the engine's executor fuses, scales and
allocates this GPU's tensors through ``buffer_ops``
(:class:`DeviceBufferOps`, hora.core.buffers' seam), and ``hora.torch`` hands the engine CUDA
tensors of this GPU as they are (no staging through host memory).

The work runs on a dedicated CUDA stream of this backend. Before a collective that stream waits
on an event recorded on the calling thread's current stream (so tensors produced there are
complete); NCCL's own stream is ordered after hora's by the process group, and ``wait()`` on its
work orders hora's stream after NCCL's without blocking the host. Afterwards a "done" event is
recorded on hora's stream and the caller's current stream waits on it; device tensors are marked
as used on hora's stream for PyTorch's caching allocator. Only the host path waits on the host,
for its own copy back. int16/uint16 reductions (NCCL has no such type) and Adasum run hora's
own algorithms on host memory (device tensors are copied for them). Process groups per process
set through hora's store, dtype and op mapping are the Gloo backend's; see ``gloo.py``.

Importing this module needs torch but no GPU; building the backend needs one.
Threads: as the Gloo backend (engine thread only after ``init``). Not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cached_property
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hora.backends import two_level
from hora.backends.base import SetComm
from hora.backends.gloo import _BOOL_OPS, _OPS, GlooBackend, split
from hora.backends.registry import BackendContext
from hora.collectives import hierarchical, reduce_ops, registry
from hora.dtypes import DTYPES, FLOATING

NEEDS_GPU = (
    "the NCCL backend needs an NVIDIA GPU and a CUDA build of PyTorch with NCCL ({}); "
    "unset HOROVOD_GPU_OPERATIONS and HOROVOD_GPU_<OP> to use the CPU backends"
)
# what NCCL reduces (bool as uint8 with MAX/MIN); int16 and uint16 it cannot
_NCCL_REDUCES = frozenset(
    {"uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool"}
)

Buffer = Any  # np.ndarray or a torch CUDA tensor: 1-D, contiguous, in storage dtype


def numel(buf: Buffer) -> int:
    """Elements in a host array or a tensor."""
    return int(buf.numel()) if isinstance(buf, torch.Tensor) else int(buf.size)


def itemsize(buf: Buffer) -> int:
    """Bytes per element of a host array or a tensor."""
    return int(buf.element_size()) if isinstance(buf, torch.Tensor) else int(buf.itemsize)


def as_type(t: torch.Tensor, dtype: str | None) -> torch.Tensor:
    """``t`` (1-D, contiguous) viewed as what NCCL works on: ``dtype``'s torch type, bool as
    uint8, bfloat16 storage as bfloat16; raw bytes for ``dtype=None``."""
    if dtype is None or dtype == "bool":
        return t.view(torch.uint8)
    if dtype == "bfloat16" and t.dtype != torch.bfloat16:
        return t.view(torch.bfloat16)
    return t


# hora's dtype names as torch types (uint16 where this torch has it)
TORCH_TYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in DTYPES if hasattr(torch, n)}


def scale_tensor(t: torch.Tensor, dtype: str | None, factor: float) -> None:
    """``t *= factor`` where ``t`` lies, with ``reduce_ops.scale``'s rules: floating types
    multiply in their own precision (float16 and bfloat16 through float32, as torch does),
    integers by an exact integer factor, else through float64 truncated toward zero; bool
    stays 0/1 (nonzero is 1)."""
    if factor == 1.0 or t.numel() == 0:
        return
    kind = dtype or _NAMES.get(t.dtype, "")
    if kind in FLOATING:
        t.mul_(factor)
    elif kind != "bool" and t.dtype != torch.bool and _fits_integer(factor, t.dtype):
        t.mul_(int(factor))
    else:
        t.copy_(t.double().mul_(factor).trunc_())


_NAMES = {v: k for k, v in TORCH_TYPES.items()}


def _fits_integer(factor: float, dtype: torch.dtype) -> bool:
    info = torch.iinfo(dtype)
    return float(factor).is_integer() and info.min <= factor <= info.max


class DeviceBufferOps:
    """``hora.core.buffers.BufferOps`` over torch tensors on one device (the NCCL backend's
    GPU; the CPU in tests with a fake of its streams).

    Runs in the engine thread; every copy goes on that thread's current stream of the device,
    which the backend orders its own stream after (and itself after the collective). The fusion
    buffer is one byte tensor on the device, grown on demand; the backend marks it in use on its
    stream, so growing it never frees memory a collective still reads. Scaling is the
    backend's ``scale``.
    """

    def __init__(self, device: torch.device, scale: Callable[[Any, float, str], None]) -> None:
        self.device = device
        self._scale = scale
        self._fusion = torch.empty(0, dtype=torch.uint8, device=device)

    def owns(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    def empty(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    def zeros(self, count: int, dtype: str) -> torch.Tensor:
        return torch.zeros(count, dtype=TORCH_TYPES[dtype], device=self.device)

    def fusion(self, count: int, dtype: str) -> torch.Tensor:
        t = TORCH_TYPES[dtype]
        need = count * t.itemsize
        if self._fusion.numel() < need:
            self._fusion = torch.empty(need, dtype=torch.uint8, device=self.device)
        return self._fusion[:need].view(t)

    def concat_into(self, parts: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        torch.cat(list(parts), out=out)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def clone(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def scale(self, buf: torch.Tensor, dtype: str, factor: float) -> None:
        self._scale(buf, factor, dtype)

    def ptr(self, x: torch.Tensor) -> int:
        return int(x.data_ptr())

    def upload(self, host: np.ndarray, dtype: str) -> torch.Tensor:
        arr = np.array(host) if not host.flags.writeable else np.ascontiguousarray(host)
        if dtype == "bfloat16":
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16).to(self.device)
        return torch.from_numpy(arr).to(self.device)

    def download(self, x: torch.Tensor, out: np.ndarray | None) -> np.ndarray:
        """A blocking copy to host memory (waits for the current stream only)."""
        host = x.detach().cpu()
        arr = (host.view(torch.int16).numpy().view(np.uint16) if host.dtype == torch.bfloat16
               else host.numpy())  # fmt: skip
        if out is None:
            return arr if x.device.type != "cpu" else arr.copy()
        out[...] = arr
        return out


class NcclBackend(GlooBackend):
    name = "NCCL"
    # the engine hands it device tensors as they are (core.buffers; core.executor)
    device_buffers = True
    # HOROVOD_HIERARCHICAL_ALLREDUCE: each set's two-level groups, made at its first allreduce
    _hierarchical = False
    _levels: dict[int, two_level.TwoLevel | None] | None = None

    def __init__(self, ctx: BackendContext) -> None:
        if not torch.cuda.is_available():
            raise ValueError(NEEDS_GPU.format("torch.cuda.is_available() is False"))
        if not dist.is_available() or not dist.is_nccl_available():
            raise ValueError(NEEDS_GPU.format("torch.distributed has no NCCL"))
        super().__init__(ctx)
        self._device = torch.device("cuda", ctx.identity.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(self._device)
        self._stream = torch.cuda.Stream(device=self._device)
        self.last_done: Any = None  # the "done" event of the latest collective
        self._hierarchical = self.wants_two_level(ctx.settings)

    @cached_property
    def buffer_ops(self) -> DeviceBufferOps:
        """What the engine's executor does to this GPU's tensors (made on first use)."""
        return DeviceBufferOps(self._device, self.scale)

    @staticmethod
    def wants_two_level(settings: Any) -> bool:
        """Whether the settings ask for the hierarchical allreduce (torus allreduce is accepted
        and runs as hierarchical)."""
        return bool(settings.hierarchical_allreduce or settings.torus_allreduce)

    def _two_level(self, comm: SetComm) -> two_level.TwoLevel | None:
        """The set's groups for a hierarchical allreduce (``HOROVOD_HIERARCHICAL_ALLREDUCE``),
        made at its first allreduce; None where the flat allreduce serves it."""
        if self._levels is None:
            self._levels = {}
        ps = comm.process_set_id
        if ps not in self._levels:
            layout = hierarchical.layout_of(comm)
            self._levels[ps] = None if layout is None else two_level.build(
                layout.hosts, comm.rank, self._make_group,
                lambda key: self._store(ps, f"hier/{key}"),
            )
        return self._levels[ps]

    def close(self) -> None:
        self._levels = None  # the groups before the stores they use (super's)
        super().close()

    def remove_process_set(self, ps_id: int, ranks: list[int]) -> None:
        if self._levels is not None:  # the groups before the stores they use (super's)
            self._levels.pop(ps_id, None)
        super().remove_process_set(ps_id, ranks)

    def _make_group(self, store: Any, rank: int, size: int) -> Any:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self._timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)

    # -- streams and buffers ---------------------------------------------------------------
    @contextmanager
    def _on_stream(self, *device_bufs: Buffer) -> Iterator[None]:
        """Run the body on hora's stream, after the caller's stream's work so far; then make
        the caller's stream wait for it (no host wait)."""
        caller = torch.cuda.current_stream(self._device)
        start = torch.cuda.Event()
        start.record(caller)
        self._stream.wait_event(start)
        with torch.cuda.stream(self._stream):
            yield
        done = torch.cuda.Event()
        done.record(self._stream)
        caller.wait_event(done)
        for b in device_bufs:
            if isinstance(b, torch.Tensor) and b.is_cuda:  # the allocator must know
                b.record_stream(self._stream)
        self.last_done = done

    def _device_view(self, buf: Buffer, dtype: str | None) -> torch.Tensor:
        """``buf`` on this GPU typed for NCCL: a view of a CUDA tensor, else a copy of host
        memory (on the current stream, hora's)."""
        if isinstance(buf, torch.Tensor):
            if buf.device != self._device:
                raise ValueError(
                    f"the NCCL backend of this rank works on {self._device}, got a tensor on "
                    f"{buf.device}: call torch.cuda.set_device(hvd.local_rank()) before "
                    "creating tensors"
                )
            return as_type(buf.reshape(-1), dtype)
        arr = buf if buf.flags.writeable else buf.copy()  # torch wants writable memory
        return as_type(torch.from_numpy(arr.reshape(-1)).to(self._device), dtype)

    def _result(self, t: torch.Tensor, buf: Buffer) -> None:
        """Make ``buf`` hold the collective's result ``t`` (nothing to do when ``t`` is
        ``buf`` itself; a copy to host memory waits for hora's stream only)."""
        if isinstance(buf, torch.Tensor):
            dst = buf.reshape(-1).view(torch.uint8)
            src = t.reshape(-1).view(torch.uint8)
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
            return
        torch.from_numpy(buf.reshape(-1).view(np.uint8)).copy_(t.reshape(-1).view(torch.uint8))

    def _host_fallback(self, buf: Buffer) -> np.ndarray:
        """A host array for hora's own algorithms: ``buf`` itself, or a copy of a tensor
        (bfloat16 as its uint16 storage)."""
        if isinstance(buf, torch.Tensor):
            if buf.dtype == torch.bfloat16:
                return buf.detach().view(torch.int16).cpu().numpy().view(np.uint16)
            return buf.detach().cpu().numpy()
        return buf  # type: ignore[no-any-return]

    def _host_back(self, host: np.ndarray, buf: Buffer) -> None:
        """Copy what hora's algorithm left in ``host`` back into a device tensor ``buf``."""
        if isinstance(buf, torch.Tensor):
            buf.reshape(-1).view(torch.uint8).copy_(
                torch.from_numpy(np.ascontiguousarray(host).reshape(-1).view(np.uint8))
            )

    def scale(self, buf: Buffer, factor: float, dtype: str | None = None) -> None:
        """Multiply ``buf`` (of hora dtype ``dtype``, else its own type's) by ``factor`` where
        it lies, with ``reduce_ops.scale``'s rules: on the GPU for a device tensor, on hora's
        stream (a prescale or Average's postscale), else in host memory."""
        if factor == 1.0:
            return
        if isinstance(buf, torch.Tensor):
            with self._on_stream(buf):
                scale_tensor(buf, dtype, factor)
        elif dtype is not None:
            reduce_ops.scale(buf, dtype, factor)
        else:
            np.multiply(buf, factor, out=buf, casting="unsafe")

    # -- collectives -----------------------------------------------------------------------
    def allreduce(self, comm: SetComm, buf: Buffer, dtype: str, op: int) -> None:
        if dtype not in _NCCL_REDUCES:  # int16, uint16
            host = self._host_fallback(buf)
            registry.allreduce(comm, host, dtype, op)
            self._host_back(host, buf)
            return
        if numel(buf) == 0:
            return
        opts = dist.AllreduceOptions()
        opts.reduceOp = (_BOOL_OPS if dtype == "bool" else _OPS)[op]
        levels = self._two_level(comm) if self._hierarchical else None
        with self._on_stream(buf):
            t = self._device_view(buf, dtype)
            if levels is not None:  # inside each host, then across hosts
                levels.allreduce(t, opts.reduceOp)
            else:
                self._group(comm).allreduce([t], opts).wait()
            self._result(t, buf)

    def reducescatterv(self, comm: SetComm, send: Buffer, recv: Buffer,
                       counts: list[int], dtype: str, op: int) -> None:  # fmt: skip
        if dtype not in _NCCL_REDUCES:
            host_recv = self._host_fallback(recv)
            registry.reducescatterv_ring(comm, self._host_fallback(send), host_recv, counts,
                                         dtype, op)  # fmt: skip
            self._host_back(host_recv, recv)
            return
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = (_BOOL_OPS if dtype == "bool" else _OPS)[op]
        with self._on_stream(send, recv):
            src = self._device_view(send, dtype)
            pieces = split(src, counts)
            out = self._device_view(recv, dtype)
            self._group(comm).reduce_scatter([out], [pieces], opts).wait()
            self._result(out, recv)

    def allgatherv(self, comm: SetComm, send: Buffer, recv: Buffer,
                   counts: list[int]) -> None:  # fmt: skip
        width = max(counts)
        if width == 0:
            return
        with self._on_stream(send, recv):
            src = self._device_view(send, None)
            out = self._device_view(recv, None)
            k = itemsize(send)
            if all(c == width for c in counts):
                self._group(comm)._allgather_base(out, src).wait()
            else:  # NCCL gathers equal pieces: pad each to the widest, then close the gaps
                padded = torch.zeros(width * k, dtype=torch.uint8, device=self._device)
                padded[: src.numel()] = src
                every = torch.empty(width * k * len(counts), dtype=torch.uint8,
                                    device=self._device)  # fmt: skip
                self._group(comm)._allgather_base(every, padded).wait()
                off = 0
                for r, c in enumerate(counts):
                    out[off : off + c * k] = every[r * width * k : (r * width + c) * k]
                    off += c * k
            self._result(out, recv)

    def broadcast(self, comm: SetComm, buf: Buffer, root: int) -> None:
        if numel(buf) == 0:
            return
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        with self._on_stream(buf):
            t = self._device_view(buf, None)
            self._group(comm).broadcast([t], opts).wait()
            self._result(t, buf)

    def alltoallv(self, comm: SetComm, send: Buffer, send_counts: list[int],
                  recv: Buffer, recv_counts: list[int]) -> None:  # fmt: skip
        k = itemsize(send)
        with self._on_stream(send, recv):
            out = self._device_view(recv, None)
            self._group(comm).alltoall_base(
                out, self._device_view(send, None), [c * k for c in recv_counts],
                [c * k for c in send_counts], dist.AllToAllOptions(),
            ).wait()  # fmt: skip
            self._result(out, recv)

    def adasum(self, comm: SetComm, buf: Buffer, dtype: str,
               segments: list[tuple[int, int]]) -> None:  # fmt: skip
        host = self._host_fallback(buf)
        registry.adasum(comm, host, dtype, segments)  # hora's algorithm over hora's transport
        self._host_back(host, buf)

    def barrier(self, comm: SetComm) -> None:
        with self._on_stream():
            self._group(comm).barrier().wait()
