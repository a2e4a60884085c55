"""Direct mode's shared exchange (hora.core.fastpath, hora.backends.native.exchange_slot): two
members on one host put an allreduce's input of 64 KiB to 32 MiB in an exchange slot of the
set's shared arena and each reduces the other's straight out of it, so the op is one exchange
of headers. Back-to-back ops with one rank late at random, where a slot reused too early would
show as a wrong sum (test_direct_mode checks the bits for every dtype and reduction)."""

from __future__ import annotations

import pytest

from harness import run_ranks


def _stats() -> dict[str, int]:
    from hora.core import runtime

    return dict(runtime.runtime().engine.stats)


def _late_at_random(rank: int, steps: int) -> dict[str, object]:
    import random
    import time

    import numpy as np

    import hora as hvd

    hvd.init()
    rnd = random.Random(rank)
    big = np.zeros(1 << 18, dtype=np.float32)  # 1 MiB
    small = np.zeros(20_000, dtype=np.float64)  # 160 KB: the two take turns in the slots
    ramp_big = np.arange(big.size, dtype=np.float32) % 1000
    ramp_small = np.arange(small.size, dtype=np.float64)
    wrong = []
    before = _stats()
    for step in range(steps):
        if rank == 1 and rnd.random() < 0.3:
            time.sleep(rnd.random() * 0.002)
        big[...] = ramp_big + rank + step
        hvd.allreduce(big, op=hvd.Sum, output=big, name="big")
        if not np.array_equal(big, 2 * ramp_big + 1 + 2 * step):
            wrong.append(f"big {step}")
        small[...] = ramp_small * (rank + 1) - step
        got = hvd.allreduce(small, op=hvd.Sum, name="small")
        if not np.array_equal(got, ramp_small * 3 - 2 * step):
            wrong.append(f"small {step}")
    shared = _stats()["exchanged_shared"] - before["exchanged_shared"]
    hvd.shutdown()
    return {"wrong": wrong, "shared": shared}


@pytest.mark.timeout(120)
def test_back_to_back_exchanges_with_a_late_rank_never_read_a_reused_slot() -> None:
    steps = 300
    for out in run_ranks(_late_at_random, 2, args=(steps,), timeout=100):
        assert out["wrong"] == [], out["wrong"][:10]
        assert int(out["shared"]) >= 2 * steps - 10, out["shared"]  # type: ignore[call-overload]
