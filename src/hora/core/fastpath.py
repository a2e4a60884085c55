"""The direct steady state: members agree on cached work among themselves, without rank 0.

In steady training every step repeats tensors the response cache already knows, and every
member holds the same cache. Once the coordinator has answered a response list made only of
cached tensors with nothing else outstanding, it appends a ``DIRECT`` response (carrying its
fusion threshold) and every member, at that same point of the set's order, enters *direct
mode*. From then on a member with work does *rounds* instead of sending requests:

1. it sends every other member a header: the cache ids it has ready, in submission order, or
   the flag ``OTHER`` when it holds anything a round cannot settle (a cache miss, a barrier or
   join, a request already sent to the coordinator);
2. it receives every other member's header (the same headers reach every member);
3. every member decides alike: ``OTHER`` anywhere, or nothing that every member has ready,
   ends direct mode (each member then sends what it holds to the coordinator, which orders,
   validates and reports stalls as usual); otherwise the ids every member has ready run, in
   the lowest member's order, fused as the coordinator fuses, and the rest wait for the next
   round.

A member with work left is always in a round, and a member that has none takes part in the
next one as soon as it has some, so every member takes part in every round, in order, and the
headers travel on the set's data connections between two collectives, never inside one.
Mismatches cannot slip through: a request that differs from its cached spec is a cache miss,
which ends direct mode, and the coordinator reports it naming both sides.

This module is the pure part (header format, decision, plans); the engine does the sending,
the waiting and the executing. Engine thread only; not thread-safe.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

from hora.core.controller import fuse
from hora.core.messages import Response, TensorSpec
from hora.core.response_cache import ResponseCache

OTHER = 1  # the header's flag: this member holds work a round cannot settle
_HEAD = struct.Struct("<BI")  # flags, number of ids; then the ids as uint32


def encode_header(ids: Sequence[int], flags: int = 0) -> bytes:
    return _HEAD.pack(flags, len(ids)) + array("I", ids).tobytes()


def decode_header(payload: bytes, peer: int) -> tuple[int, list[int]]:
    """(flags, ids) of a peer's header; ValueError naming ``peer`` if it is malformed."""
    if len(payload) < _HEAD.size:
        raise ValueError(f"malformed direct-mode header from rank {peer}: {len(payload)} bytes")
    flags, count = _HEAD.unpack_from(payload)
    body = payload[_HEAD.size :]
    if len(body) != 4 * count:
        raise ValueError(
            f"malformed direct-mode header from rank {peer}: {count} ids in {len(body)} bytes"
        )
    ids = array("I")
    ids.frombytes(body)
    return flags, ids.tolist()


class DirectMode:
    """One member's direct-mode state for its process set."""

    def __init__(self) -> None:
        self.active = False
        self.fusion_threshold = 0
        self._plans: dict[tuple[int, ...], list[Response]] = {}

    def enter(self, fusion_threshold: int) -> None:
        self.active = True
        self.fusion_threshold = fusion_threshold
        self._plans.clear()

    def leave(self) -> None:
        self.active = False
        self._plans.clear()

    def decide(self, headers: list[tuple[int, list[int]]]) -> list[int] | None:
        """The ids to run this round, in order, from every member's header (by set rank);
        None when direct mode ends."""
        if any(flags & OTHER for flags, _ in headers):
            return None
        first = headers[0][1]
        if len(headers) == 2 and headers[1][1] == first:
            return first or None  # the steady state: both members hold the same work
        common = set(first)
        for _, ids in headers[1:]:
            common.intersection_update(ids)
        return [i for i in first if i in common] or None

    def plan(self, ids: list[int], cache: ResponseCache) -> list[Response] | None:
        """The responses that run ``ids`` (fused, whole groups only), kept per id list; None
        if an id is not cached (cannot happen while members agree) or nothing is complete."""
        key = tuple(ids)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        specs: list[TensorSpec] = []
        for cid in ids:
            spec = cache.get(cid)
            if spec is None:
                return None
            specs.append(spec)
        specs = _whole_groups(specs)
        if not specs:
            return None
        specs.sort(key=_by_priority)
        plan = fuse(specs, self.fusion_threshold)
        self._plans[key] = plan
        return plan


def _whole_groups(specs: list[TensorSpec]) -> list[TensorSpec]:
    """``specs`` less the members of groups that are not all there (they wait)."""
    counts: dict[str, int] = {}
    for s in specs:
        if s.request.group_size > 1:
            counts[s.request.group] = counts.get(s.request.group, 0) + 1
    if not counts:
        return specs
    return [
        s for s in specs
        if s.request.group_size <= 1 or counts[s.request.group] >= s.request.group_size
    ]


def _by_priority(spec: TensorSpec) -> int:
    return -spec.request.priority
