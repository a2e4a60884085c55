"""What a collective algorithm sees of the world: a :class:`Comm`, i.e. a group of ranks.

Contract shared by every algorithm in this package:

* ``comm.rank``/``comm.size`` are the caller's rank within the group and the group's size;
  ``comm.pair(peer)`` returns the DATA-channel Pair to group rank ``peer`` (never to oneself).
  A whole-world Transport satisfies this protocol as it is; :class:`GroupComm` maps a subset of
  a Transport's ranks (a process set) onto group ranks.
* Buffers are 1-D C-contiguous NumPy arrays in storage dtype (``dtypes.storage_dtype``); the
  hora dtype name travels separately. Algorithms work in place and return once every send and
  receive they started is complete, so the caller owns the buffers again.
* Every rank of the group calls the same algorithm with the same sizes, in the same order.
  A transport failure surfaces as TransportError; bad arguments as ValueError/TypeError before
  any byte moves.

Thread-safety: an algorithm runs on the calling thread (the engine thread) and uses the Pairs of
that thread only; separate Comms may be used concurrently from separate threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from hora.dtypes import storage_dtype
from hora.transport.base import DATA, Pair, Transport

EAGER_BYTES = 32 << 10
"""Messages up to this size are sent with a blocking ``send`` even when the peer is sending to
us at the same time: the kernel's socket buffers take them whole, so the call cannot wait for
the peer to receive, and the engine thread saves the hand-off to a background thread."""


class Comm(Protocol):
    """A group of ranks as the algorithms see it."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def pair(self, peer: int) -> Pair: ...


class GroupComm:
    """The group of ``ranks`` (global ranks, sorted) of ``transport``'s world, as a Comm."""

    def __init__(self, transport: Transport, ranks: Sequence[int] | None = None) -> None:
        members = list(range(transport.size)) if ranks is None else sorted(set(ranks))
        if transport.rank not in members:
            raise ValueError(f"rank {transport.rank} is not a member of group {members}")
        if members[0] < 0 or members[-1] >= transport.size:
            raise ValueError(f"group {members} names ranks outside a world of {transport.size}")
        self._transport = transport
        self._members = members
        self.rank = members.index(transport.rank)
        self.size = len(members)

    def pair(self, peer: int) -> Pair:
        return self._transport.pair(self._members[peer], DATA)


def as_bytes(arr: np.ndarray) -> memoryview:
    """The memory of ``arr`` (C-contiguous) as a flat byte memoryview, without copying."""
    return memoryview(arr).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer


def check_buffer(buf: np.ndarray, dtype: str | None = None, what: str = "buffer") -> None:
    """ValueError/TypeError unless ``buf`` is a writable 1-D C-contiguous array (of ``dtype``)."""
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"{what} must be a NumPy array, got {type(buf).__name__}")
    if buf.ndim != 1 or not buf.flags.c_contiguous:
        raise ValueError(f"{what} must be 1-D and C-contiguous (got shape {buf.shape}); flatten it")
    if not buf.flags.writeable:
        raise ValueError(f"{what} is read-only; pass a writable array")
    if dtype is not None and buf.dtype != storage_dtype(dtype):
        raise TypeError(
            f"{what} has dtype {buf.dtype} but {dtype} is stored as {storage_dtype(dtype)}; "
            "pass the storage view (dtypes.storage_view)"
        )


def split_even(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` counts differing by at most one, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def offsets_of(counts: Sequence[int]) -> list[int]:
    """Prefix sums: ``offsets[i]`` is where part ``i`` starts; ``offsets[-1]`` is the total."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out
