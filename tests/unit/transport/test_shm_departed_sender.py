"""A frame sent in full is received in full, even when its sender has closed the pair since
(it finished its op and left): the receiver drains what was sent before it reports the peer
gone. Real processes over real shared-memory pairs, staged (a single-copy send waits for the
receiver's acknowledgement, so its sender cannot leave first)."""

from __future__ import annotations

from typing import Any

import pytest

from harness import spawn_ranks


def _sent_then_gone(rank: int, nbytes: int) -> dict[str, Any]:
    import os
    import time

    import numpy as np

    from hora.errors import TransportError
    from hora.transport.shm import ShmTransport

    key = bytes.fromhex(os.environ["HORA_SECRET_KEY"])
    t = ShmTransport(rank, 2, key, "test/gone", connect_timeout=20, single_copy=False)
    pair = t.pair(1 - rank)
    data = (np.arange(nbytes, dtype=np.int64) % 251).astype(np.uint8)
    out: dict[str, Any] = {}
    if rank == 0:  # a staged send is done once written: no acknowledgement awaited
        pair.isend(memoryview(data)).wait()
        pair.send_msg(b"after")
        t.close()
        return out
    time.sleep(1.0)  # rank 0 has closed its end by now
    got = np.empty(nbytes, np.uint8)
    try:
        pair.recv_into(memoryview(got))
        out["same"] = bool(np.array_equal(got, data))
        out["message"] = pair.recv_msg().decode()
    except TransportError as e:
        out["error"] = str(e)
    try:  # nothing more was sent: now the peer is gone
        pair.recv_msg()
        out["then"] = "received?!"
    except TransportError as e:
        out["then"] = str(e)
    t.close()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nbytes", [1000, 3 << 20], ids=["inline", "two-slots"])
def test_a_staged_frame_from_a_sender_that_left_arrives_whole(nbytes: int) -> None:
    results = spawn_ranks(_sent_then_gone, 2, (nbytes,), timeout=45)
    assert all(r.ok for r in results), [(r.value, r.stderr[-2000:]) for r in results]
    out = results[1].value
    assert out.get("same") and out.get("message") == "after", out
    assert "closed" in out["then"] and "rank 0" in out["then"], out
