"""A single allreduce into an output the caller gave, the input only read (hora.core.executor's
``_apart``): every path the native backend picks by size (the small-message path, the staged
copy through the shared arena, the two-rank write-apart round over single copy, the direct
allreduce among three ranks), shared memory and TCP, the input read-only as TensorFlow hands
its tensors over. Negotiated calls only: direct mode is off, so each call reaches the backend
(the exchange round has its own test in test_direct_mode.py). Real ranks; hard timeouts."""

from __future__ import annotations

from typing import Any

import pytest

from harness import run_ranks

# 4 KiB (one exchange), 400 KB (staged through the arena), 12 MB (reduced where it lies; between
# two ranks, through the arena up to 16 MiB, so only the float64 case's 24 MB lies where it is)
COUNTS = (1_000, 100_003, 3_000_017)


def _into_output(rank: int, shm: bool) -> dict[str, Any]:
    import os

    os.environ["HORA_FAST_PATH"] = "0"  # every call negotiated: the backend runs it
    if not shm:
        os.environ["HORA_SHM_DISABLE"] = "1"
    import numpy as np

    import hora as hvd
    from hora.core.runtime import runtime

    hvd.init()
    n = hvd.size()
    out: dict[str, Any] = {"bad": []}
    for count in COUNTS:
        for dtype, op in (("float32", hvd.Sum), ("float64", hvd.Average), ("int32", hvd.Max)):
            base = np.arange(count) % 11
            x = (base + rank).astype(dtype)
            x.flags.writeable = False  # read-only, as a TensorFlow tensor's view is
            dst = np.full(count, -7, dtype=dtype)
            for i in range(2):  # the second call finds its pages written before
                got = hvd.allreduce(x, op=op, output=dst, name=f"o.{count}.{dtype}.{i}")
                want = {
                    hvd.Sum: base * n + sum(range(n)),
                    hvd.Average: base + (n - 1) / 2,
                    hvd.Max: base + n - 1,
                }[op].astype(dtype)
                if not np.shares_memory(got, dst) or not np.array_equal(dst, want):
                    out["bad"].append(f"{count} {dtype} call {i}: result")
                if not np.array_equal(x, (base + rank).astype(dtype)):
                    out["bad"].append(f"{count} {dtype} call {i}: input changed")
    out["direct_rounds"] = runtime().engine.stats.get("direct_rounds", 0)
    hvd.shutdown()
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("size", "shm"), [(1, True), (2, True), (3, True), (2, False)],
                         ids=["np1", "np2-shm", "np3-shm", "np2-tcp"])  # fmt: skip
def test_allreduce_into_a_given_output_reads_the_input_only(size: int, shm: bool) -> None:
    for rank, out in enumerate(run_ranks(_into_output, size, args=(shm,), timeout=120)):
        assert not out["bad"], f"rank {rank}: {out['bad']}"
        assert out["direct_rounds"] == 0, out  # negotiated: the backend made every result


def _overlapping(rank: int) -> bool:
    import numpy as np

    import hora as hvd

    hvd.init()
    ok = True
    for count in COUNTS:
        buf = (np.arange(count + 1) % 13 + rank).astype(np.float64)
        want = (np.arange(count) % 13) * 2 + 1.0
        # the output one element past the input: the result must not read what it wrote
        hvd.allreduce(buf[:count], op=hvd.Sum, output=buf[1:], name=f"overlap.{count}")
        ok = ok and bool(np.array_equal(buf[1:], want))
    hvd.shutdown()
    return ok


@pytest.mark.timeout(90)
def test_an_output_over_part_of_the_input_gets_the_right_result() -> None:
    assert all(run_ranks(_overlapping, 2, timeout=60))
