"""Executes negotiated responses on this rank: fusion buffer, scaling, the backend call.

Every member of a set runs the same responses in the same order. A rank that has joined runs
allreduces it never submitted with zeros in their place. Timeline activities are recorded here.
Engine thread only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hora.backends.base import Backend, SetComm
from hora.collectives.reduce_ops import AVERAGE, SUM, reducer, scale
from hora.collectives.reducescatter_ring import reducescatter_counts
from hora.core.buffers import BufferOps
from hora.core.messages import OpType, Response, TensorSpec
from hora.dtypes import storage_dtype
from hora.errors import HoraInternalError


@dataclass
class TensorEntry:
    """One submitted tensor: the request, its arrays and the handle to complete."""

    spec_request: Any  # messages.Request
    # input, storage dtype; for a DeviceExecutor, a device buffer of its backend's instead
    array: np.ndarray | None
    output: np.ndarray | None  # caller-provided output (may be ``array`` for in-place)
    complete: Any  # callable(result) -> None
    fail: Any  # callable(exc) -> None
    # callable() -> None that waits until ``array`` holds the data (a device's copy into it may
    # still be in flight); called once, just before the engine first reads ``array``
    ready: Any = None


def _arrived(entry: TensorEntry | None) -> None:
    """Wait for ``entry``'s data if it may still be arriving (see ``TensorEntry.ready``)."""
    if entry is not None and entry.ready is not None:
        wait, entry.ready = entry.ready, None
        wait()


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


# A two-member set in direct mode moves an allreduce up to this size inside the round's headers
# (hora.core.fastpath), with hora's own backend: one exchange instead of two.
EXCHANGE_MAX_BYTES = 64 << 10

# In a fused allreduce, tensors this large are reduced in place rather than copied through the
# fusion buffer (two copies of a large tensor cost more than one more backend call).
IN_PLACE_MIN_BYTES = 1 << 20


class FusionBuffer:
    """One persistent byte buffer reused for every fused response (grown on demand)."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)

    def get(self, count: int, dtype: str) -> np.ndarray:
        st = storage_dtype(dtype)
        need = count * st.itemsize
        if self._buf.nbytes < need:
            self._buf = np.empty(need, dtype=np.uint8)
        return self._buf[:need].view(st)


class Executor:
    """Runs responses on host (NumPy) buffers; see :class:`DeviceExecutor` for a backend that
    takes device buffers (the constructor returns one for such a backend)."""

    # the ops of the backend's device buffers (DeviceExecutor); None: host buffers only
    device_ops: BufferOps | None = None

    def __new__(cls, backend: Backend, timeline: Any = None) -> Executor:
        if cls is Executor and getattr(backend, "device_buffers", False):
            cls = DeviceExecutor
        return super().__new__(cls)

    def __init__(self, backend: Backend, timeline: Any = None) -> None:
        self.backend = backend
        self.timeline = timeline
        self.fusion = FusionBuffer()

    # -- helpers ----------------------------------------------------------------------------
    def _act(self, names: list[str], activity: str | None) -> None:
        tl = self.timeline
        if tl is None:
            return
        for n in names:
            if activity is None:
                tl.activity_end(n)
            else:
                tl.activity_start(n, activity)

    @staticmethod
    def _input(spec: TensorSpec, entry: TensorEntry | None) -> np.ndarray:
        req = spec.request
        _arrived(entry)
        if entry is None or entry.array is None:  # joined rank: contributes zeros
            return np.zeros(_numel(req.shape), dtype=storage_dtype(req.dtype))
        return entry.array.reshape(-1)

    def _target(self, spec: TensorSpec, entry: TensorEntry | None) -> np.ndarray:
        """Where ``spec`` is reduced: its output (or a new array), holding its input."""
        src = self._input(spec, entry)
        if entry is None or entry.output is None:
            return src.copy()
        out = entry.output
        if out is entry.array:  # in place, the common case (no address to compare)
            return src
        flat = out.reshape(-1)
        if flat.ctypes.data != src.ctypes.data:  # not in place
            np.copyto(flat, src)
        return flat

    # -- ops --------------------------------------------------------------------------------
    def allreduce(
        self, comm: SetComm, resp: Response, entries: list[TensorEntry | None]
    ) -> list[np.ndarray]:
        req = resp.specs[0].request
        dtype, op = req.dtype, req.reduce_op
        post = req.postscale / comm.size if op == AVERAGE else req.postscale
        red = SUM if op == AVERAGE else op
        names = resp.names
        if len(resp.specs) == 1:
            spec = resp.specs[0]
            flat = self._target(spec, entries[0])
            self._reduce(comm, resp, flat, dtype, red, req.prescale, post, [(0, flat.size)], names)
            return [flat.reshape(spec.request.shape)]
        if resp.op == OpType.ALLREDUCE:
            total = sum(s.request.nbytes for s in resp.specs)
            parts = getattr(self.backend, "reduces_parts", None)
            if (total >= IN_PLACE_MIN_BYTES and parts is not None
                    and parts(comm, total, len(resp.specs))):
                flats = [self._target(s, e) for s, e in zip(resp.specs, entries)]
                if req.prescale != 1.0:
                    for f in flats:
                        scale(f, dtype, req.prescale)
                self._act(names, f"{self.backend.name}_{resp.op.name}")
                self.backend.allreduce_parts(comm, flats, dtype, red)  # type: ignore[attr-defined]
                self._act(names, None)
                if post != 1.0:
                    for f in flats:
                        scale(f, dtype, post)
                return [f.reshape(s.request.shape) for f, s in zip(flats, resp.specs)]
            big = [i for i, s in enumerate(resp.specs) if s.request.nbytes >= IN_PLACE_MIN_BYTES]
            if big:
                return self._allreduce_split(comm, resp, entries, big)
        counts = [_numel(s.request.shape) for s in resp.specs]
        buf = self.fusion.get(sum(counts), dtype)
        self._act(names, "MEMCPY_IN_FUSION_BUFFER")
        np.concatenate([self._input(s, e) for s, e in zip(resp.specs, entries)], out=buf)
        segments, off = [], 0
        for n in counts:
            segments.append((off, n))
            off += n
        self._act(names, None)
        self._reduce(comm, resp, buf, dtype, red, req.prescale, post, segments, names)
        self._act(names, "MEMCPY_OUT_FUSION_BUFFER")
        results = []
        for spec, entry, (o, n) in zip(resp.specs, entries, segments):
            if entry is not None and entry.output is not None:
                dst = entry.output
                dst.reshape(-1)[...] = buf[o : o + n]
            else:
                dst = buf[o : o + n].reshape(spec.request.shape).copy()
            results.append(dst)
        self._act(names, None)
        return results

    def _allreduce_split(
        self,
        comm: SetComm,
        resp: Response,
        entries: list[TensorEntry | None],
        big: list[int],
    ) -> list[np.ndarray]:
        """A fused response with large tensors: each large one reduced where it lies.

        Copying a large tensor into the fusion buffer and back costs more than the backend call
        it saves, so only the small tensors of the response travel fused; each large one is
        reduced in its output (or a copy of its input) with its own backend call.
        """
        results: list[np.ndarray | None] = [None] * len(resp.specs)
        small = sorted(set(range(len(resp.specs))) - set(big))
        if small:
            part = Response(resp.op, [resp.specs[i] for i in small])
            for i, r in zip(small, self.allreduce(comm, part, [entries[i] for i in small])):
                results[i] = r
        for i in big:
            part = Response(resp.op, [resp.specs[i]])
            results[i] = self.allreduce(comm, part, [entries[i]])[0]
        return results  # type: ignore[return-value]

    def _reduce(
        self,
        comm: SetComm,
        resp: Response,
        buf: np.ndarray,
        dtype: str,
        op: int,
        pre: float,
        post: float,
        segments: list[tuple[int, int]],
        names: list[str],
    ) -> None:
        scale(buf, dtype, pre)
        self._act(names, f"{self.backend.name}_{resp.op.name}")
        if resp.op == OpType.ADASUM:
            self.backend.adasum(comm, buf, dtype, segments)
        else:
            self.backend.allreduce(comm, buf, dtype, op)
        self._act(names, None)
        scale(buf, dtype, post)

    def exchange_input(self, spec: TensorSpec, entry: TensorEntry) -> np.ndarray | None:
        """What this rank sends when a two-member round carries a small allreduce itself: a
        prescaled copy of the input (the input stays as it is, should the round not run it);
        None when the op does not qualify."""
        req = spec.request
        if (req.op != OpType.ALLREDUCE or req.nbytes > EXCHANGE_MAX_BYTES
                or entry.array is None or not getattr(self.backend, "native", False)):
            return None
        _arrived(entry)
        buf = entry.array.reshape(-1).copy()
        scale(buf, req.dtype, req.prescale)
        return buf

    def finish_exchange(
        self, spec: TensorSpec, entry: TensorEntry, mine: np.ndarray, theirs: bytes
    ) -> np.ndarray:
        """The result of a two-member allreduce from both prescaled inputs: the same bits on
        both ranks (the element-wise ops commute), written to the output if there is one."""
        req = spec.request
        op = req.reduce_op
        incoming = np.frombuffer(theirs, dtype=mine.dtype)
        if incoming.size != mine.size:
            raise HoraInternalError(
                f"{req.name}: the other rank sent {len(theirs)} bytes for {mine.nbytes}"
            )
        self._act([req.name], "EXCHANGE_ALLREDUCE")
        reducer(SUM if op == AVERAGE else op, req.dtype)(mine, incoming)
        scale(mine, req.dtype, req.postscale / 2 if op == AVERAGE else req.postscale)
        self._act([req.name], None)
        if entry.output is not None:
            flat = entry.output.reshape(-1)
            flat[...] = mine
            return flat.reshape(req.shape)
        return mine.reshape(req.shape)

    def allgather(self, comm: SetComm, spec: TensorSpec, entry: TensorEntry) -> np.ndarray:
        req = spec.request
        _arrived(entry)
        assert spec.first_dims is not None and entry.array is not None
        row = _numel(req.shape[1:])
        counts = [d * row for d in spec.first_dims]
        out = np.empty((sum(spec.first_dims),) + req.shape[1:], dtype=entry.array.dtype)
        self._act([req.name], f"{self.backend.name}_ALLGATHER")
        self.backend.allgatherv(comm, entry.array.reshape(-1), out.reshape(-1), counts)
        self._act([req.name], None)
        return out

    def broadcast(self, comm: SetComm, spec: TensorSpec, entry: TensorEntry) -> np.ndarray:
        req = spec.request
        _arrived(entry)
        assert entry.array is not None
        root = comm.ranks.index(req.root)
        out = entry.output if entry.output is not None else np.empty_like(entry.array)
        if comm.rank == root and out.ctypes.data != entry.array.ctypes.data:
            np.copyto(out, entry.array)
        self._act([req.name], f"{self.backend.name}_BCAST")
        self.backend.broadcast(comm, out.reshape(-1), root)
        self._act([req.name], None)
        return out

    def alltoall(
        self, comm: SetComm, spec: TensorSpec, entry: TensorEntry
    ) -> tuple[np.ndarray, np.ndarray]:
        req = spec.request
        _arrived(entry)
        m = spec.split_matrix
        assert m is not None and entry.array is not None
        row = _numel(req.shape[1:])
        me = comm.rank
        recv_rows = [m[j][me] for j in range(comm.size)]
        out = np.empty((sum(recv_rows),) + req.shape[1:], dtype=entry.array.dtype)
        self._act([req.name], f"{self.backend.name}_ALLTOALL")
        self.backend.alltoallv(
            comm,
            entry.array.reshape(-1),
            [c * row for c in m[me]],
            out.reshape(-1),
            [c * row for c in recv_rows],
        )
        self._act([req.name], None)
        return out, np.asarray(recv_rows, dtype=np.int32)

    def reducescatter(self, comm: SetComm, spec: TensorSpec, entry: TensorEntry) -> np.ndarray:
        req = spec.request
        _arrived(entry)
        assert entry.array is not None
        rows = reducescatter_counts(req.shape[0], comm.size)
        row = _numel(req.shape[1:])
        send = entry.array.reshape(-1).copy()
        out = np.empty((rows[comm.rank],) + req.shape[1:], dtype=entry.array.dtype)
        op = req.reduce_op
        post = req.postscale / comm.size if op == AVERAGE else req.postscale
        scale(send, req.dtype, req.prescale)
        self._act([req.name], f"{self.backend.name}_REDUCESCATTER")
        self.backend.reducescatterv(
            comm,
            send,
            out.reshape(-1),
            [r * row for r in rows],
            req.dtype,
            SUM if op == AVERAGE else op,
        )
        self._act([req.name], None)
        scale(out.reshape(-1), req.dtype, post)
        return out


class DeviceExecutor(Executor):
    """The executor of a backend that takes device buffers (``device_buffers``; NCCL).

    A response whose tensors are all host arrays runs as :class:`Executor` runs it. Otherwise it
    runs on the device through the backend's ``buffer_ops`` (:class:`~hora.core.buffers.BufferOps`):
    a fused allreduce is packed into that device's fusion buffer and unpacked with device copies,
    prescale, postscale and Average's division happen there, a joined rank contributes device
    zeros, gathered outputs are allocated there and results are handed back as device buffers.
    Host arrays fused with device buffers are uploaded, and their results downloaded. Which
    tensors of a fused response are reduced alone (the large ones) is decided as
    :class:`Executor` decides, so ranks holding host arrays and ranks holding device buffers make
    the same backend calls (such a backend has no ``reduces_parts``).
    """

    def __init__(self, backend: Backend, timeline: Any = None) -> None:
        super().__init__(backend, timeline)
        self.ops: BufferOps = backend.buffer_ops  # type: ignore[attr-defined]
        self.device_ops = self.ops

    def _on_device(self, entries: list[TensorEntry | None]) -> bool:
        """Whether a response runs on the device: it holds a device buffer, or nothing at all
        (a joined rank's zeros)."""
        held = [e.array for e in entries if e is not None and e.array is not None]
        return not held or any(self.ops.owns(a) for a in held)

    def _dev_input(self, spec: TensorSpec, entry: TensorEntry | None) -> Any:
        """``spec``'s input as a 1-D device buffer (zeros for a joined rank, a host array
        uploaded)."""
        req = spec.request
        _arrived(entry)
        if entry is None or entry.array is None:
            return self.ops.zeros(_numel(req.shape), req.dtype)
        flat = entry.array.reshape(-1)
        return flat if self.ops.owns(flat) else self.ops.upload(flat, req.dtype)

    def _dev_target(self, spec: TensorSpec, entry: TensorEntry | None) -> Any:
        """Where ``spec`` is reduced on the device: its output (or a copy of its input)."""
        src = self._dev_input(spec, entry)
        if entry is None or entry.array is None:
            return src  # zeros made for this op
        out = entry.output
        if out is None:
            return self.ops.clone(src)
        if out is entry.array:
            return src
        flat = out.reshape(-1)
        if self.ops.ptr(flat) != self.ops.ptr(src):
            self.ops.copy(flat, src)
        return flat

    def allreduce(
        self, comm: SetComm, resp: Response, entries: list[TensorEntry | None]
    ) -> list[Any]:
        if not self._on_device(entries):
            return super().allreduce(comm, resp, entries)
        ops = self.ops
        req = resp.specs[0].request
        dtype, op = req.dtype, req.reduce_op
        post = req.postscale / comm.size if op == AVERAGE else req.postscale
        red = SUM if op == AVERAGE else op
        names = resp.names
        if len(resp.specs) == 1:
            spec = resp.specs[0]
            flat = self._dev_target(spec, entries[0])
            segments = [(0, _numel(spec.request.shape))]
            self._dev_reduce(comm, resp, flat, dtype, red, req.prescale, post, segments, names)
            return [flat.reshape(spec.request.shape)]
        if resp.op == OpType.ALLREDUCE:
            big = [i for i, s in enumerate(resp.specs) if s.request.nbytes >= IN_PLACE_MIN_BYTES]
            if big:
                return self._allreduce_split(comm, resp, entries, big)
        counts = [_numel(s.request.shape) for s in resp.specs]
        buf = ops.fusion(sum(counts), dtype)
        self._act(names, "MEMCPY_IN_FUSION_BUFFER")
        ops.concat_into([self._dev_input(s, e) for s, e in zip(resp.specs, entries)], buf)
        segments, off = [], 0
        for n in counts:
            segments.append((off, n))
            off += n
        self._act(names, None)
        self._dev_reduce(comm, resp, buf, dtype, red, req.prescale, post, segments, names)
        self._act(names, "MEMCPY_OUT_FUSION_BUFFER")
        results: list[Any] = []
        for spec, entry, (o, n) in zip(resp.specs, entries, segments):
            piece = buf[o : o + n]
            if entry is None or entry.array is None:
                results.append(None)  # a joined rank's: nobody takes it
            elif not ops.owns(entry.array):  # a host array fused with device buffers
                out = entry.output
                got = ops.download(piece, None if out is None else out.reshape(-1))
                results.append(got.reshape(spec.request.shape) if out is None else out)
            elif entry.output is not None:
                ops.copy(entry.output.reshape(-1), piece)
                results.append(entry.output)
            else:
                results.append(ops.clone(piece).reshape(spec.request.shape))
        self._act(names, None)
        return results

    def _dev_reduce(
        self,
        comm: SetComm,
        resp: Response,
        buf: Any,
        dtype: str,
        op: int,
        pre: float,
        post: float,
        segments: list[tuple[int, int]],
        names: list[str],
    ) -> None:
        self.ops.scale(buf, dtype, pre)
        self._act(names, f"{self.backend.name}_{resp.op.name}")
        if resp.op == OpType.ADASUM:
            self.backend.adasum(comm, buf, dtype, segments)
        else:
            self.backend.allreduce(comm, buf, dtype, op)
        self._act(names, None)
        self.ops.scale(buf, dtype, post)

    def allgather(self, comm: SetComm, spec: TensorSpec, entry: TensorEntry) -> Any:
        if not self.ops.owns(entry.array):
            return super().allgather(comm, spec, entry)
        req = spec.request
        _arrived(entry)
        assert spec.first_dims is not None
        src: Any = entry.array
        row = _numel(req.shape[1:])
        counts = [d * row for d in spec.first_dims]
        out = self.ops.empty((sum(spec.first_dims),) + req.shape[1:], src)
        self._act([req.name], f"{self.backend.name}_ALLGATHER")
        self.backend.allgatherv(comm, src.reshape(-1), out.reshape(-1), counts)
        self._act([req.name], None)
        return out

    def broadcast(self, comm: SetComm, spec: TensorSpec, entry: TensorEntry) -> Any:
        if not self.ops.owns(entry.array):
            return super().broadcast(comm, spec, entry)
        req, ops = spec.request, self.ops
        _arrived(entry)
        root = comm.ranks.index(req.root)
        src: Any = entry.array
        out = entry.output if entry.output is not None else ops.empty(req.shape, src)
        if comm.rank == root and ops.ptr(out) != ops.ptr(src):
            ops.copy(out.reshape(-1), src.reshape(-1))
        self._act([req.name], f"{self.backend.name}_BCAST")
        self.backend.broadcast(comm, out.reshape(-1), root)
        self._act([req.name], None)
        return out

    def alltoall(self, comm: SetComm, spec: TensorSpec, entry: TensorEntry) -> Any:
        if not self.ops.owns(entry.array):
            return super().alltoall(comm, spec, entry)
        req = spec.request
        _arrived(entry)
        m = spec.split_matrix
        assert m is not None and entry.array is not None
        row = _numel(req.shape[1:])
        me = comm.rank
        recv_rows = [m[j][me] for j in range(comm.size)]
        out = self.ops.empty((sum(recv_rows),) + req.shape[1:], entry.array)
        self._act([req.name], f"{self.backend.name}_ALLTOALL")
        self.backend.alltoallv(comm, entry.array.reshape(-1), [c * row for c in m[me]],
                               out.reshape(-1), [c * row for c in recv_rows])  # fmt: skip
        self._act([req.name], None)
        return out, np.asarray(recv_rows, dtype=np.int32)

    def reducescatter(self, comm: SetComm, spec: TensorSpec, entry: TensorEntry) -> Any:
        if not self.ops.owns(entry.array):
            return super().reducescatter(comm, spec, entry)
        req, ops = spec.request, self.ops
        _arrived(entry)
        assert entry.array is not None
        rows = reducescatter_counts(req.shape[0], comm.size)
        row = _numel(req.shape[1:])
        send = entry.array.reshape(-1)
        if req.prescale != 1.0:  # the caller's tensor stays as it is
            send = ops.clone(send)
            ops.scale(send, req.dtype, req.prescale)
        out = ops.empty((rows[comm.rank],) + req.shape[1:], entry.array)
        op = req.reduce_op
        post = req.postscale / comm.size if op == AVERAGE else req.postscale
        self._act([req.name], f"{self.backend.name}_REDUCESCATTER")
        self.backend.reducescatterv(comm, send, out.reshape(-1), [r * row for r in rows],
                                    req.dtype, SUM if op == AVERAGE else op)  # fmt: skip
        self._act([req.name], None)
        ops.scale(out.reshape(-1), req.dtype, post)
        return out
