"""Direct mode's pure parts: headers, the round's decision, plans, and when the coordinator
lets members go on without it."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from hora.core.controller import Coordinator, decode_responses
from hora.core.fastpath import (
    BARRIER,
    OTHER,
    DirectMode,
    encode_header,
)
from hora.core.handover import (
    DATA,
    SHARED,
    SLOT1,
    exchange_run,
    handed_inputs,
    header_data,
    mirrored,
    read_offer,
    slot_offer,
)
from hora.core.messages import OpType, Request, TensorSpec, bits_encode, decode, encode
from hora.core.response_cache import ResponseCache
from hora.core.swap import decode_header
from hora.errors import HoraInternalError


def _ar(name: str, n: int = 4, **kw: Any) -> Request:
    return Request(OpType.ALLREDUCE, f"allreduce.{name}", "float32", (n,), **kw)


def _cache(*reqs: Request) -> ResponseCache:
    c = ResponseCache(64)
    for r in reqs:
        c.apply(TensorSpec(r))
    return c


# -- headers ---------------------------------------------------------------------------------
def test_header_round_trip() -> None:
    assert decode_header(encode_header([3, 0, 70000]), 1) == (0, [3, 0, 70000], b"")
    assert decode_header(encode_header([], OTHER), 1) == (OTHER, [], b"")
    assert decode_header(encode_header([7], DATA, b"abc"), 1) == (DATA, [7], b"abc")


def test_header_data_in_parts_comes_back_as_a_view() -> None:
    payload = encode_header([7], DATA, b"ab", np.arange(3, dtype=np.uint8))
    flags, ids, data = decode_header(payload, 1)
    assert (flags, ids, data) == (DATA, [7], b"ab\x00\x01\x02")
    assert isinstance(data, memoryview) and data.obj is payload  # the data is not copied


@pytest.mark.parametrize("ids", range(9))
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "int64"])
def test_handed_inputs_lie_aligned_in_the_header_received(ids: int, dtype: str) -> None:
    """Whatever the number of ids, the inputs start at a multiple of 8 bytes from the header's
    start: the receiver reduces them where they lie, as aligned as any array."""
    inputs = np.arange(5, dtype=dtype)
    payload = encode_header(list(range(ids)), DATA, *header_data(ids, 2, inputs))
    _, got_ids, data = decode_header(payload, 1)
    count, pad = read_offer(data)
    view = handed_inputs(data, pad)
    assert got_ids == list(range(ids)) and count == 2
    assert (len(payload) - view.nbytes) % 8 == 0
    got = np.frombuffer(view, dtype)
    assert got.flags.aligned and np.array_equal(got, inputs)


def _sent(ids: list[int], inputs: np.ndarray, count: int = 1, flags: int = DATA) -> Any:
    """A header as another member sends it and this one decodes it."""
    return decode_header(encode_header(ids, flags, *header_data(len(ids), count, inputs)), 1)


def _no_slot(slot: int, at: int) -> np.ndarray:
    raise AssertionError("a header hand-over read a slot")


def test_the_lane_takes_every_members_inputs_when_every_header_mirrors_its_own() -> None:
    mine = np.arange(6, dtype=np.float32)
    others = [mine + 10, mine + 20]
    headers = [_sent([4], others[0]), (DATA, [4], b""), _sent([4], others[1])]
    parts = mirrored(headers, 1, [0, 1, 2], [4], DATA, mine, _no_slot)
    assert parts is not None and parts[1] is mine
    assert [p.tolist() for p in parts] == [others[0].tolist(), mine.tolist(), others[1].tolist()]


@pytest.mark.parametrize(
    "header",
    [
        _sent([5], np.zeros(6, np.float32)),  # another tensor
        _sent([4, 5], np.zeros(12, np.float32), count=2),  # more than the one tensor
        _sent([4, 5], np.zeros(6, np.float32)),  # it holds more (the first handed over)
        (OTHER, [4], b""),  # it holds what a round cannot settle
        (BARRIER, [], b""),
        decode_header(encode_header([4], SHARED | SLOT1, slot_offer(1, 0)), 1),  # a slot
    ],
    ids=["other-tensor", "two-handed-over", "holds-more", "other", "barrier", "in-a-slot"],
)
def test_the_lane_goes_on_as_a_round_when_a_header_differs(header: Any) -> None:
    mine = np.arange(6, dtype=np.float32)
    assert mirrored([(DATA, [4], b""), header], 0, [0, 1], [4], DATA, mine, _no_slot) is None


def test_the_lane_reads_a_slot_the_other_member_names() -> None:
    mine, theirs = np.arange(4.0), np.arange(4.0) * 3
    slots = {(1, 64): theirs}
    header = decode_header(encode_header([2], SHARED | SLOT1, slot_offer(1, 64)), 0)
    parts = mirrored([header, (SHARED, [2], b"")], 1, [3, 7], [2], SHARED, mine,
                     lambda slot, at: slots[slot, at])
    assert parts is not None and parts[0] is theirs and parts[1] is mine


def test_the_lane_names_a_member_that_handed_over_the_wrong_size() -> None:
    mine = np.arange(6, dtype=np.float32)
    headers = [(DATA, [4], b""), _sent([4], np.zeros(5, np.float32))]
    with pytest.raises(HoraInternalError, match="rank 9 .* 20 bytes of tensor id 4 for 24"):
        mirrored(headers, 0, [3, 9], [4], DATA, mine, _no_slot)


def test_malformed_header_names_the_peer() -> None:
    with pytest.raises(ValueError, match="rank 5"):
        decode_header(b"\x00", 5)
    with pytest.raises(ValueError, match="rank 2: 3 ids in 8 bytes"):
        decode_header(encode_header([1, 2, 3])[:-4], 2)
    with pytest.raises(ValueError, match="rank 2: 1 ids in 7 bytes"):  # data, unannounced
        decode_header(encode_header([1]) + b"abc", 2)


# -- the round's decision --------------------------------------------------------------------
def test_decide_runs_what_every_member_has_in_the_lowest_members_order() -> None:
    d = DirectMode()
    assert d.decide([(0, [4, 1], b""), (0, [4, 1], b"")]) == [4, 1]
    assert d.decide([(0, [4, 1, 7], b""), (0, [7, 4], b"")]) == [4, 7]
    assert d.decide([(0, [1, 2], b""), (0, [2, 3], b""), (0, [2, 1], b"")]) == [2]


def test_decide_ends_direct_mode_on_other_or_nothing_in_common() -> None:
    d = DirectMode()
    assert d.decide([(0, [1], b""), (OTHER, [1], b"")]) is None
    assert d.decide([(0, [1], b""), (0, [2], b"")]) is None
    assert d.decide([(0, [], b""), (0, [], b"")]) is None


def test_decide_completes_a_barrier_only_when_every_member_waits_in_it() -> None:
    d = DirectMode()
    assert d.decide([(BARRIER, [], b""), (BARRIER, [], b"")]) == []
    assert d.decide([(BARRIER, [3, 1], b""), (BARRIER, [1], b""), (BARRIER, [], b"")]) == []
    assert d.decide([(BARRIER, [3, 1], b""), (BARRIER, [1, 3], b"")]) == [3, 1]
    assert d.decide([(BARRIER, [2], b""), (0, [2], b"")]) == [2]  # the work runs, it waits
    assert d.decide([(BARRIER, [], b""), (0, [2], b"")]) is None
    assert d.decide([(BARRIER, [], b""), (OTHER, [], b"")]) is None


def test_one_hand_over_carries_a_run_of_allreduces_of_one_dtype_within_the_threshold() -> None:
    def spec(name: str, n: int = 4, dtype: str = "float32", **kw: Any) -> TensorSpec:
        return TensorSpec(Request(OpType.ALLREDUCE, name, dtype, (n,), **kw))

    a, b, c = spec("a"), spec("b"), spec("c")  # 16 bytes each
    assert exchange_run([a, b, c], 64) == 3
    assert exchange_run([a, b, c], 32) == 2
    assert exchange_run([a, b, c], 0) == 1  # no fusion: one at a time
    assert exchange_run([a, spec("d", dtype="float64"), c], 64) == 1
    assert exchange_run([a, None, c], 64) == 1  # not cached
    bc = TensorSpec(Request(OpType.BROADCAST, "bc", "float32", (4,), root=0))
    assert exchange_run([bc, a], 64) == 0 and exchange_run([], 64) == 0
    g1, g2 = spec("g1", group="g", group_size=2), spec("g2", group="g", group_size=2)
    assert exchange_run([a, g1, g2, b], 64) == 4
    assert exchange_run([a, g1, b], 64) == 1  # cut before the group that is not all there
    assert exchange_run([g1, b], 64) == 0  # a group goes whole or not at all
    assert exchange_run([g1, g2, b], 8) == 0  # so one too large for the limit does not go


# -- plans -----------------------------------------------------------------------------------
def test_plan_fuses_like_the_coordinator_and_is_kept() -> None:
    a, b, c = _ar("a", 4), _ar("b", 4), _ar("c", 4)
    cache = _cache(a, b, c)
    d = DirectMode()
    d.enter(32)  # two float32[4] fit, the third does not
    plan = d.plan([0, 1, 2], cache)
    assert plan is not None
    assert [r.names for r in plan] == [["allreduce.a", "allreduce.b"], ["allreduce.c"]]
    assert d.plan([0, 1, 2], cache) is plan  # worked out once per id list
    d.enter(0)  # no fusion, and a new direct mode forgets old plans
    again = d.plan([0, 1, 2], cache)
    assert again is not plan and again is not None
    assert [r.names for r in again] == [["allreduce.a"], ["allreduce.b"], ["allreduce.c"]]


def test_plan_puts_higher_priority_first_and_waits_for_whole_groups() -> None:
    low, high = _ar("low"), _ar("high", priority=5)
    g1, g2 = _ar("g1", group="g", group_size=2), _ar("g2", group="g", group_size=2)
    cache = _cache(low, high, g1, g2)
    d = DirectMode()
    d.enter(0)
    plan = d.plan([0, 1], cache)
    assert plan is not None and [r.names for r in plan] == [["allreduce.high"], ["allreduce.low"]]
    assert d.plan([2], cache) is None  # half a group runs nothing
    plan = d.plan([0, 2], cache)
    assert plan is not None and [r.names for r in plan] == [["allreduce.low"]]
    plan = d.plan([2, 3], cache)
    assert plan is not None and [r.names for r in plan] == [["allreduce.g1"], ["allreduce.g2"]]


def test_plan_of_an_unknown_id_is_none() -> None:
    d = DirectMode()
    d.enter(0)
    assert d.plan([9], _cache(_ar("a"))) is None


# -- the coordinator's word ------------------------------------------------------------------
def _coord(size: int = 2, sets: int = 1) -> Coordinator:
    c = Coordinator(1 << 20, 16)
    c.add_set(0, list(range(size)))
    for i in range(1, sets):
        c.add_set(i, list(range(size)))
    c.direct = True
    return c


def _step(c: Coordinator, *reqs: Request, hits: list[int] | None = None) -> list[Any]:
    for rank in range(c.sets[0].size):
        c.on_message(rank, {"ps": 0, "ep": 0, "r": [r.to_wire() for r in reqs],
                            "h": bits_encode(hits or [])})
    out = c.take_responses()
    assert len(out) == 1
    st, responses = out[0]
    return c.encode(st, responses)


def test_direct_follows_a_list_of_tensors_every_member_has_cached() -> None:
    c = _coord()
    first = _step(c, _ar("a"))
    assert [OpType(r[0]) for r in first] == [OpType.ALLREDUCE]  # new: sent in full
    second = _step(c, hits=[0])
    assert [OpType(r[0]) for r in second] == [OpType.ALLREDUCE, OpType.DIRECT]
    # the binary form carries it, and members read the fusion threshold from it
    msg = decode(encode({"t": "resp", "ps": 0, "l": second}))
    cache = _cache(_ar("a"))
    responses = decode_responses(msg["l"], cache)
    assert responses[-1].op == OpType.DIRECT and responses[-1].threshold == 1 << 20


def test_no_direct_while_anything_else_waits_or_with_several_sets() -> None:
    c = _coord(3)
    _step(c, _ar("a"))
    for rank in range(3):  # every rank hits a; ranks 0 and 1 also asked for b
        reqs = [_ar("b").to_wire()] if rank < 2 else []
        c.on_message(rank, {"ps": 0, "ep": 0, "r": reqs, "h": bits_encode([0])})
    [(st, responses)] = c.take_responses(time.monotonic())
    assert [r.op for r in responses] == [OpType.ALLREDUCE]  # b still waits for rank 2
    c = _coord(2, sets=2)
    _step(c, _ar("a"))
    assert [OpType(r[0]) for r in _step(c, hits=[0])] == [OpType.ALLREDUCE]


def test_no_direct_when_turned_off() -> None:
    c = _coord()
    c.direct = False
    _step(c, _ar("a"))
    assert [OpType(r[0]) for r in _step(c, hits=[0])] == [OpType.ALLREDUCE]
