"""Mailboxes in a set's shared arena (hora.transport.shm.mailbox): real ranks, real mappings.

Every member posts one message per turn and reads every other member's before its next, as a
direct-mode round does; messages larger than a mailbox go on the pairs, in order with the rest.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness import run_ranks


def _lockstep(rank: int, turns: int) -> dict[str, Any]:
    import os
    import time

    import numpy as np

    from hora.transport.shm import ShmTransport
    from hora.transport.shm.arena import open_arena
    from hora.transport.shm.mailbox import Mailboxes

    key = bytes.fromhex(os.environ["HORA_SECRET_KEY"])
    size = int(os.environ["HORA_SIZE"])
    t = ShmTransport(rank, size, key, "test/0", connect_timeout=20)
    pairs = [None if i == rank else t.pair(i) for i in range(size)]
    arena = open_arena(pairs, rank, 1 << 16)
    assert arena is not None
    boxes = Mailboxes(arena)
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
