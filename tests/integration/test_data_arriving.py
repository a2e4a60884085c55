"""Data still arriving when an op is submitted (a CUDA tensor's copy into pinned memory in
flight, in hora.torch): the engine waits for it just before it first reads the array, in the
thread that runs the op, and the caller does not. Real ranks; the "copy" here is a callback
that writes the data, so a read before it would reduce zeros."""

from __future__ import annotations

import pytest

from harness import run_ranks


def _arriving(rank: int) -> dict[str, object]:
    import threading

    import numpy as np

    import hora as hvd
    from hora.frameworks.submit import engine_waits

    hvd.init()
    out: dict[str, object] = {}
    # every path: negotiated in full, then cache hits, then direct mode (with the inputs in
    # the round's headers for the small one), through the engine thread (async)
    for size, label in ((16, "small"), (300_000, "large")):
        sums, threads = [], []
        for _ in range(4):
            x = np.zeros(size, dtype=np.float32)  # the data lands only when ready() runs

            def land(x: np.ndarray = x, threads: list[str] = threads) -> None:
                threads.append(threading.current_thread().name)
                x[...] = rank + 1

            with engine_waits([land]):
                h = hvd.allreduce_async(x, op=hvd.Sum, name=label)
            sums.append(float(hvd.synchronize(h)[-1]))
        out[label] = (sums, threads)
    # a group: each tensor's own wait
    xs = [np.zeros(8, dtype=np.float32), np.zeros(3, dtype=np.float64)]
    calls: list[int] = []

    def land_i(i: int) -> None:
        calls.append(i)
        xs[i][...] = (rank + 1) * (i + 1)

    with engine_waits([lambda: land_i(0), lambda: land_i(1)]):
        h = hvd.grouped_allreduce_async(xs, op=hvd.Sum, name="group")
    got = hvd.synchronize(h)
    out["group"] = ([float(g[0]) for g in got], sorted(calls))
    # a later submission without the context carries no wait
    plain = hvd.allreduce(np.full(4, 1.0), op=hvd.Sum, name="plain")
    out["plain"] = float(plain[0])
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
def test_the_engine_waits_for_data_still_arriving() -> None:
    for out in run_ranks(_arriving, 2, timeout=90):
        for label in ("small", "large"):
            sums, threads = out[label]  # type: ignore[misc]
            assert sums == [3.0] * 4, (label, sums)  # 1 + 2: the landed data, never zeros
            assert threads == ["hora-engine"] * 4, (label, threads)  # not the caller's
        sums, calls = out["group"]  # type: ignore[misc]
        assert sums == [3.0, 6.0] and calls == [0, 1], out["group"]
        assert out["plain"] == 2.0, out
