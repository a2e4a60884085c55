"""A burst of large and small tensors through every way the engine can execute a fused
allreduce: the tensors reduced where they lie as one gathered buffer (shared memory), the large
ones reduced in place with the small ones in the fusion buffer (TCP only), and all of them in
the fusion buffer (a fusion threshold below the large tensors never fuses them, so they take
the single-tensor path; and, over shared memory, many small tensors, which cost less copied
into one buffer than gathered piece by piece; over shared memory the fusion buffer is the set's
shared arena, reduced where it lies). In place and out of place, Sum and Average with scaling
factors. The timeline and the backend's count of arena allreduces say which way each burst
went."""

from __future__ import annotations

from typing import Any

import pytest

from harness import run_ranks

# floats; 4 above 1 MiB, 13 MB in all: above the size that goes through the shared arena
# (hora.backends.native.MAPPED_MAX_BYTES), so shared memory gathers them where they lie
SHAPES = [(3,), (700_000,), (5, 7), (0,), (300_000,), (1,), (520_000,), (1_800_000,)]
# 1.2 MB in all, as 40 tensors of 30 KB: above the size that shared memory gathers where the
# tensors lie, but small tensors on average (hora.backends.native.PARTS_MIN_BYTES)
MANY_SMALL = [(7_500,)] * 40


def _burst(rank: int, shapes: list[tuple[int, ...]] = SHAPES) -> dict[str, Any]:
    import numpy as np

    import hora as hvd
    from hora.core.runtime import runtime

    hvd.init()
    n = hvd.size()
    stats = runtime().engine.stats
    backend = runtime().engine.executor.backend
    fused_before, mapped_before, gathered_before = stats["fused"], backend.mapped, backend.gathered
    out: dict[str, Any] = {}
    for step in range(3):  # the first burst negotiates in full, the later ones from the cache
        xs = [(np.arange(int(np.prod(s))) % 23 + rank + step).reshape(s).astype(np.float32)
              for s in shapes]
        want = [sum((np.arange(x.size) % 23 + r + step) for r in range(n)).reshape(x.shape)
                for x in xs]
        keep = [x.copy() for x in xs]
        hs = [hvd.allreduce_async(x, op=hvd.Sum, name=f"out.{i}") for i, x in enumerate(xs)]
        res = [hvd.synchronize(h) for h in hs]
        out[f"sum out of place {step}"] = all(
            np.array_equal(r, w) for r, w in zip(res, want)
        ) and all(np.array_equal(x, k) for x, k in zip(xs, keep))  # inputs untouched
        hs = [
            hvd.allreduce_async_(x, op=hvd.Average, prescale_factor=2.0, postscale_factor=0.5,
                                 name=f"in.{i}")
            for i, x in enumerate(xs)
        ]
        for h in hs:
            hvd.synchronize(h)
        out[f"average in place {step}"] = all(
            np.allclose(x, w / n, rtol=1e-6) for x, w in zip(xs, want)
        )
    out["fused"] = stats["fused"] - fused_before
    out["mapped"] = backend.mapped - mapped_before
    out["gathered"] = backend.gathered - gathered_before
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("env", "shapes", "way"),
    [
        ({}, SHAPES, "gathered"),
        ({"HORA_SHM_DISABLE": "1"}, SHAPES, "split"),
        ({"HOROVOD_FUSION_THRESHOLD": "65536"}, SHAPES, "arena"),
        ({}, MANY_SMALL, "arena"),
    ],
    ids=["gathered-shared-memory", "split-tcp", "small-threshold", "many-small-shared-memory"],
)
def test_fused_bursts_of_large_and_small_tensors(
    env: dict[str, str], shapes: list[tuple[int, ...]], way: str, tmp_path: Any
) -> None:
    timeline = tmp_path / "timeline.json"
    env = {**env, "HOROVOD_TIMELINE": str(timeline)}
    for rank, out in enumerate(run_ranks(_burst, 2, args=(shapes,), timeout=90, env=env)):
        fused, mapped, gathered = out.pop("fused"), out.pop("mapped"), out.pop("gathered")
        bad = [k for k, ok in out.items() if not ok]
        assert not bad, f"rank {rank}: wrong results for {bad}"
        assert fused > 0, f"rank {rank}: no tensor travelled in a fused response"
        counts = f"rank {rank}: {gathered} gathered, {mapped} in the arena"
        if way == "gathered":  # how the bursts split into responses varies: one at least
            assert gathered > 0, counts
        elif way == "split":  # over TCP: no arena, no gather
            assert gathered == 0 and mapped == 0, counts
        else:  # the fusion buffer is the set's shared arena, reduced in place there
            assert gathered == 0 and mapped > 0, counts
    # the fusion buffer's copies appear in the timeline whenever small tensors went through it
    if way != "gathered":
        assert "MEMCPY_IN_FUSION_BUFFER" in timeline.read_text()
