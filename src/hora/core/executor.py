"""Executes negotiated responses on this rank: fusion buffer, scaling, the backend call.

Every member of a set runs the same responses in the same order. A rank that has joined runs
allreduces it never submitted with zeros in their place. Timeline activities are recorded here.

The executor is written once over :class:`~hora.core.buffers.BufferOps`: host (NumPy) buffers
through :class:`~hora.core.buffers.HostBufferOps`, and, for a backend that takes device buffers
(``device_buffers``, NCCL), that device's buffers through the backend's ``buffer_ops``: a
response holding one of them (or nothing at all: a joined rank) is fused, scaled and allocated
on the device, host arrays fused with them uploaded and their results downloaded. Which
tensors of a fused response are reduced alone (the large ones) is decided the same way for
both, so ranks holding host arrays and ranks holding device buffers make the same backend calls.
Engine thread only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hora.backends.base import Backend, SetComm
from hora.collectives.allreduce_recursive_doubling import (
    Doubling,
    doubling,
    reduce_like_doubling,
)
from hora.collectives.reduce_ops import AVERAGE, SUM, reducer, reducer_scaled, scale
from hora.collectives.reducescatter_ring import reducescatter_counts
from hora.core.buffers import BufferOps, HostBufferOps
from hora.core.messages import OpType, Request, Response, TensorSpec
from hora.errors import HoraInternalError
from hora.transport.shm.mailbox import Mailboxes


@dataclass(slots=True)
class TensorEntry:
    """One submitted tensor: the request, its arrays and the handle to complete."""

    spec_request: Any  # messages.Request
    # input, storage dtype; or a device buffer of a backend that takes them (core.buffers)
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


def _summed(req: Request, size: int) -> tuple[int, float]:
    """The op a reduction among ``size`` members runs for ``req`` and the factor its result
    is scaled by after it: an Average is a Sum scaled by ``postscale / size``."""
    if req.reduce_op == AVERAGE:
        return SUM, req.postscale / size
    return req.reduce_op, req.postscale


InOrder = tuple[Doubling, float]  # an in-order reduction made once, and the factor after it


def in_order(req: Request, size: int) -> InOrder:
    """What :meth:`Executor.reduced_in_order` takes for ``req`` among ``size`` members (at
    least two), made once for a call made again."""
    op, post = _summed(req, size)
    return doubling(size, op, req.dtype, req.numel), post


# an allreduce staged ahead of a round's header (Executor.spread_in): every member's segment of
# the set's shared arena, the buffer reduced, and where the result goes apart from it (None: in
# place)
Spread = tuple[list[np.ndarray], np.ndarray, np.ndarray | None]

# A two-member set in direct mode moves an allreduce up to this size inside the round's headers
# (hora.core.fastpath), with hora's own backend: one exchange instead of two. Larger ones, up
# to the backend's exchange slots, go through the set's shared arena where it has one.
EXCHANGE_MAX_BYTES = 64 << 10

# In a fused allreduce, tensors this large are reduced in place rather than copied through the
# fusion buffer (two copies of a large tensor cost more than one more backend call).
IN_PLACE_MIN_BYTES = 1 << 20


class Executor:
    """Runs responses on host buffers, and on a device's buffers for a backend that takes them
    (``device_ops``: its ``buffer_ops``; None for a host backend)."""

    def __init__(self, backend: Backend, timeline: Any = None) -> None:
        self.backend = backend
        self.timeline = timeline
        self.host = HostBufferOps()
        self.device_ops: BufferOps | None = (
            backend.buffer_ops if getattr(backend, "device_buffers", False) else None  # type: ignore[attr-defined]
        )
        # hora's own backend: a pair's allreduces may travel in its rounds (hora.core.handover)
        self.native = bool(getattr(backend, "native", False))
        # the backend scales a host allreduce's result itself (allreduce's ``post=``)
        self._scales = bool(getattr(backend, "scales_result", False))

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

    def _ops(self, entries: list[TensorEntry | None]) -> BufferOps:
        """Where a response runs: on the device when it holds a device buffer, or nothing at
        all (a joined rank's zeros), with a backend that takes them; else on the host."""
        dev = self.device_ops
        if dev is None:
            return self.host
        held = [e.array for e in entries if e is not None and e.array is not None]
        return dev if not held or any(dev.owns(a) for a in held) else self.host

    def _input(self, ops: BufferOps, spec: TensorSpec, entry: TensorEntry | None) -> Any:
        """``spec``'s input as a 1-D buffer of ``ops`` (zeros for a joined rank; a host array
        uploaded for a response on the device)."""
        req = spec.request
        _arrived(entry)
        if entry is None or entry.array is None:  # joined rank: contributes zeros
            return ops.zeros(_numel(req.shape), req.dtype)
        flat = entry.array.reshape(-1)
        return flat if ops is self.host or ops.owns(flat) else ops.upload(flat, req.dtype)

    def _target(self, ops: BufferOps, spec: TensorSpec, entry: TensorEntry | None) -> Any:
        """Where ``spec`` is reduced: its output (or a new buffer), holding its input."""
        src = self._input(ops, spec, entry)
        if entry is None or entry.array is None:
            return src  # zeros made for this op
        out = entry.output
        if out is None:
            return ops.clone(src)
        if out is entry.array:  # in place, the common case (no address to compare)
            return src
        flat = out.reshape(-1)
        if ops.ptr(flat) != ops.ptr(src):  # not in place
            ops.copy(flat, src)
        return flat

    def _apart(self, ops: BufferOps, resp: Response,
               entry: TensorEntry | None) -> tuple[np.ndarray, np.ndarray] | None:  # fmt: skip
        """A single allreduce of a host array into an output the caller gave, which the
        backend can make apart from the input (``reduces_into``): the input and the output, so
        the input is never copied there first. None for the rest: in place, prescaled (the
        input would be scaled first), Adasum, a joined rank's, on a device, and with no output
        given: a new array's pages fault in slowly when the peer writes them (np=2, 64 MiB:
        23.6-31.4 ms made apart in a new array, 16.9-17.3 copied into it then reduced in place,
        10.9-13.6 made apart in an array written before)."""
        spec = resp.specs[0]
        if (entry is None or entry.array is None or entry.output is None
                or entry.output is entry.array
                or ops is not self.host or resp.op != OpType.ALLREDUCE
                or spec.request.prescale != 1.0
                or not getattr(self.backend, "reduces_into", False)):
            return None
        src, out = self._input(ops, spec, entry), entry.output.reshape(-1)
        # an output over (part of) the input is copied into and reduced in place as before
        return None if np.may_share_memory(out, src) else (src, out)

    def _unpack(self, ops: BufferOps, spec: TensorSpec, entry: TensorEntry | None,
                piece: Any) -> Any:  # fmt: skip
        """A fused tensor's result out of the fusion buffer: into its output, or a new one."""
        if entry is None or entry.array is None:
            return None  # a joined rank's: nobody takes it
        out = entry.output
        if ops is not self.host and not ops.owns(entry.array):  # a host array fused on device
            got = ops.download(piece, None if out is None else out.reshape(-1))
            return got.reshape(spec.request.shape) if out is None else out
        if out is not None:
            ops.copy(out.reshape(-1), piece)
            return out
        return ops.clone(piece).reshape(spec.request.shape)

    # -- ops --------------------------------------------------------------------------------
    def allreduce(
        self, comm: SetComm, resp: Response, entries: list[TensorEntry | None]
    ) -> list[Any]:
        ops = self._ops(entries)
        req = resp.specs[0].request
        dtype = req.dtype
        red, post = _summed(req, comm.size)
        names = resp.names
        if len(resp.specs) == 1:
            spec = resp.specs[0]
            apart = self._apart(ops, resp, entries[0])  # made apart from its input, or in place
            src, flat = apart if apart is not None else (None, self._target(ops, spec, entries[0]))
            segments = [(0, _numel(spec.request.shape))]
            self._reduce(ops, comm, resp, flat, dtype, red, req.prescale, post, segments, names,
                         src)  # fmt: skip
            return [flat.reshape(spec.request.shape)]
        if resp.op == OpType.ALLREDUCE:
            total = sum(s.request.nbytes for s in resp.specs)
            parts = getattr(self.backend, "reduces_parts", None)
            if (total >= IN_PLACE_MIN_BYTES and parts is not None and ops is self.host
                    and parts(comm, total, len(resp.specs))):
                return self._allreduce_parts(comm, resp, entries, red, post)
            big = [i for i, s in enumerate(resp.specs) if s.request.nbytes >= IN_PLACE_MIN_BYTES]
            if big:
                return self._allreduce_split(comm, resp, entries, big)
        counts = [_numel(s.request.shape) for s in resp.specs]
        buf = self._fusion(ops, comm, sum(counts), dtype)
        self._act(names, "MEMCPY_IN_FUSION_BUFFER")
        ops.concat_into([self._input(ops, s, e) for s, e in zip(resp.specs, entries)], buf)
        segments, off = [], 0
        for n in counts:
            segments.append((off, n))
            off += n
        self._act(names, None)
        self._reduce(ops, comm, resp, buf, dtype, red, req.prescale, post, segments, names)
        self._act(names, "MEMCPY_OUT_FUSION_BUFFER")
        results = [self._unpack(ops, spec, entry, buf[o : o + n])
                   for spec, entry, (o, n) in zip(resp.specs, entries, segments)]  # fmt: skip
        self._act(names, None)
        return results

    def _fusion(self, ops: BufferOps, comm: SetComm, count: int, dtype: str) -> Any:
        """The fusion buffer: the backend's own for host arrays where it has one (the native
        backend's shared arena on one host, which it reduces in mapped memory), else ``ops``'."""
        if ops is self.host:
            own = getattr(self.backend, "fusion_buffer", None)
            buf = own(comm, count, dtype) if own is not None else None
            if buf is not None:
                return buf
        return ops.fusion(count, dtype)

    def _allreduce_parts(self, comm: SetComm, resp: Response, entries: list[TensorEntry | None],
                         op: int, post: float) -> list[np.ndarray]:  # fmt: skip
        """A fused response reduced where its tensors lie, as one buffer (the backend's
        ``allreduce_parts``: shared memory on one host), without the fusion buffer's copies."""
        req, names = resp.specs[0].request, resp.names
        flats = [self._target(self.host, s, e) for s, e in zip(resp.specs, entries)]
        if req.prescale != 1.0:
            for f in flats:
                scale(f, req.dtype, req.prescale)
        self._act(names, f"{self.backend.name}_{resp.op.name}")
        # a backend that reduces parts scales them too (hora's own: backends.native)
        own = self.backend.allreduce_parts  # type: ignore[attr-defined]
        own(comm, flats, req.dtype, op, post=post)
        self._act(names, None)
        return [f.reshape(s.request.shape) for f, s in zip(flats, resp.specs)]

    def _allreduce_split(
        self,
        comm: SetComm,
        resp: Response,
        entries: list[TensorEntry | None],
        big: list[int],
    ) -> list[Any]:
        """A fused response with large tensors: each large one reduced where it lies.

        Copying a large tensor into the fusion buffer and back costs more than the backend call
        it saves, so only the small tensors of the response travel fused; each large one is
        reduced in its output (or a copy of its input) with its own backend call.
        """
        results: list[Any] = [None] * len(resp.specs)
        small = sorted(set(range(len(resp.specs))) - set(big))
        if small:
            part = Response(resp.op, [resp.specs[i] for i in small])
            for i, r in zip(small, self.allreduce(comm, part, [entries[i] for i in small])):
                results[i] = r
        for i in big:
            part = Response(resp.op, [resp.specs[i]])
            results[i] = self.allreduce(comm, part, [entries[i]])[0]
        return results

    def _reduce(
        self,
        ops: BufferOps,
        comm: SetComm,
        resp: Response,
        buf: Any,
        dtype: str,
        op: int,
        pre: float,
        post: float,
        segments: list[tuple[int, int]],
        names: list[str],
        src: Any = None,
    ) -> None:
        """Reduce ``buf`` in place, scaled before and after; with ``src`` (:meth:`_apart`: no
        prescale, not Adasum), ``src`` into ``buf`` in the backend's one pass."""
        ops.scale(buf, dtype, pre)
        self._act(names, f"{self.backend.name}_{resp.op.name}")
        if resp.op == OpType.ADASUM:
            self.backend.adasum(comm, buf, dtype, segments)
        else:
            kw: dict[str, Any] = {} if src is None else {"out": buf}
            if self._scales and ops is self.host:  # in the reduction's pass where it can
                kw["post"], post = post, 1.0
            self.backend.allreduce(comm, buf if src is None else src, dtype, op, **kw)
        self._act(names, None)
        ops.scale(buf, dtype, post)

    def exchange_input(
        self, comm: SetComm, specs: list[TensorSpec], entries: list[TensorEntry], slot: int,
        at: int = 0,
    ) -> tuple[np.ndarray, bool] | None:  # fmt: skip
        """What this rank offers when a two-member round carries allreduces itself: their
        prescaled inputs one after another (the inputs stay as they are, should the round not
        run them), and whether that lies in exchange slot ``slot`` of the set's shared arena
        from byte ``at`` on, where the other member reads it (else, small and ``at`` 0, it
        travels in the header). ``specs``: allreduces of one dtype (fastpath.exchange_run).
        None when they do not qualify: not hora's own backend, or they do not fit in the slot
        or the header, or there is no shared arena open."""
        if not self.native or any(e.array is None for e in entries):
            return None
        arrays = [e.array.reshape(-1) for e in entries if e.array is not None]
        count = sum(a.size for a in arrays)
        dtype = arrays[0].dtype
        if at == 0 and count * dtype.itemsize <= EXCHANGE_MAX_BYTES:
            mine, shared = np.empty(count, dtype), False
        else:
            mine_ = self.exchange_view(comm, slot, at, count, dtype, comm.rank)
            if mine_ is None:
                return None
            mine, shared = mine_, True
        pos = 0  # in elements of ``mine``
        for spec, entry, a in zip(specs, entries, arrays):
            _arrived(entry)
            piece = mine[pos : pos + a.size]
            np.copyto(piece, a)
            scale(piece, spec.request.dtype, spec.request.prescale)
            pos += a.size
        return mine, shared

    def spread_in(self, comm: SetComm, spec: TensorSpec, entry: TensorEntry) -> Spread | None:
        """In a round that carries one allreduce alone (hora.core.handover._spread): its input's
        first segment staged in the set's shared arena where hora's own backend would stage
        it (hora.backends.native ``spread_in``), ahead of the header that tells the others;
        what :meth:`spread_finish` goes on with. The buffer reduced is the one
        :meth:`allreduce` would give the backend (the input, reduced apart into the output or
        a new array; prescaled, in its target), so the bits are the backend's. None (nothing
        done) with another backend, an input still arriving, an output over part of the input,
        or one prescaled in place (a round that does not run it would find it scaled)."""
        arr, req = entry.array, spec.request
        takes = getattr(self.backend, "spread_takes", None)
        if (takes is None or entry.ready is not None or not isinstance(arr, np.ndarray)
                or not takes(comm, req.nbytes)):
            return None
        out = entry.output
        src, into = arr.reshape(-1), None
        if out is not None and out is not arr and np.may_share_memory(out, arr):
            return None
        if req.prescale != 1.0:
            if out is arr:  # the input itself would be scaled: not before the round runs it
                return None
            src = self._target(self.host, spec, entry)  # a copy, scaled, as _reduce does
            scale(src, req.dtype, req.prescale)
        elif out is None:
            into = np.empty_like(src)
        elif out is not arr:
            into = out.reshape(-1)
        return self.backend.spread_in(comm, src), src, into  # type: ignore[attr-defined]

    def spread_finish(self, comm: SetComm, spec: TensorSpec, spread: Spread) -> np.ndarray:
        """The result of the allreduce :meth:`spread_in` staged, once every member's header
        says it staged its own."""
        req = spec.request
        views, src, into = spread
        op, post = _summed(req, comm.size)
        self.backend.spread_rest(comm, src, views, req.dtype, op,  # type: ignore[attr-defined]
                                 out=into, post=post)
        return (src if into is None else into).reshape(req.shape)

    def header_most(self, comm: SetComm) -> int:
        """In a set of more than two members, the most bytes of allreduces a round's header
        hands over (hora.core.handover): what hora's own backend reduces with its
        small-message path, whose bits the hand-over makes; -1 (none, not even a tensor of no
        bytes) with another backend."""
        return int(self.backend.small_most(comm)) if self.native else -1  # type: ignore[attr-defined]

    def exchange_takes(self, comm: SetComm, nbytes: int, count: int) -> bool:
        """Whether one hand-over carries ``count`` allreduces of ``nbytes`` together in this
        set: in the header when small, else where the backend says its exchange slots serve
        them (never with another backend than hora's own)."""
        if not self.native:
            return False
        if nbytes <= EXCHANGE_MAX_BYTES:
            return True
        takes = getattr(self.backend, "exchange_takes", None)
        return bool(takes(comm, nbytes, count)) if takes is not None else False

    def exchange_view(self, comm: SetComm, slot: int, at: int, count: int, dtype: np.dtype,
                      member: int) -> np.ndarray | None:  # fmt: skip
        """``count`` elements of ``dtype`` from byte ``at`` of ``member``'s exchange slot
        ``slot``; None where they do not fit, or the backend has no shared arena open for the
        set (it never opens one here: that is collective)."""
        get = getattr(self.backend, "exchange_slot", None)
        views = get(comm, slot, count * dtype.itemsize, at) if get is not None else None
        return None if views is None else views[member].view(dtype)

    def exchange_words(self, comm: SetComm) -> list[np.ndarray] | None:
        """Every member's words in the head of the set's shared arena (what members tell one
        another between messages, hora.core.handover); None without an open arena."""
        get = getattr(self.backend, "exchange_words", None)
        return get(comm) if get is not None else None

    def open_mailboxes(self, comm: SetComm) -> Mailboxes | None:
        """The mailboxes of the set's shared arena, which opens now if it is not open yet
        (collective: every member calls this at the same point); None where there are none."""
        get = getattr(self.backend, "open_mailboxes", None)
        return get(comm) if get is not None else None

    def mailboxes(self, comm: SetComm) -> Mailboxes | None:
        """The mailboxes of the set's shared arena (hora.transport.shm.mailbox); None without
        an open arena."""
        get = getattr(self.backend, "mailboxes", None)
        return get(comm) if get is not None else None

    def exchange_peer(self, comm: SetComm, slot: int, at: int, count: int,
                      dtype: np.dtype) -> np.ndarray:  # fmt: skip
        """The other member's inputs in its exchange slot ``slot``, from byte ``at``."""
        view = self.exchange_view(comm, slot, at, count, dtype, 1 - comm.rank)
        if view is None:
            raise HoraInternalError("the other member used a shared exchange slot this rank lacks")
        return view

    def finish_exchange(
        self, specs: list[TensorSpec], entries: list[TensorEntry], inputs: list[Any], me: int,
        shared: bool = False,
    ) -> list[np.ndarray]:  # fmt: skip
        """The results of allreduces handed over in a round, from every member's prescaled
        inputs (``inputs``, in member order: this rank's array at ``me``, the others' header
        bytes or, between two members, a view of their exchange slot), which begin with these
        tensors' in this order. The same bits on every member: between two members because the
        element-wise ops commute; among more, each result is reduced in the order of the
        backend's recursive doubling, which gives its bits. Written to the outputs where there
        are some. ``shared``: both inputs lie in the set's shared arena, where the other
        member reads this rank's meanwhile, so the results are made in the outputs, never in
        this rank's inputs."""
        dtype = inputs[me].dtype
        arrays = [a if isinstance(a, np.ndarray) else np.frombuffer(a, dtype) for a in inputs]
        need = sum(_numel(s.request.shape) for s in specs)
        short = [m for m, a in enumerate(arrays) if a.size < need]
        if short:
            raise HoraInternalError(
                f"{specs[0].request.name}: rank {short[0]} of the set handed over "
                f"{arrays[short[0]].nbytes} bytes for {need * dtype.itemsize}"
            )
        names = [s.request.name for s in specs]
        self._act(names, "EXCHANGE_ALLREDUCE")
        results = []
        at = 0
        for spec, entry in zip(specs, entries):
            n = _numel(spec.request.shape)
            parts = [a[at : at + n] for a in arrays]
            results.append(self.handed(spec, entry.output, entry.output is entry.array, parts,
                                       me, shared))
            at += n
        self._act(names, None)
        return results

    @classmethod
    def handed(cls, spec: TensorSpec, output: np.ndarray | None, in_place: bool,
               parts: list[np.ndarray], me: int, shared: bool) -> np.ndarray:  # fmt: skip
        """The result of an allreduce whose inputs every member handed every other
        (``parts``, in member order; this member's at ``me``): a pair's (:meth:`exchanged`),
        or a larger set's (:meth:`reduced_in_order`), into ``output`` as they say."""
        if len(parts) == 2:
            return cls.exchanged(spec, output, in_place, parts[me], parts[1 - me], shared)
        return cls.reduced_in_order(spec, output, parts)

    @staticmethod
    def reduced_in_order(spec: TensorSpec, output: np.ndarray | None, parts: list[np.ndarray],
                         prepared: InOrder | None = None) -> np.ndarray:  # fmt: skip
        """The result of an allreduce from every member's prescaled inputs (``parts``, in
        member order), reduced in the order of the backend's recursive doubling (its bits)
        into ``output`` (the caller's, or a new array); ``prepared``: what it takes, made
        before (:func:`in_order`)."""
        req = spec.request
        out = np.empty_like(parts[0]) if output is None else output.reshape(-1)
        if prepared is None:
            op, post = _summed(req, len(parts))
            reduce_like_doubling(parts, reducer(op, req.dtype), out)
        else:
            fold, post = prepared
            fold(parts, out)
        if post != 1.0:
            scale(out, req.dtype, post)
        return output if output is not None and output.shape == req.shape else out.reshape(
            req.shape)

    @staticmethod
    def exchanged(spec: TensorSpec, output: np.ndarray | None, in_place: bool,
                  mine: np.ndarray, incoming: np.ndarray, shared: bool) -> np.ndarray:  # fmt: skip
        """The result of a pair's allreduce from this member's prescaled inputs ``mine`` and
        the other's ``incoming``, into ``output`` (the caller's: its input itself where
        ``in_place``), or a new array; ``shared``: never made over ``mine``."""
        req = spec.request
        # where the result is made: over ``mine`` where that is this rank's own copy, over the
        # input where the output is the input and holds ``mine`` already, else apart
        if output is None:
            out = np.empty_like(mine) if shared else mine
        else:
            out = output.reshape(-1)
            if in_place and req.prescale == 1.0:
                mine = out
        op, post = _summed(req, 2)
        red, post = reducer_scaled(2, op, req.dtype, post)
        red(mine, incoming, out=out)
        scale(out, req.dtype, post)
        return out.reshape(req.shape)

    def allgather(self, comm: SetComm, spec: TensorSpec, entry: TensorEntry) -> Any:
        req = spec.request
        _arrived(entry)
        assert spec.first_dims is not None and entry.array is not None
        ops = self._ops([entry])
        row = _numel(req.shape[1:])
        counts = [d * row for d in spec.first_dims]
        out = ops.empty((sum(spec.first_dims),) + req.shape[1:], entry.array)
        self._act([req.name], f"{self.backend.name}_ALLGATHER")
        self.backend.allgatherv(comm, entry.array.reshape(-1), out.reshape(-1), counts)
        self._act([req.name], None)
        return out

    def broadcast(self, comm: SetComm, spec: TensorSpec, entry: TensorEntry) -> Any:
        req = spec.request
        _arrived(entry)
        assert entry.array is not None
        ops = self._ops([entry])
        src = entry.array
        root = comm.ranks.index(req.root)
        out = entry.output if entry.output is not None else ops.empty(req.shape, src)
        if comm.rank == root and ops.ptr(out) != ops.ptr(src):
            ops.copy(out.reshape(-1), src.reshape(-1))
        self._act([req.name], f"{self.backend.name}_BCAST")
        self.backend.broadcast(comm, out.reshape(-1), root)
        self._act([req.name], None)
        return out

    def alltoall(self, comm: SetComm, spec: TensorSpec, entry: TensorEntry) -> tuple[Any, Any]:
        req = spec.request
        _arrived(entry)
        m = spec.split_matrix
        assert m is not None and entry.array is not None
        ops = self._ops([entry])
        row = _numel(req.shape[1:])
        me = comm.rank
        recv_rows = [m[j][me] for j in range(comm.size)]
        out = ops.empty((sum(recv_rows),) + req.shape[1:], entry.array)
        self._act([req.name], f"{self.backend.name}_ALLTOALL")
        self.backend.alltoallv(comm, entry.array.reshape(-1), [c * row for c in m[me]],
                               out.reshape(-1), [c * row for c in recv_rows])  # fmt: skip
        self._act([req.name], None)
        return out, np.asarray(recv_rows, dtype=np.int32)

    def reducescatter(self, comm: SetComm, spec: TensorSpec, entry: TensorEntry) -> Any:
        req = spec.request
        _arrived(entry)
        assert entry.array is not None
        ops = self._ops([entry])
        rows = reducescatter_counts(req.shape[0], comm.size)
        row = _numel(req.shape[1:])
        send = ops.clone(entry.array.reshape(-1))  # the caller's tensor stays as it is
        out = ops.empty((rows[comm.rank],) + req.shape[1:], entry.array)
        op, post = _summed(req, comm.size)
        ops.scale(send, req.dtype, req.prescale)
        self._act([req.name], f"{self.backend.name}_REDUCESCATTER")
        self.backend.reducescatterv(comm, send, out.reshape(-1), [r * row for r in rows],
                                    req.dtype, op)  # fmt: skip
        self._act([req.name], None)
        ops.scale(out.reshape(-1), req.dtype, post)
        return out
