"""Where a host runs more ranks than it has cores, a set of more than two members reduces
every single buffer above the small-message sizes through its shared arena, at any size
(hora.backends.native: the single-copy reads' messages each wake a rank that may wait for a
core), and fused responses of large tensors too; where each rank has a core, buffers above
MAPPED_MAX_BYTES take the single-copy reads, and such fused responses are gathered where their
tensors lie. Up to 64 KiB there, a single buffer takes one wait: direct mode's headers, or the
backend's post in the mailboxes, every member reducing every input.
Real ranks; the host's core count is faked (``_host_cores``) so that both cases run on any
machine. Results are checked, blocking and not, in place and not, Sum and Average."""

from __future__ import annotations

from typing import Any

import pytest

from harness import run_ranks


def _init(cores: int) -> Any:
    """``hora``, initialized on a host faked to have ``cores`` cores."""
    import hora as hvd
    import hora.backends.native as native

    native._host_cores = lambda: cores  # a fake: the host's core count the test needs
    hvd.init()
    return hvd


def _large(rank: int, cores: int) -> dict[str, Any]:
    import numpy as np

    import hora.backends.native as native
    from hora.core.runtime import runtime

    hvd = _init(cores)
    n = hvd.size()
    count = (native.MAPPED_MAX_BYTES + (4 << 20)) // 4  # 12 MiB of float32
    base = np.arange(count, dtype=np.float32) % 101
    want = base * n * (n + 1) / 2
    backend = runtime().engine.executor.backend
    before = backend.mapped
    ok = []
    for _ in range(4):  # negotiated, then from the cache, then in direct mode
        x = base * (rank + 1)
        ok.append(np.array_equal(hvd.allreduce(x, op=hvd.Sum, name="blocking"), want))
        ok.append(np.array_equal(x, base * (rank + 1)))  # the input as it was
        h = hvd.allreduce_async_(x, op=hvd.Average, name="in_place")
        hvd.synchronize(h)
        ok.append(np.allclose(x, want / n))
    mapped = backend.mapped - before
    # a fused response above MAPPED_MAX_BYTES of large tensors: gathered where they lie
    # with single-copy reads, or through the arena
    gathered = backend.gathered
    parts = [base[: count // 3] * (rank + 1) for _ in range(4)]
    for _ in range(3):
        got = hvd.grouped_allreduce(parts, op=hvd.Sum, name="fused")
        ok.append(all(np.array_equal(g, want[: count // 3]) for g in got))
    gathered = backend.gathered - gathered
    hvd.shutdown()
    return {"ok": all(ok), "mapped": mapped, "gathered": gathered}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("cores", "crowded"), [(1, True), (1024, False)],
                         ids=["ranks-outnumber-cores", "a-core-each"])  # fmt: skip
def test_large_single_buffers_take_the_arena_where_ranks_outnumber_cores(
        cores: int, crowded: bool) -> None:  # fmt: skip
    for rank, out in enumerate(run_ranks(_large, 3, args=(cores,), timeout=90)):
        assert out["ok"], rank
        # eight allreduces of 12 MiB: all in the arena, or none
        assert out["mapped"] == (8 if crowded else 0), (rank, out)
        # three fused responses of 16 MiB: gathered where they lie only with a core each
        assert out["gathered"] == (0 if crowded else 3), (rank, out)


def _medium(rank: int, cores: int) -> dict[str, Any]:
    import numpy as np

    from hora.core.runtime import runtime

    hvd = _init(cores)
    engine = runtime().engine
    # 48 KiB of float32 whose sums round differently in different orders
    x = np.random.default_rng(rank).standard_normal(12 << 10).astype(np.float32)
    first = hvd.allreduce(x, op=hvd.Sum, name="m")  # negotiated: the backend's own call
    later = [hvd.allreduce(x, op=hvd.Sum, name="m") for _ in range(3)]  # into direct mode
    before = dict(engine.stats)
    mapped = engine.executor.backend.mapped
    later += [hvd.allreduce(x, op=hvd.Sum, name="m") for _ in range(20)]
    got = {k: engine.stats[k] - before.get(k, 0) for k in ("lane", "exchanged", "spread")}
    hvd.shutdown()
    return {"same bits": all(np.array_equal(r, first) for r in later),
            "mapped": engine.executor.backend.mapped - mapped, **got}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("cores", "crowded"), [(1, True), (1024, False)],
                         ids=["ranks-outnumber-cores", "a-core-each"])  # fmt: skip
def test_a_medium_allreduce_goes_in_the_headers_where_ranks_outnumber_cores(
        cores: int, crowded: bool) -> None:  # fmt: skip
    """48 KiB at np=4: where ranks outnumber cores, in the round's headers, every member
    reducing every input (one wait for the others); with a core each, staged through the arena
    (the headers only up to 64 KiB / (n - 1)). Either way the bits of the backend's own call."""
    for rank, out in enumerate(run_ranks(_medium, 4, args=(cores,), timeout=90)):
        assert out["same bits"], rank
        assert out["lane"] == 20, (rank, out)
        if crowded:
            assert out["exchanged"] == 20 and out["spread"] == 0 and out["mapped"] == 0, out
        else:
            assert out["spread"] == 20 and out["exchanged"] == 0 and out["mapped"] == 20, out


def _posted(rank: int, cores: int) -> dict[str, Any]:
    import os

    import numpy as np

    from hora.transport import tally

    os.environ["HORA_FAST_PATH"] = "0"  # every allreduce a call of the backend's
    hvd = _init(cores)
    n = hvd.size()
    wrong, moved = [], []

    def reads(before: dict[str, int], nbytes: int) -> None:  # each other member's input read
        moved.append(tally.since(before).get("mapped received", 0) // (nbytes * (n - 1)))
    for count, op in ((12 << 10, hvd.Sum), (1 << 10, hvd.Average), (16 << 10, hvd.Average)):
        x = np.random.default_rng(rank + count).standard_normal(count).astype(np.float32)
        name = f"t{count}"
        first = hvd.allreduce(x, op=op, name=name)  # on the pairs: the arena may not be open
        for i in range(6):
            before = tally.snapshot()
            got = hvd.allreduce(x, op=op, name=name) if i % 2 else \
                hvd.allreduce(x.copy(), op=op, name=name, output=None)
            reads(before, x.nbytes)
            if not np.array_equal(got, first):
                wrong.append(f"{count} call {i}")
        inplace = x.copy()
        hvd.allreduce(inplace, op=op, name=name, output=inplace)
        if not np.array_equal(inplace, first):
            wrong.append(f"{count} in place")
    # other dtypes and ops, through the mailboxes now that the arena is open: every rank's
    # inputs are known everywhere, so the result is checked against NumPy's
    for dtype, op, reduce in (("int32", hvd.Sum, np.sum), ("int64", hvd.Min, np.min),
                              ("float64", hvd.Max, np.max), ("uint8", hvd.Max, np.max),
                              ("float16", hvd.Sum, np.sum), ("bool", hvd.Max, np.max)):
        ins = [(np.arange(3000) * (r + 3) % 17).astype(dtype) for r in range(n)]
        before = tally.snapshot()
        got = hvd.allreduce(ins[rank], op=op, name=f"d{dtype}")
        reads(before, ins[0].nbytes)
        want = reduce(np.stack(ins), axis=0).astype(dtype)
        if got.dtype != want.dtype or not np.array_equal(got, want):
            wrong.append(f"{dtype} {op}")
    hvd.shutdown()
    return {"wrong": wrong, "moved": moved}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [3, 4])
def test_small_buffers_go_through_the_mailboxes_where_ranks_outnumber_cores(np_: int) -> None:
    """Where ranks outnumber cores the backend reduces a single buffer up to 64 KiB after one
    wait: every member posts it in its mailbox and reduces all of them where they lie, with
    the bits of the recursive doubling on the pairs it takes before the arena is open."""
    for rank, out in enumerate(run_ranks(_posted, np_, args=(1,), timeout=100)):
        assert out["wrong"] == [], (rank, out["wrong"])
        assert out["moved"] == [1] * 24, (rank, out["moved"])  # each member's read once
