"""The coordinator on its own: readiness, validation messages, fusion, groups, join, cache ids."""

from __future__ import annotations

from typing import Any

from hora.core.controller import Coordinator, decode_responses
from hora.core.messages import OpType, Request, bits_encode
from hora.core.response_cache import ResponseCache


def _coord(size: int = 2, fusion: int = 1 << 20, cache: int = 16) -> Coordinator:
    c = Coordinator(fusion, cache)
    c.add_set(0, list(range(size)))
    return c


def _send(
    c: Coordinator, rank: int, *reqs: Request, hits: list[int] | None = None, epoch: int = 0
) -> None:
    c.on_message(
        rank, {"ps": 0, "ep": epoch, "r": [r.to_wire() for r in reqs], "h": bits_encode(hits or [])}
    )


def _ar(name: str, n: int = 4, dtype: str = "float32", **kw: Any) -> Request:
    return Request(OpType.ALLREDUCE, f"allreduce.{name}", dtype, (n,), **kw)


def test_ready_only_when_every_rank_asked() -> None:
    c = _coord(3)
    _send(c, 0, _ar("a"))
    _send(c, 1, _ar("a"))
    assert c.take_responses() == []
    _send(c, 2, _ar("a"))
    [(st, responses)] = c.take_responses()
    assert [r.names for r in responses] == [["allreduce.a"]]


def test_mismatches_name_both_ranks_and_values() -> None:
    cases = [
        (
            (_ar("x", dtype="float32"), _ar("x", dtype="int32")),
            "Mismatched data types: One rank had type float32, but another rank had type int32.",
        ),
        (
            (_ar("x", 4), _ar("x", 5)),
            "Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape [4], but another "
            "rank sent a tensor of shape [5].",
        ),
        (
            (_ar("x"), Request(OpType.ALLGATHER, "allgather.x", "float32", (4,))),
            "Mismatched operations: One rank did an ALLREDUCE, but another rank did an ALLGATHER.",
        ),
        (
            (
                Request(OpType.BROADCAST, "broadcast.x", "float32", (4,), root=0),
                Request(OpType.BROADCAST, "broadcast.x", "float32", (4,), root=1),
            ),
            "Mismatched BROADCAST root ranks: One rank specified root rank 0, but another rank "
            "specified root rank 1.",
        ),
        ((_ar("x", reduce_op=1), _ar("x", reduce_op=4)), "Mismatched reduction operation"),
        ((_ar("x", prescale=2.0), _ar("x")), "Mismatched prescale and/or postscale factors"),
    ]
    for (a, b), text in cases:
        c = _coord()
        _send(c, 0, a)
        _send(c, 1, b)
        [(st, [resp])] = c.take_responses()
        assert resp.op == OpType.ERROR
        assert text in resp.error, resp.error
        assert "rank 0" in resp.error and "rank 1" in resp.error


def test_fusion_packs_matching_allreduces_up_to_the_threshold() -> None:
    c = _coord(2, fusion=40)  # 40 bytes: two 4-float tensors fit, a third does not
    reqs = [_ar(f"g{i}") for i in range(3)] + [_ar("i", dtype="int32")]
    _send(c, 0, *reqs)
    _send(c, 1, *reqs)
    [(st, responses)] = c.take_responses()
    assert [r.names for r in responses] == [
        ["allreduce.g0", "allreduce.g1"],
        ["allreduce.g2"],
        ["allreduce.i"],
    ]


def test_fusion_threshold_zero_disables_fusion() -> None:
    c = _coord(2, fusion=0)
    reqs = [_ar(f"g{i}") for i in range(3)]
    _send(c, 0, *reqs)
    _send(c, 1, *reqs)
    [(st, responses)] = c.take_responses()
    assert len(responses) == 3


def test_group_is_released_together() -> None:
    c = _coord(2)
    g = [_ar(f"grp_{i}of2", group="allreduce.grp_0of2", group_size=2) for i in range(2)]
    _send(c, 0, *g)
    _send(c, 1, g[0])
    assert c.take_responses() == []
    _send(c, 1, g[1])
    [(st, responses)] = c.take_responses()
    assert sum(len(r.specs) for r in responses) == 2


def test_join_lets_the_others_reduce_and_reports_the_last_rank() -> None:
    c = _coord(3)
    _send(c, 2, Request(OpType.JOIN, "join.noname"))
    _send(c, 0, _ar("a"))
    _send(c, 1, _ar("a"))
    [(st, responses)] = c.take_responses()
    assert responses[0].names == ["allreduce.a"]
    _send(c, 0, Request(OpType.JOIN, "join.noname"))
    _send(c, 1, Request(OpType.JOIN, "join.noname"))
    [(st, [resp])] = c.take_responses()
    assert resp.op == OpType.JOIN and resp.last_joined == 1


def test_cached_specs_travel_as_ids_and_members_decode_them() -> None:
    c = _coord(2)
    member = ResponseCache(16)
    for step in range(2):
        for r in (0, 1):
            if step == 0:
                _send(c, r, _ar("w"))
            else:  # steady state: the member reports a hit, not a request
                cid = member.hit(_ar("w"), r)
                assert cid is not None
                _send(c, r, hits=[cid], epoch=step)
        [(st, responses)] = c.take_responses()
        wire = c.encode(st, responses)
        assert isinstance(wire[0][1][0], int) == (step == 1)  # an id on the second step
        decoded = decode_responses(wire, member)
        assert decoded[0].names == ["allreduce.w"]


def _cached(c: Coordinator, member: ResponseCache, req: Request, size: int) -> int:
    """Run ``req`` once on every rank so that it is cached; its id."""
    for r in range(size):
        _send(c, r, req)
    [(st, responses)] = c.take_responses()
    decode_responses(c.encode(st, responses), member)
    cid = member.hit(req, 0)
    assert cid is not None
    return cid


def test_a_hit_on_every_rank_releases_the_cached_spec_itself() -> None:
    c = _coord(2)
    member = ResponseCache(16)
    cid = _cached(c, member, _ar("w"), 2)
    spec = c.sets[0].mirror.get(cid)
    _send(c, 0, hits=[cid], epoch=1)
    assert c.take_responses() == []  # rank 1 has not asked yet
    _send(c, 1, hits=[cid], epoch=1)
    [(st, [resp])] = c.take_responses()
    assert resp.specs == [spec] and resp.specs[0] is spec
    assert c.encode(st, [resp])[0][1] == [cid]


def test_a_hit_beside_a_changed_request_still_reports_the_mismatch() -> None:
    c = _coord(2)
    member = ResponseCache(16)
    cid = _cached(c, member, _ar("w", 4), 2)
    _send(c, 0, hits=[cid], epoch=1)
    _send(c, 1, _ar("w", 5), epoch=1)  # rank 1 changed the shape: a miss, sent in full
    [(st, [resp])] = c.take_responses()
    assert resp.op == OpType.ERROR
    assert "shape [4], but another rank sent a tensor of shape [5]" in resp.error
    assert "(rank 0 vs rank 1; tensor allreduce.w)" in resp.error


def test_hits_with_a_joined_rank_are_still_validated() -> None:
    c = _coord(3)
    member = ResponseCache(16)
    bcast = Request(OpType.BROADCAST, "broadcast.b", "float32", (4,), root=0)
    cid = _cached(c, member, bcast, 3)
    _send(c, 2, Request(OpType.JOIN, "join.noname"), epoch=1)
    _send(c, 0, hits=[cid], epoch=1)
    _send(c, 1, hits=[cid], epoch=1)
    [(st, [resp])] = c.take_responses()
    assert resp.op == OpType.ERROR and "Broadcast is not supported with Join" in resp.error


def test_stall_report_names_the_missing_ranks() -> None:
    c = _coord(3)
    _send(c, 0, _ar("late"))
    _send(c, 2, _ar("late"))
    pend = next(iter(c.sets[0].table.values()))
    lines = c.stalled(10.0, now=pend.first_seen + 11)
    assert lines == ["1: [allreduce.late]"]
    assert c.stalled(10.0, now=pend.first_seen + 5) == []
