"""The response cache: hits, invalidation by new parameters, LRU eviction, ids never reused."""

from __future__ import annotations

from hora.core.messages import OpType, Request, TensorSpec
from hora.core.response_cache import ResponseCache


def _spec(name: str, n: int = 4) -> TensorSpec:
    return TensorSpec(Request(OpType.ALLREDUCE, name, "float32", (n,)))


def test_hit_after_apply_and_miss_on_changed_shape() -> None:
    c = ResponseCache(4)
    c.apply(_spec("a"))
    assert c.hit(_spec("a").request, 0) == 0
    assert c.hit(_spec("a", 5).request, 0) is None
    evicted = c.apply(_spec("a", 5))  # new parameters replace the entry under a new id
    assert [cid for cid, _ in evicted] == [0]
    assert c.hit(_spec("a", 5).request, 0) == 1


def test_lru_eviction_and_ids_are_never_reused() -> None:
    c = ResponseCache(2)
    c.apply(_spec("a"))
    c.apply(_spec("b"))
    c.apply(_spec("a"))  # touch a: b is now least recently used
    evicted = c.apply(_spec("c"))
    assert [s.request.name for _, s in evicted] == ["b"]
    assert c.hit(_spec("c").request, 0) == 2 and len(c) == 2


def test_disabled_cache_stores_nothing() -> None:
    c = ResponseCache(0)
    c.apply(_spec("a"))
    assert len(c) == 0 and c.hit(_spec("a").request, 0) is None


def test_allgather_hit_compares_this_ranks_first_dimension() -> None:
    c = ResponseCache(4)
    req = Request(OpType.ALLGATHER, "allgather.x", "float32", (2, 3))
    c.apply(TensorSpec(req, first_dims=[2, 5]))
    mine = Request(OpType.ALLGATHER, "allgather.x", "float32", (5, 3))
    assert c.hit(mine, 1) == 0
    assert c.hit(mine, 0) is None
