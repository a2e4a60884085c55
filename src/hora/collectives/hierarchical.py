"""Host-aware allreduce and allgather: shared memory inside a host, one rank per host across.

A :class:`HostLayout` says which host each group rank is on (the transport knows it from the
rendezvous store) and whether the ranks of this host reach each other over shared memory.

* **One host, shared memory** (:func:`allreduce_direct`): every rank sends each other rank the
  block that rank owns, reduces the blocks it receives into its own block as they arrive
  (``recv_reduce``: pulled straight from the sender's memory, in cache-sized pieces), then sends
  its reduced block to every rank. Each byte crosses once per phase with no forwarding, and a
  block is reduced by one rank only, so every rank ends with the same bits. Between two ranks
  over single copy it is one round: each reduced piece is written straight back into the
  peer's buffer (``isend_reduce``), so the second phase is not needed.
* **Several hosts** (:func:`allreduce_hierarchical`): reduce inside each host into the lowest
  rank of the host (the local leader), allreduce across hosts between the leaders only,
  then send the result to the other ranks of each host. :func:`allgatherv_hierarchical`
  gathers inside each host at the leader, allgathers the hosts' parts between the leaders,
  and shares the whole result inside each host.

:func:`allreduce` / :func:`allgatherv` choose: hierarchical when asked
(``HOROVOD_HIERARCHICAL_ALLREDUCE`` / ``_ALLGATHER``, or ``HOROVOD_TORUS_ALLREDUCE``) or, for
buffers above the small-message threshold, when the group spans several hosts and some host
holds several of its ranks; the direct allreduce for large buffers of a one-host group over
shared memory; else the flat algorithms of :mod:`~hora.collectives.registry`. The choice is
logged at debug level, once per layout and kind.

Runs on the calling (engine) thread; thread-safe for distinct Comms and buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hora.collectives import registry
from hora.collectives.base import Comm, as_bytes, check_buffer, offsets_of, split_even
from hora.collectives.reduce_ops import Reducer, reducer, reducer_scaled, scale
from hora.transport.base import Pair, Work

log = logging.getLogger(__name__)


class HostAware(Protocol):
    """What :func:`layout_of` needs from a backend's communicator (``backends.base.SetComm``)."""

    ranks: list[int]
    rank: int
    transport: Any
    cache: dict[str, Any]


@dataclass
class HostLayout:
    """Where the ranks of a group live: ``hosts[i]`` numbers group rank ``i``'s host."""

    hosts: tuple[int, ...]
    rank: int
    shared: bool = False  # this host's ranks reach each other over shared memory
    logged: set[str] = field(default_factory=set)

    @property
    def local(self) -> list[int]:
        """Group ranks on this rank's host, ascending; the first is the host's leader."""
        mine = self.hosts[self.rank]
        return [i for i, h in enumerate(self.hosts) if h == mine]

    @property
    def leaders(self) -> list[int]:
        """The lowest group rank of every host, ascending."""
        first: dict[int, int] = {}
        for i, h in enumerate(self.hosts):
            first.setdefault(h, i)
        return sorted(first.values())

    @property
    def column(self) -> list[int] | None:
        """The group ranks that are, on every host, what this rank is on its own (the same
        place among their host's ranks), ascending; None unless every host holds as many."""
        per_host: dict[int, list[int]] = {}
        for i, h in enumerate(self.hosts):
            per_host.setdefault(h, []).append(i)
        if len({len(v) for v in per_host.values()}) != 1:
            return None
        at = per_host[self.hosts[self.rank]].index(self.rank)
        return sorted(v[at] for v in per_host.values())

    @property
    def multi_host(self) -> bool:
        return len(set(self.hosts)) > 1

    @property
    def max_local(self) -> int:
        return max(self.hosts.count(h) for h in set(self.hosts))


def layout_of(comm: HostAware) -> HostLayout | None:
    """The layout of a process set, from its transport's host table (cached in ``comm.cache``).

    None when the transport does not know hosts (a plain TCP or loopback transport).
    """
    key = "hierarchical.layout"
    if key not in comm.cache:
        host_ids = getattr(comm.transport, "host_ids", None)
        layout = None
        if host_ids is not None:
            layout = HostLayout(tuple(host_ids(comm.ranks)), comm.rank)
            peers = [comm.ranks[i] for i in layout.local if i != comm.rank]
            layout.shared = bool(peers) and all(comm.transport.shares_memory(p) for p in peers)
            log.debug("hosts of the set %s: %s", comm.ranks, list(layout.hosts))
        comm.cache[key] = layout
    found: HostLayout | None = comm.cache[key]
    return found


class SubComm:
    """The group ranks ``members`` (ascending, including the caller) of ``comm``, as a Comm."""

    def __init__(self, comm: Comm, members: Sequence[int]) -> None:
        self._comm = comm
        self._members = list(members)
        self.rank = self._members.index(comm.rank)
        self.size = len(self._members)

    def pair(self, peer: int) -> Pair:
        return self._comm.pair(self._members[peer])


def _note(layout: HostLayout, kind: str, choice: str) -> None:
    if f"{kind}:{choice}" not in layout.logged:
        layout.logged.add(f"{kind}:{choice}")
        hosts = len(set(layout.hosts))
        log.debug(
            "%s: %s (%d hosts, up to %d ranks per host)", kind, choice, hosts, layout.max_local
        )


def allreduce(
    comm: Comm,
    buf: np.ndarray,
    dtype: str,
    op: int,
    layout: HostLayout | None,
    *,
    hierarchical: bool = False,
    scratch: np.ndarray | None = None,
    out: np.ndarray | None = None,
    post: float = 1.0,
) -> None:
    """Reduce ``buf`` in place across the group, choosing the algorithm (see module doc); with
    ``out`` (1-D, of ``buf``'s size and dtype), into ``out``, ``buf`` only read (it may be
    read-only). The result is scaled by ``post``: in the reduction's pass where the direct
    algorithm runs between two members, else after it."""
    check_buffer(buf if out is None else out, dtype)
    large = buf.nbytes > registry.SMALL_THRESHOLD
    direct = (comm.size > 1 and layout is not None and not layout.multi_host and layout.shared
              and large)  # fmt: skip
    if out is not None and not direct:  # the others reduce in place: in the output
        np.copyto(out, buf)
        buf, out = out, None
    res = buf if out is None else out
    if comm.size == 1 or buf.size == 0:
        scale(res, dtype, post)
    elif layout is not None and layout.multi_host and (
            hierarchical or (large and layout.max_local > 1)):  # fmt: skip
        _note(layout, "allreduce", "hierarchical" if hierarchical else "hierarchical (auto)")
        allreduce_hierarchical(comm, buf, dtype, op, layout, scratch=scratch, post=post)
    elif direct and layout is not None:
        _note(layout, "allreduce", "direct over shared memory")
        reduce, post = reducer_scaled(comm.size, op, dtype, post)
        allreduce_direct(comm, buf, reduce, scratch=scratch, out=out)
        scale(res, dtype, post)
    else:
        registry.allreduce(comm, buf, dtype, op, scratch=scratch, post=post)


def allgatherv(
    comm: Comm,
    send: np.ndarray,
    recv: np.ndarray,
    counts: Sequence[int],
    layout: HostLayout | None,
    *,
    hierarchical: bool = False,
) -> None:
    """Gather every rank's ``send`` into ``recv`` in rank order, choosing the algorithm."""
    big = recv.nbytes > registry.SMALL_THRESHOLD
    if (
        layout is not None
        and layout.multi_host
        and (hierarchical or (big and layout.max_local > 1))
    ):
        _note(layout, "allgather", "hierarchical" if hierarchical else "hierarchical (auto)")
        allgatherv_hierarchical(comm, send, recv, counts, layout)
    else:
        registry.allgatherv_ring(comm, send, recv, counts)


def recv_reduce(pair: Pair, buf: np.ndarray, reduce: Reducer, scratch: np.ndarray | None) -> None:
    """Receive ``buf.nbytes`` from ``pair`` and fold them into ``buf`` with ``reduce``.

    A pair with a ``recv_reduce(buf, reduce, scratch)`` method (the shared-memory pair) folds
    the frame in as it arrives; any other receives into scratch, then reduces.
    """
    fold = getattr(pair, "recv_reduce", None)
    if fold is not None and scratch is not None:
        fold(buf, reduce, scratch)
        return
    if scratch is not None and scratch.nbytes >= buf.nbytes:
        tmp = scratch.reshape(-1).view(np.uint8)[: buf.nbytes].view(buf.dtype)
    else:
        tmp = np.empty_like(buf)
    pair.recv_into(as_bytes(tmp))
    reduce(buf, tmp)


def _reduce_scatter(
    comm: Comm, blocks: list[list[np.ndarray]], reduce: Reducer, scratch: np.ndarray | None
) -> list[Work | None]:
    """Direct reduce-scatter of blocks cut by :func:`_cut`: block ``i`` of every rank is reduced
    into rank ``i``'s block. Returns the sends, to be waited for (None for an empty block)."""
    n, me = comm.size, comm.rank
    sends = [_isend(comm.pair(j), blocks[j]) for j in ((me + k) % n for k in range(1, n))]
    for k in range(1, n):
        _recv(comm.pair((me - k) % n), blocks[me], (reduce, scratch))
    return sends


def allreduce_direct(
    comm: Comm,
    buf: np.ndarray | Sequence[np.ndarray],
    reduce: Reducer,
    *,
    scratch: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> None:
    """Direct reduce-scatter then direct allgather, in place (see module doc).

    ``buf`` is one 1-D buffer, or several of one dtype reduced as their concatenation (a
    fused response without a fusion buffer): each block then travels as a gather of the
    parts it spans, read where they lie on the shared-memory pair. ``out``: where the result
    of one buffer goes instead (``buf`` stays as it is); between two ranks of a single-copy
    pair it is made there in the same pass, else ``buf`` is copied there first.
    """
    n, me = comm.size, comm.rank
    pair = comm.pair(1 - me) if n == 2 else None
    if out is not None and (not isinstance(buf, np.ndarray) or not hasattr(pair, "isend_reduce")):
        np.copyto(out, buf)
        buf, out = out, None
    blocks = _cut([buf] if isinstance(buf, np.ndarray) else list(buf), n)
    if pair is not None and hasattr(pair, "isend_reduce"):
        outs = None if out is None else _cut([out], n)
        _allreduce_pair(pair, blocks[1 - me], blocks[me], reduce, scratch,
                        None if outs is None else (outs[1 - me], outs[me]))  # fmt: skip
        return
    _allgather(comm, blocks, _reduce_scatter(comm, blocks, reduce, scratch))


def _allgather(comm: Comm, blocks: list[list[np.ndarray]], sends: list[Work | None]) -> None:
    """Direct allgather of blocks cut by :func:`_cut`: this rank's block to every other rank,
    theirs into place; then waits for ``sends`` (earlier ones) and its own."""
    n, me = comm.size, comm.rank
    sends = sends + [_isend(comm.pair((me + k) % n), blocks[me]) for k in range(1, n)]
    for k in range(1, n):
        j = (me - k) % n
        _recv(comm.pair(j), blocks[j], None)
    _wait(sends)


def _wait(sends: list[Work | None]) -> None:
    for work in sends:
        if work is not None:
            work.wait()


def _allreduce_pair(
    pair: Any,
    theirs: list[np.ndarray],
    mine: list[np.ndarray],
    reduce: Reducer,
    scratch: np.ndarray | None,
    outs: tuple[list[np.ndarray], list[np.ndarray]] | None = None,
) -> None:
    """:func:`allreduce_direct` between two ranks of a shared-memory pair, in one round where
    single-copy allows: each rank reduces its own block and writes every reduced piece straight
    back into the peer's buffer while it is still in cache (``isend_reduce``), so no second
    phase sends the blocks back. A frame that cannot be written back (staged, or small) is
    answered with the reduced block as usual; the frame kinds tell each side which it was.
    ``outs``: the peer's block and this rank's block of the output (one part each), where the
    results go instead of ``theirs`` and ``mine`` (which are then only read)."""
    into = None if outs is None or not outs[0] else as_bytes(outs[0][0])
    sent = [as_bytes(p) for p in theirs]
    work, back = pair.isend_reduce(sent, into) if theirs else (None, True)
    theirs_out, mine_out = outs if outs is not None else (theirs, mine)
    wrote = True
    if mine:
        tmp = scratch if scratch is not None else np.empty(0, np.uint8)
        wrote = pair.recv_reduce_parts(mine_out, reduce, tmp, None if outs is None else mine)
    answer = None if wrote else _isend(pair, mine_out)
    if not back:
        _recv(pair, theirs_out, None)
    for w in (work, answer):
        if w is not None:
            w.wait()


def _cut(parts: list[np.ndarray], n: int) -> list[list[np.ndarray]]:
    """The concatenation of ``parts`` in ``n`` even blocks, each as views of the parts it
    spans (an empty block is an empty list)."""
    bounds = offsets_of(split_even(sum(p.size for p in parts), n))
    blocks: list[list[np.ndarray]] = [[] for _ in range(n)]
    b = pos = 0
    for p in parts:
        off = 0
        while off < p.size:
            while bounds[b + 1] <= pos:
                b += 1
            take = min(p.size - off, bounds[b + 1] - pos)
            blocks[b].append(p[off : off + take])
            off += take
            pos += take
    return blocks


def _isend(pair: Pair, parts: list[np.ndarray]) -> Work | None:
    """Send ``parts`` as one frame (nothing for an empty block)."""
    if not parts:
        return None
    if len(parts) == 1:
        return pair.isend(as_bytes(parts[0]))
    work: Work = _gathering(pair).isend_parts([as_bytes(p) for p in parts])
    return work


def _recv(pair: Pair, parts: list[np.ndarray], fold: tuple[Reducer, Any] | None) -> None:
    """Receive one frame into ``parts``, or fold it into them with ``fold = (reduce, scratch)``."""
    if not parts:
        return
    if len(parts) == 1:
        if fold is None:
            pair.recv_into(as_bytes(parts[0]))
        else:
            recv_reduce(pair, parts[0], *fold)
    elif fold is None:
        _gathering(pair).recv_parts_into([as_bytes(p) for p in parts])
    else:
        scratch = fold[1] if fold[1] is not None else np.empty(0, np.uint8)
        _gathering(pair).recv_reduce_parts(parts, fold[0], scratch)


def _gathering(pair: Pair) -> Any:
    """``pair``, which must carry frames of several buffers (the shared-memory pair does)."""
    if not hasattr(pair, "isend_parts"):
        raise TypeError(f"{pair!r} cannot carry a frame of several buffers")
    return pair


def _flat(block: list[np.ndarray], like: np.ndarray) -> np.ndarray:
    """A block of one buffer cut by :func:`_cut` as one array (empty when the block is)."""
    return block[0] if block else like[:0]


def _share(local: SubComm, buf: np.ndarray) -> None:
    """The leader (local rank 0) sends ``buf`` to every other rank of the host."""
    raw = as_bytes(buf)
    if local.rank != 0:
        local.pair(0).recv_into(raw)
        return
    sends = [local.pair(j).isend(raw) for j in range(1, local.size)]
    for work in sends:
        work.wait()


def allreduce_hierarchical(
    comm: Comm,
    buf: np.ndarray,
    dtype: str,
    op: int,
    layout: HostLayout,
    *,
    scratch: np.ndarray | None = None,
    post: float = 1.0,
) -> None:
    """Reduce-scatter inside each host, allreduce each block across the hosts, allgather
    inside each host. The result is scaled by ``post`` in the allreduce across the hosts,
    before the allgather: each rank scales its part, not the whole buffer.

    Where every host holds as many of the group's ranks (``L``), the ranks at the same place
    on every host allreduce the block they hold (:attr:`HostLayout.column`): each rank sends
    and receives ``2 (n - 1) / n`` of the buffer, the bandwidth-optimal amount, and each host
    sends ``2 (h - 1) / h`` of it across, as when one leader per host did. Otherwise the
    host's leader gathers the blocks, allreduces the buffer with the other leaders and scatters
    the blocks back before the allgather (the leader sends ``3 (L - 1) / L`` of the buffer
    inside its host, not ``L - 1`` times all of it)."""
    check_buffer(buf, dtype)
    reduce = reducer(op, dtype)
    local = SubComm(comm, layout.local)
    blocks = _cut([buf], local.size)
    if local.size > 1:
        _wait(_reduce_scatter(local, blocks, reduce, scratch))
    column = layout.column
    if column is not None:
        across = SubComm(comm, column)
        registry.allreduce(across, _flat(blocks[local.rank], buf), dtype, op, scratch=scratch,
                           post=post)  # fmt: skip
    else:
        if local.rank == 0:
            for j in range(1, local.size):
                _recv(local.pair(j), blocks[j], None)
            registry.allreduce(SubComm(comm, layout.leaders), buf, dtype, op, scratch=scratch,
                               post=post)  # fmt: skip
            _wait([_isend(local.pair(j), blocks[j]) for j in range(1, local.size)])
        else:
            _wait([_isend(local.pair(0), blocks[local.rank])])
            _recv(local.pair(0), blocks[local.rank], None)
    if local.size > 1:
        _allgather(local, blocks, [])


def allgatherv_hierarchical(
    comm: Comm,
    send: np.ndarray,
    recv: np.ndarray,
    counts: Sequence[int],
    layout: HostLayout,
) -> None:
    """Gather at each host's leader, allgather hosts' parts across leaders, share in hosts."""
    check_buffer(recv, None, "recv")
    if len(counts) != comm.size or sum(counts) != recv.size or send.size != counts[comm.rank]:
        raise ValueError(
            f"counts {list(counts)} must give each of {comm.size} ranks its part of recv "
            f"({recv.size} elements; this rank sends {send.size})"
        )
    bounds = offsets_of(counts)
    local = SubComm(comm, layout.local)
    me = comm.rank
    if local.rank != 0:
        if send.size:
            local.pair(0).send(as_bytes(np.ascontiguousarray(send).reshape(-1)))
    else:
        np.copyto(recv[bounds[me] : bounds[me + 1]], send.reshape(-1))
        for i, j in enumerate(layout.local[1:], start=1):
            if counts[j]:
                local.pair(i).recv_into(as_bytes(recv[bounds[j] : bounds[j + 1]]))
        _across_leaders(comm, recv, counts, layout)
    if local.size > 1:
        _share(local, recv)


def _across_leaders(
    comm: Comm, recv: np.ndarray, counts: Sequence[int], layout: HostLayout
) -> None:
    """Allgather of every host's parts between the leaders (packed by host when needed)."""
    leaders = SubComm(comm, layout.leaders)
    order = sorted(range(comm.size), key=lambda r: (layout.leaders.index(_leader(layout, r)), r))
    host_counts = [
        sum(counts[r] for r in range(comm.size) if _leader(layout, r) == lead)
        for lead in layout.leaders
    ]
    bounds = offsets_of(counts)
    if order == list(range(comm.size)):
        hb = offsets_of(host_counts)
        mine = recv[hb[leaders.rank] : hb[leaders.rank + 1]]
        registry.allgatherv_ring(leaders, mine, recv, host_counts)
        return
    packed = np.concatenate([recv[bounds[r] : bounds[r + 1]] for r in order])
    hb = offsets_of(host_counts)
    mine = packed[hb[leaders.rank] : hb[leaders.rank + 1]].copy()
    registry.allgatherv_ring(leaders, mine, packed, host_counts)
    pos = 0
    for r in order:
        recv[bounds[r] : bounds[r + 1]] = packed[pos : pos + counts[r]]
        pos += counts[r]


def _leader(layout: HostLayout, r: int) -> int:
    return layout.hosts.index(layout.hosts[r])
