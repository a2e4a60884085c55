"""Mailboxes in a set's shared arena (hora.transport.shm.mailbox): real ranks, real mappings.

Every member posts one message per turn and reads every other member's before its next, as a
direct-mode round does; messages larger than a mailbox go on the pairs, in order with the rest.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness import run_ranks


def _opened(rank: int) -> tuple[Any, list[Any], Any, Any]:
    """This rank's transport, its pairs (None at its own place), the set's arena, and its
    mailboxes."""
    import os

    from hora.transport.shm import ShmTransport
    from hora.transport.shm.arena import open_arena
    from hora.transport.shm.mailbox import Mailboxes

    key = bytes.fromhex(os.environ["HORA_SECRET_KEY"])
    size = int(os.environ["HORA_SIZE"])
    t = ShmTransport(rank, size, key, "test/0", connect_timeout=20)
    pairs = [None if i == rank else t.pair(i) for i in range(size)]
    arena = open_arena(pairs, rank, 1 << 16)
    assert arena is not None
    return t, pairs, arena, Mailboxes(arena)


def _lockstep(rank: int, turns: int) -> dict[str, Any]:
    import os
    import time

    import numpy as np

    size = int(os.environ["HORA_SIZE"])
    t, pairs, arena, boxes = _opened(rank)
    capacity = boxes.capacity

    def message(member: int, turn: int) -> bytes:
        # every seventh turn too large for a mailbox; the others of varied sizes, empty too
        n = capacity + 1000 if turn % 7 == 3 else (turn * 37 + member * 11) % 3000
        return bytes((member + turn + i) % 251 for i in range(n))

    wrong: list[str] = []
    on_pairs = 0
    at: set[int] = set()
    for turn in range(turns):
        mine = message(rank, turn)
        # written in parts (a header and the data after it), or whole
        count, fits = boxes.begin((mine[:5], mine[5:]) if turn % 2 else (mine,))
        if not fits:
            on_pairs += 1
            for p in pairs:
                if p is not None:
                    p.send_msg(mine)
        boxes.commit(count)
        if rank == turn % size:
            time.sleep(0.002)  # one member late now and then: the others wait for its post
        for j, p in enumerate(pairs):
            if p is None:
                continue
            while not boxes.posted(j, count):
                pass
            got = boxes.take(j, count, p)  # a view of the mailbox, or the pair's bytes
            if bytes(got) != message(j, turn):
                wrong.append(f"turn {turn} from {j}: {len(got)} bytes")
            if turn % 7 != 3 and len(got):  # where a post lies in its mailbox
                at.add(np.frombuffer(got, np.uint8).ctypes.data % 64)
    out = {"wrong": wrong, "on pairs": on_pairs, "count": count, "at": sorted(at)}
    del boxes
    arena.close()
    t.close()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np_", [2, 3, 4])
def test_posts_in_lockstep_reach_every_member_intact(np_: int) -> None:
    turns = 120
    for rank, out in enumerate(run_ranks(_lockstep, np_, args=(turns,), timeout=80)):
        assert out["wrong"] == [], f"rank {rank}: {out['wrong'][:5]}"
        assert out["count"] == turns, rank
        assert out["on pairs"] == len([t for t in range(turns) if t % 7 == 3]), rank
        # 8-aligned for any dtype, and a lane header's inputs, 24 bytes in, on a cache line
        assert out["at"] == [40], (rank, out["at"])


def _lanes(rank: int, turns: int) -> dict[str, Any]:
    import os

    import numpy as np

    size = int(os.environ["HORA_SIZE"])
    t, pairs, arena, boxes = _opened(rank)
    start = bytes(range(1, 25))
    lane = boxes.lane(start, 400, np.dtype(np.float32))
    assert lane is not None
    assert boxes.lane(start, boxes.capacity, np.dtype(np.uint8)) is None  # too large
    wrong: list[str] = []
    seen: dict[str, int] = {"lane": 0, "other": 0}
    x = np.empty(100, np.float32)
    for turn in range(turns):
        x[:] = np.arange(100) + 1000 * rank + turn
        # the lane's header posted either way (whoever's turn begins it as any post), or,
        # every fifth turn by the last member, another header of the same size
        other = turn % 5 == 4 and rank == size - 1
        head = bytes(24) if other else start
        if other or (turn + rank) % 3 == 0:
            count, fits = boxes.begin((head, x.view(np.uint8)))
            assert fits
            boxes.commit(count)
        else:
            count, _ = boxes.lane_round(lane, x.view(np.uint8), 0.0, False)
        while not boxes.all_posted(count):
            pass
        inputs = boxes.lane_inputs(lane, count)
        expect_lane = not (turn % 5 == 4 and size - 1 != rank)
        if (inputs is not None) != expect_lane:
            wrong.append(f"turn {turn}: read as the lane's: {inputs is not None}")
        seen["lane" if inputs is not None else "other"] += 1
        for j, p in enumerate(pairs):
            if p is None:
                continue
            got = bytes(boxes.take(j, count, p))  # what any round reads, the same bytes
            want = np.arange(100, dtype=np.float32) + 1000 * j + turn
            other_j = turn % 5 == 4 and j == size - 1
            if got != (bytes(24) if other_j else start) + want.tobytes():
                wrong.append(f"turn {turn} from {j}: taken")
            if inputs is not None and not np.array_equal(inputs[j], want):
                wrong.append(f"turn {turn} from {j}: inputs where they lie")
        if inputs is not None and inputs[rank] is not None:
            wrong.append(f"turn {turn}: this member's place not None")
    out = {"wrong": wrong, "seen": seen}
    del boxes, lane, inputs
    arena.close()
    t.close()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np_", [3, 4])
def test_a_lanes_posts_read_as_any_post_and_its_inputs_where_they_lie(np_: int) -> None:
    """A lane's posts (:meth:`Mailboxes.lane_round`) and the same header posted as any other
    (:meth:`Mailboxes.begin`) are one and the same to every reader; a header that differs is
    never taken for the lane's."""
    turns = 60
    for rank, out in enumerate(run_ranks(_lanes, np_, args=(turns,), timeout=80)):
        assert out["wrong"] == [], f"rank {rank}: {out['wrong'][:5]}"
        others = 0 if rank == np_ - 1 else turns // 5
        assert out["seen"] == {"lane": turns - others, "other": others}, rank
