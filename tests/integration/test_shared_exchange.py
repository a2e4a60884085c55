"""Direct mode's shared exchange (hora.core.fastpath, hora.backends.native.exchange_slot): two
members on one host put an allreduce's input of 64 KiB to 8 MiB in an exchange slot of the
set's shared arena and each reduces the other's straight out of it, so the op is one exchange
of headers. Real ranks: the same bits as the backend's own allreduce for every dtype and
reduction, in place, out of place and into a given output, with scaling; and back-to-back
ops with one rank late at random, where a slot reused too early would show as a wrong sum."""

from __future__ import annotations

import pytest

from harness import run_ranks


def _stats() -> dict[str, int]:
    from hora.core import runtime

    return dict(runtime.runtime().engine.stats)


def _same_bits(rank: int) -> dict[str, object]:
    import hashlib

    import numpy as np

    import hora as hvd

    hvd.init()
    rng = np.random.default_rng(rank)
    out: dict[str, object] = {}
    ops = {"sum": hvd.Sum, "avg": hvd.Average, "min": hvd.Min, "max": hvd.Max,
           "prod": hvd.Product}
    digest = hashlib.sha256()
    before = _stats()
    for dtype in ("float32", "float64", "float16", "int32", "int64", "uint8", "bool"):
        for label, op in ops.items():
            if dtype == "bool" and label in ("avg", "prod"):
                continue
            x = (rng.standard_normal(70_001) * 10).astype(dtype)  # 70 KB to 560 KB
            scaled = dtype != "bool"
            got = []
            # the first through the backend (which opens the arena), the second as cache
            # hits, the later ones in direct mode, through the shared exchange
            for _ in range(4):
                got.append(hvd.allreduce(x, op=op, name=f"{dtype}.{label}",
                                         prescale_factor=0.5 if scaled else 1.0,
                                         postscale_factor=3.0 if scaled else 1.0))
            out[f"{dtype}.{label}"] = all(g.tobytes() == got[0].tobytes() for g in got[1:])
            digest.update(got[-1].tobytes())
    # in place, into a given output, bfloat16 storage
    buf = np.arange(40_000, dtype=np.float32) * (rank + 1)
    for _ in range(4):
        hvd.allreduce(buf, op=hvd.Sum, output=buf, name="inplace")
    out["inplace"] = bool(np.array_equal(buf, np.arange(40_000) * 3.0 * 2**3))
    src = np.full(50_000, rank + 1, dtype=np.float64)
    dst = np.zeros_like(src)
    for _ in range(4):
        hvd.allreduce(src, op=hvd.Average, output=dst, name="given")
    out["given"] = bool(np.all(dst == 1.5) and np.all(src == rank + 1))
    bf = np.full(40_000, 0x3F80, dtype=np.uint16)  # bfloat16 1.0
    for _ in range(4):
        res = hvd.allreduce(bf, op=hvd.Sum, dtype="bfloat16", name="bf16")
    out["bf16"] = bool(np.all(res == 0x4000)) and bool(np.all(bf == 0x3F80))  # 2.0; input kept
    after = _stats()
    out["shared"] = after["exchanged_shared"] - before["exchanged_shared"]
    out["digest"] = digest.hexdigest()
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
def test_the_shared_exchange_gives_the_backends_bits() -> None:
    results = run_ranks(_same_bits, 2, timeout=100)
    assert results[0]["digest"] == results[1]["digest"]  # the same bits on both ranks
    for out in results:
        shared = out.pop("shared")
        out.pop("digest")
        bad = [k for k, v in out.items() if v is not True]
        assert not bad, bad
        # 31 dtype and op cases plus 3 more, each exchanged twice or more through the arena
        assert int(shared) >= 2 * 34, shared  # type: ignore[call-overload]


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
