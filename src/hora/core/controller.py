"""The coordinator: decides what runs, in one order, on every rank.

Global rank 0 coordinates every process set. Members send it their requests (or, in the steady
state, response-cache hits as a bit vector). When every member of a set that has not joined has
asked for a tensor, the coordinator checks the requests agree (names both sides in Horovod's
wording if they do not), fuses ready allreduces up to the fusion threshold, and appends the
responses to one global order. Because every rank executes the responses of its sets in that
single order, two sets that share ranks can never deadlock against each other.

The stall inspector lives here too: it knows who has not submitted what.
Runs in rank 0's engine thread only; not thread-safe.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

from hora.core.messages import (
    CACHEABLE,
    FUSIBLE,
    OpType,
    Request,
    Response,
    TensorSpec,
    bits_decode,
)
from hora.core.process_sets import DUPLICATE_SET
from hora.core.response_cache import ResponseCache
from hora.core.stall import missing_line

log = logging.getLogger("hora.controller")

_JOIN_UNSUPPORTED = "{op} is not supported with Join at this time."
_OP_NAMES = {
    OpType.ALLREDUCE: "Allreduce",
    OpType.ALLGATHER: "Allgather",
    OpType.BROADCAST: "Broadcast",
    OpType.ALLTOALL: "Alltoall",
    OpType.REDUCESCATTER: "Reducescatter",
    OpType.ADASUM: "Adasum",
}


class _Pending:
    __slots__ = ("requests", "first_seen")

    def __init__(self) -> None:
        self.requests: dict[int, Request] = {}  # set rank -> request
        self.first_seen = time.monotonic()


class SetState:
    """The coordinator's view of one process set."""

    def __init__(self, ps_id: int, ranks: list[int], cache_capacity: int) -> None:
        self.ps_id = ps_id
        self.ranks = ranks
        self.size = len(ranks)
        self.mirror = ResponseCache(cache_capacity)
        self.graveyard: dict[int, tuple[TensorSpec, int]] = {}
        self.epoch = 0  # response lists emitted
        self.member_epoch = dict.fromkeys(range(self.size), 0)
        self.table: OrderedDict[str, _Pending] = OrderedDict()
        self.ready: list[TensorSpec] = []
        self.ready_since = 0.0  # when ``ready`` last became non-empty
        self.groups: dict[str, list[TensorSpec]] = {}
        self.joined: set[int] = set()
        self.last_joined = -1
        self.barrier: set[int] = set()

    def set_rank(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


class Coordinator:
    def __init__(self, fusion_threshold: int, cache_capacity: int) -> None:
        self.fusion_threshold = fusion_threshold
        self.cache_capacity = cache_capacity
        self.sets: dict[int, SetState] = {}
        self._next_set_id = 1
        # called as on_ready(tensor_name, global_rank) when a rank's request arrives
        self.on_ready: Any = None
        self._last_stall_log = time.monotonic()
        # members may agree on cached work without the coordinator (hora.core.fastpath)
        self.direct = False

    # -- registration -----------------------------------------------------------------------
    def add_set(self, ps_id: int, ranks: list[int]) -> None:
        self.sets[ps_id] = SetState(ps_id, ranks, self.cache_capacity)

    def remove_set(self, ps_id: int) -> None:
        self.sets.pop(ps_id, None)

    # -- input ------------------------------------------------------------------------------
    def on_message(self, global_rank: int, msg: dict[str, Any]) -> None:
        """A member's requests: ``{"ps": id, "ep": epoch, "r": [...], "h": bits}``."""
        hits = bits_decode(msg.get("h", ""))
        self.on_requests(global_rank, msg["ps"], int(msg.get("ep", 0)), hits, msg.get("r", ()))

    def on_requests(
        self, global_rank: int, ps_id: int, epoch: int, hits: list[int], wires: Any
    ) -> None:
        """:meth:`on_message` for a message not encoded (rank 0's own requests): cache ids
        ``hits``, full requests ``wires``."""
        st = self.sets.get(int(ps_id))
        if st is None:
            raise ValueError(f"rank {global_rank} sent requests for unknown process set {ps_id}")
        srank = st.set_rank(global_rank)
        st.member_epoch[srank] = epoch
        self._purge(st)
        # Cache hits, the steady state, take a shorter way than _add: a cached spec is never
        # a join or a barrier, and a tensor not yet asked for by every member (none joined)
        # cannot be ready, so _maybe_ready runs only when it may decide something.
        table, size, joined, on_ready = st.table, st.size, st.joined, self.on_ready
        get = st.mirror.get
        for cid in hits:
            spec = get(cid) or st.graveyard.get(cid, (None, 0))[0]
            if spec is None:
                raise ValueError(f"rank {global_rank} reported unknown cache entry {cid}")
            req = spec.request_for(srank)
            pend = table.get(req.match)
            if pend is None:
                pend = table[req.match] = _Pending()
            pend.requests[srank] = req
            if on_ready is not None:
                on_ready(req.name, st.ranks[srank])
            if joined or len(pend.requests) >= size:
                self._maybe_ready(st, req.match, spec)
        for wire in wires:
            self._add(st, srank, Request.from_wire(wire))

    def _purge(self, st: SetState) -> None:
        if st.graveyard:
            low = min(st.member_epoch.values())
            for cid in [c for c, (_, ep) in st.graveyard.items() if ep <= low]:
                del st.graveyard[cid]

    def _add(self, st: SetState, srank: int, req: Request) -> None:
        if req.op == OpType.JOIN:
            st.joined.add(srank)
            st.last_joined = st.ranks[srank]
            # tensors that waited for this rank may now be ready
            for name in list(st.table):
                self._maybe_ready(st, name)
            return
        if req.op == OpType.BARRIER:
            st.barrier.add(srank)
            return
        pend = st.table.get(req.match)
        if pend is None:
            pend = st.table[req.match] = _Pending()
        pend.requests[srank] = req
        if self.on_ready is not None:
            self.on_ready(req.name, st.ranks[srank])
        self._maybe_ready(st, req.match)

    def _maybe_ready(self, st: SetState, name: str, cached: TensorSpec | None = None) -> None:
        """Move ``name`` to the ready list once every member asked. ``cached``: the cached
        spec a hit named; when every member's request is that very spec's (every rank hit it,
        none joined), it was validated when cached and goes on as it is."""
        pend = st.table[name]
        if len(pend.requests) < st.size and (
            not st.joined or not all(r in pend.requests or r in st.joined for r in range(st.size))
        ):
            return
        del st.table[name]
        if not st.ready:
            st.ready_since = time.monotonic()
        if (
            cached is not None
            and not st.joined
            and all(q is cached.request for q in pend.requests.values())
        ):
            spec_or_error: TensorSpec | str = cached
        else:
            spec_or_error = self._validate(st, pend.requests)
        if isinstance(spec_or_error, str):
            full = pend.requests[min(pend.requests)].name
            st.ready.append(
                TensorSpec(Request(OpType.ERROR, full, reduce_op=-1, group=spec_or_error))
            )
            return
        spec = spec_or_error
        req = spec.request
        if req.group_size > 1:
            members = st.groups.setdefault(req.group, [])
            members.append(spec)
            if len(members) < req.group_size:
                return
            del st.groups[req.group]
            st.ready.extend(members)
        else:
            st.ready.append(spec)

    # -- validation -------------------------------------------------------------------------
    def _validate(self, st: SetState, reqs: dict[int, Request]) -> TensorSpec | str:
        ranks = sorted(reqs)
        first_rank = ranks[0]
        first = reqs[first_rank]
        for r in ranks[1:]:
            q = reqs[r]
            if q is first:  # one cached request that every rank hit: nothing can differ
                continue
            op_name = first.op.name
            a, b = st.ranks[first_rank], st.ranks[r]
            if q.op != first.op:
                return (
                    f"Mismatched operations: One rank did an {op_name}, but another rank "
                    f"did an {q.op.name}. (rank {a}: {op_name}, rank {b}: {q.op.name}; "
                    f"tensor {first.name})"
                )
            if q.dtype != first.dtype:
                return (
                    f"Mismatched data types: One rank had type {first.dtype}, but another "
                    f"rank had type {q.dtype}. (rank {a}: {first.dtype}, rank {b}: "
                    f"{q.dtype}; tensor {first.name})"
                )
            err = self._validate_shapes(first, q, a, b)
            if err:
                return err
            if q.reduce_op != first.reduce_op:
                return (
                    f"Mismatched reduction operation: One rank specified op "
                    f"{first.reduce_op}, but another rank specified op {q.reduce_op}. "
                    f"(rank {a} vs rank {b}; tensor {first.name})"
                )
            if (q.prescale, q.postscale) != (first.prescale, first.postscale):
                return (
                    f"Mismatched prescale and/or postscale factors: One rank sent factors "
                    f"{first.prescale}, {first.postscale}, but another rank sent factors "
                    f"{q.prescale}, {q.postscale}. (rank {a} vs rank {b}; tensor "
                    f"{first.name})"
                )
            if q.root != first.root:
                return (
                    f"Mismatched {op_name} root ranks: One rank specified root rank "
                    f"{first.root}, but another rank specified root rank {q.root}. "
                    f"(rank {a} vs rank {b}; tensor {first.name})"
                )
            if q.ranks != first.ranks:
                return (
                    f"Mismatched process set registration: rank {a} registered ranks "
                    f"{list(first.ranks or [])}, but rank {b} registered ranks "
                    f"{list(q.ranks or [])}. Every rank must add the same process sets "
                    "in the same order."
                )
            if (q.group, q.group_size) != (first.group, first.group_size):
                return (
                    f"Mismatched grouping: rank {a} submitted {first.name} in a group of "
                    f"{first.group_size}, rank {b} in a group of {q.group_size}."
                )
        if st.joined and first.op not in (OpType.ALLREDUCE, OpType.ADASUM):
            return _JOIN_UNSUPPORTED.format(op=_OP_NAMES.get(first.op, first.op.name.title()))
        if first.op == OpType.BROADCAST and first.root not in st.ranks:
            return (
                f"broadcast received invalid root rank {first.root}: it is not a member of "
                f"process set {st.ps_id} (ranks {st.ranks})."
            )
        if first.op == OpType.ADASUM and (st.size & (st.size - 1)):
            return f"Adasum requires a power-of-two number of ranks, got {st.size}."
        if first.op == OpType.ALLGATHER:
            dims = [reqs[r].shape[0] if r in reqs else 0 for r in range(st.size)]
            return TensorSpec(first, first_dims=dims)
        if first.op == OpType.ALLTOALL:
            matrix = []
            for r in range(st.size):
                q = reqs[r]
                assert q.splits is not None  # the op surface always fills splits
                if len(q.splits) != st.size:
                    return (
                        f"Alltoall: rank {st.ranks[r]} gave {len(q.splits)} splits for a "
                        f"process set of {st.size} ranks."
                    )
                matrix.append(list(q.splits))
            return TensorSpec(first, split_matrix=matrix)
        return TensorSpec(first)

    @staticmethod
    def _validate_shapes(first: Request, q: Request, a: int, b: int) -> str:
        op = first.op.name
        if first.op in (OpType.ALLGATHER, OpType.ALLTOALL):
            if first.op == OpType.ALLTOALL and first.root in (a, b) and any(
                len(x.shape) == len(y.shape) + 1 and x.shape[-1] == 0
                for x, y in ((first, q), (q, first))
            ):
                # a scatter's root joins with an extra, empty dimension when its pieces do not
                # fit (hora.frameworks.rooted.scatter_async), so that no rank waits for it
                return (
                    f"scatter: the root, rank {first.root}, gave pieces that do not fit the "
                    f"output and raised; no rank receives anything. (rank {a} vs rank {b}; "
                    f"tensor {first.name})"
                )
            if len(q.shape) != len(first.shape):
                return (
                    f"Mismatched {op} tensor shapes: One rank sent a tensor of rank "
                    f"{len(first.shape)}, but another rank sent a tensor of rank "
                    f"{len(q.shape)}. (rank {a} vs rank {b}; tensor {first.name})"
                )
            for d in range(1, len(first.shape)):
                if first.shape[d] != q.shape[d]:
                    return (
                        f"Mismatched {op} tensor shapes: One rank sent a tensor with "
                        f"dimension {d} equal to {first.shape[d]}, but another rank sent "
                        f"a tensor with dimension {d} equal to {q.shape[d]}. (rank {a} vs "
                        f"rank {b}; tensor {first.name})"
                    )
            return ""
        if first.shape != q.shape:
            return (
                f"Mismatched {op} tensor shapes: One rank sent a tensor of shape "
                f"{list(first.shape)}, but another rank sent a tensor of shape "
                f"{list(q.shape)}. (rank {a} vs rank {b}; tensor {first.name})"
            )
        return ""

    # -- output -----------------------------------------------------------------------------
    def take_responses(
        self, now: float = 0.0, hold: float = 0.0
    ) -> list[tuple[SetState, list[Response]]]:
        """Ready work of every set, fused, by priority and then in the order it became ready.

        With ``hold`` > 0 (the cycle time, in seconds), a set whose ready tensors are still
        small while other tensors of it are half-submitted waits up to ``hold`` after the
        first became ready, so that a burst (a backward pass) travels in a few fused buffers
        instead of many small ones. An op with nothing else in flight never waits.
        """
        out: list[tuple[SetState, list[Response]]] = []
        for st in list(self.sets.values()):  # a response may add or remove a set
            if not (st.ready or st.barrier or st.joined):
                continue
            if st.ready and st.table and now - st.ready_since < hold and self._small(st):
                continue
            if len(st.ready) > 1:  # higher priority first; ties keep the order they came in
                st.ready.sort(key=_by_priority)
            responses = fuse(st.ready, self.fusion_threshold)
            st.ready = []
            for resp in responses:
                if resp.op in (OpType.ADD_PROCESS_SET, OpType.REMOVE_PROCESS_SET):
                    self._apply_set_change(resp)
            if st.barrier and len(st.barrier) + len(st.joined - st.barrier) >= st.size:
                st.barrier.clear()
                responses.append(Response(OpType.BARRIER))
            if st.joined and len(st.joined) == st.size:
                responses.append(Response(OpType.JOIN, last_joined=st.last_joined))
                st.joined.clear()
                st.last_joined = -1
            if self.direct and responses and self._steady(st, responses):
                responses.append(Response(OpType.DIRECT, threshold=self.fusion_threshold))
            if responses:
                out.append((st, responses))
        return out

    def _steady(self, st: SetState, responses: list[Response]) -> bool:
        """Whether members may go on without the coordinator after ``responses``
        (:mod:`hora.core.fastpath`): the only set, nothing else outstanding, and every
        tensor of the list one the members' caches already hold."""
        if len(self.sets) != 1 or st.table or st.barrier or st.joined or st.groups:
            return False
        encode_id = st.mirror.encode_id
        for resp in responses:
            if resp.op not in CACHEABLE:
                return False
            for spec in resp.specs:
                if encode_id(spec) is None:
                    return False
        return True

    def _small(self, st: SetState) -> bool:
        total = 0
        for spec in st.ready:
            req = spec.request
            if req.op not in FUSIBLE:
                return False
            total += req.nbytes
        return total < self.fusion_threshold

    def _apply_set_change(self, resp: Response) -> None:
        ranks = sorted(resp.specs[0].request.ranks or ())
        existing = [i for i, s in self.sets.items() if s.ranks == ranks]
        if resp.op == OpType.ADD_PROCESS_SET:
            if existing:
                resp.op, resp.error = OpType.ERROR, DUPLICATE_SET
                return
            resp.process_set_id = self._next_set_id
            self._next_set_id += 1
            self.add_set(resp.process_set_id, ranks)
        else:
            if not existing or existing[0] == 0:
                resp.op, resp.error = OpType.ERROR, f"process set {ranks} is not registered"
                return
            resp.process_set_id = existing[0]
            self.remove_set(existing[0])

    def encode(self, st: SetState, responses: list[Response]) -> list[Any]:
        """Wire form of one set's response list; cached specs go as ids. Advances the mirror."""
        wire: list[Any] = []
        st.epoch += 1
        for resp in responses:
            entries: list[Any] = []
            if resp.op == OpType.DIRECT:
                entries = [resp.threshold & 0xFFFFFFFF, resp.threshold >> 32]
            for spec in resp.specs:
                if resp.op == OpType.ERROR:
                    st.mirror.erase(spec.request.name)
                    entries.append(spec.to_wire())
                    continue
                cid = st.mirror.encode_id(spec)
                if cid is not None:  # applying an identical spec only refreshes it
                    entries.append(cid)
                    st.mirror.touch(cid)
                    continue
                entries.append(spec.to_wire())
                for old_id, old in st.mirror.apply(spec):
                    st.graveyard[old_id] = (old, st.epoch)
            wire.append([int(resp.op), entries, resp.error, resp.last_joined, resp.process_set_id])
        return wire

    # -- stall inspector --------------------------------------------------------------------
    def stalled(self, warn_after: float, now: float | None = None) -> list[str]:
        """Lines naming, per stalled tensor, the ranks that have not submitted it."""
        now = time.monotonic() if now is None else now
        lines = []
        for st in self.sets.values():
            missing: dict[int, list[str]] = {}
            for pend in st.table.values():
                if now - pend.first_seen < warn_after:
                    continue
                name = next(iter(pend.requests.values())).name
                for srank in range(st.size):
                    if srank not in pend.requests and srank not in st.joined:
                        missing.setdefault(st.ranks[srank], []).append(name)
            for rank, names in sorted(missing.items()):
                line = missing_line(rank, names)
                lines.append(line + (f" (process set {st.ps_id})" if st.ps_id else ""))
        return lines

    def oldest_wait(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        waits = [now - p.first_seen for st in self.sets.values() for p in st.table.values()]
        return max(waits, default=0.0)


def _by_priority(spec: TensorSpec) -> int:
    return -spec.request.priority


def fuse(ready: list[TensorSpec], threshold: int) -> list[Response]:
    """Ready specs as responses: allreduces that agree on dtype, op and scaling share one
    response up to ``threshold`` bytes (0: no fusion); everything else goes alone, in order."""
    responses: list[Response] = []
    open_by_key: dict[tuple[Any, ...], tuple[Response, int]] = {}
    for spec in ready:
        req = spec.request
        if req.op == OpType.ERROR:
            responses.append(Response(OpType.ERROR, [spec], error=req.group))
            continue
        nbytes = req.nbytes
        if threshold <= 0 or req.op != OpType.ALLREDUCE:
            responses.append(Response(req.op, [spec]))
            continue
        key = (req.op, req.dtype, req.reduce_op, req.prescale, req.postscale)
        cur = open_by_key.get(key)
        if cur is not None and cur[1] + nbytes <= threshold:
            cur[0].specs.append(spec)
            open_by_key[key] = (cur[0], cur[1] + nbytes)
            continue
        resp = Response(req.op, [spec])
        responses.append(resp)
        open_by_key[key] = (resp, nbytes)
    return responses


def decode_responses(wire: list[Any], cache: ResponseCache) -> list[Response]:
    """Member side: the inverse of :meth:`Coordinator.encode`. Advances ``cache`` the same way."""
    out = []
    for op, entries, error, last_joined, ps_id in wire:
        op = OpType(op)
        if op == OpType.DIRECT:
            lo, hi = (list(entries) + [0, 0])[:2]
            out.append(Response(op, threshold=int(lo) | int(hi) << 32))
            continue
        specs = []
        for e in entries:
            if isinstance(e, int):
                spec = cache.get(e)
                if spec is None:
                    raise ValueError(f"response names cache entry {e} that this rank lacks")
                if op != OpType.ERROR:
                    cache.touch(e)  # what applying the very spec cached under ``e`` does
                    specs.append(spec)
                    continue
            else:
                spec = TensorSpec.from_wire(e)
            if op == OpType.ERROR:
                cache.erase(spec.request.name)
            else:
                cache.apply(spec)
            specs.append(spec)
        out.append(Response(op, specs, str(error), int(last_joined), int(ps_id)))
    return out
