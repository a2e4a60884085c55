"""The last collective of a job completes on every rank, however early rank 0 shuts down.

Rank 0 completes its last ``broadcast_object`` and calls ``hvd.shutdown()`` at once, while the
other ranks are still finishing that same broadcast: an op every rank agreed to runs to the
end on every rank, and only ops never agreed fail with the shutdown error. The steady state
(a repeated, cached broadcast) runs in direct mode (:mod:`hora.core.fastpath`), where members
agree among themselves; one rank's agreement reaches some of its peers late (its direct-mode
headers to the ranks other than 0 are held back for a moment in that last op). Real ranks over
real shared-memory connections; every test has a hard timeout.
"""

from __future__ import annotations

import pytest

from harness import spawn_ranks


def _last_broadcast(rank: int, steps: int, delay: float) -> dict[str, object]:
    import time

    import hora as hvd
    from hora.core import runtime
    from hora.transport.shm.pair import ShmPair

    hvd.init()
    size = hvd.size()
    late = [False]
    if rank == size - 1:  # in the last op, this rank's messages to ranks 1.. arrive late
        send_msg = ShmPair.send_msg

        def held_back(self: ShmPair, payload: bytes) -> None:
            if late[0] and self.peer != 0:
                time.sleep(delay)
            send_msg(self, payload)

        ShmPair.send_msg = held_back  # type: ignore[method-assign]
    got = []
    out: dict[str, object] = {}
    try:
        for i in range(steps):
            late[0] = i == steps - 1
            value = ("step", 100 + i) if rank == 0 else None  # one pickled length: cached
            got.append(hvd.broadcast_object(value, 0, name="pending"))
    except hvd.HorovodInternalError as e:
        out["error"] = str(e)
    out["ok"] = got == [("step", 100 + i) for i in range(steps)]
    out["direct_rounds"] = runtime.runtime().engine.stats["direct_rounds"]
    if rank == 0:
        hvd.shutdown()  # at once: the others may still be inside the last broadcast
    else:
        time.sleep(0.2)
        try:  # never agreed: rank 0 is gone, so this fails with the shutdown error
            hvd.broadcast_object(None, 0, name="after")
            out["after"] = "completed?!"
        except hvd.HorovodInternalError as e:
            out["after"] = str(e)
        hvd.shutdown()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [3, 5])
def test_last_broadcast_completes_on_every_rank_when_rank_0_shuts_down_first(np_: int) -> None:
    results = spawn_ranks(_last_broadcast, np_, (40, 0.5), timeout=90)
    for r in results:
        assert r.ok, (r.rank, r.status, r.value, r.stderr[-3000:])
        out = r.value
        assert "error" not in out and out["ok"], (r.rank, out)
        assert out["direct_rounds"] > 0, (r.rank, out)  # the steady state was direct mode
        if r.rank:
            after = str(out["after"])
            assert "has been shut down" in after and "rank 0" in after, (r.rank, out)
