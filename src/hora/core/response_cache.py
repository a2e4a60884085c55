"""The response cache: negotiated tensor specs that steady-state training repeats every step.

Every member of a process set keeps one cache for that set, and the coordinator keeps a mirror.
All of them apply the same operations in the same order (the set's response lists, which every
member processes in order), so an id means the same tensor everywhere. That is what lets a rank
announce "tensor #17 is ready again" as one bit, and the coordinator answer with the id alone.

Ids are never reused. Least recently used entries are evicted beyond ``capacity``.
Used by the engine thread only; not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict

from hora.core.messages import CACHEABLE, Request, TensorSpec


def _same(a: TensorSpec, b: TensorSpec) -> bool:
    if a is b:
        return True
    ra, rb = a.request, b.request
    return (
        (ra is rb or (ra.name == rb.name and ra.key() == rb.key()))
        and a.first_dims == b.first_dims
        and a.split_matrix == b.split_matrix
    )


class ResponseCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[int, TensorSpec] = OrderedDict()
        self._by_name: dict[str, int] = {}
        self._next_id = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, cache_id: int) -> TensorSpec | None:
        return self._entries.get(cache_id)

    def hit(self, req: Request, set_rank: int) -> int | None:
        """The id of a cached spec that answers ``req`` unchanged, or None (a miss)."""
        cid = self._by_name.get(req.name)
        if cid is None:
            return None
        spec = self._entries[cid]
        return cid if spec.request_for(set_rank).key() == req.key() else None

    def encode_id(self, spec: TensorSpec) -> int | None:
        """The id under which ``spec`` is already cached, exactly; None if it is not."""
        cid = self._by_name.get(spec.request.name)
        if cid is not None and _same(self._entries[cid], spec):
            return cid
        return None

    def touch(self, cache_id: int) -> None:
        """Mark an entry just used (what :meth:`apply` does for a spec already cached)."""
        self._entries.move_to_end(cache_id)

    def apply(self, spec: TensorSpec) -> list[tuple[int, TensorSpec]]:
        """Record that ``spec`` was executed: touch it, or insert it. Returns evicted entries."""
        if not self.enabled or spec.request.op not in CACHEABLE:
            return []
        name = spec.request.name
        cid = self._by_name.get(name)
        evicted: list[tuple[int, TensorSpec]] = []
        if cid is not None and _same(self._entries[cid], spec):
            self._entries.move_to_end(cid)
            return evicted
        if cid is not None:  # same name, new parameters: the old entry is invalid
            evicted.append((cid, self._entries.pop(cid)))
        cid = self._next_id
        self._next_id += 1
        self._entries[cid] = spec
        self._by_name[name] = cid
        while len(self._entries) > self.capacity:
            old_id, old = self._entries.popitem(last=False)
            del self._by_name[old.request.name]
            evicted.append((old_id, old))
        return evicted

    def erase(self, name: str) -> None:
        cid = self._by_name.pop(name, None)
        if cid is not None:
            del self._entries[cid]
