"""The conformance battery over shared memory (the default between ranks of one host), over
shared memory without single-copy reads (``HORA_SHM_SINGLE_COPY=0``, where a host with Yama's
``ptrace_scope=1`` goes) and over TCP only (``HORA_SHM_DISABLE=1``), and large reductions,
which take the direct shared-memory allreduce (or, staged, the shared arena in segments), for
every dtype and op. Real processes; every test has a hard timeout."""

from __future__ import annotations

from typing import Any

import cloudpickle
import pytest

from conformance import battery
from conformance.battery import CHECKS, run_battery
from harness import spawn_ranks

cloudpickle.register_pickle_by_value(battery)  # the workers cannot import the tests' packages

NO_SHM = {"HORA_SHM_DISABLE": "1"}
STAGED = {"HORA_SHM_SINGLE_COPY": "0"}
MODES = {"shm": None, "shm-staged": STAGED, "tcp-only": NO_SHM}
DEBUG = {"HORA_LOG_LEVEL": "DEBUG"}


def _pair_kinds(rank: int) -> list[str]:
    """The class of this rank's DATA and CONTROL pairs to every other rank (a shared-memory
    one with how it moves payloads)."""
    from hora.core import runtime
    from hora.transport.base import CONTROL, DATA

    transport = runtime.runtime().engine.transport
    kinds = []
    for peer in range(transport.size):
        if peer != rank:
            data = transport.pair(peer, DATA)
            mode = {True: " single-copy", False: " staged", None: ""}
            kinds.append(type(data).__name__ + mode[getattr(data, "single_copy", None)])
            kinds.append(type(transport.pair(peer, CONTROL)).__name__)
    return kinds


def _battery_with_pairs(rank: int) -> dict[str, Any]:
    import hora as hvd

    hvd.init()
    kinds = _pair_kinds(rank)
    return {"kinds": kinds, "battery": run_battery(rank)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("np_", "mode"), [(2, "shm"), (3, "shm"), (3, "shm-staged"), (2, "tcp-only"), (3, "tcp-only")]
)
def test_battery(np_: int, mode: str) -> None:
    results = spawn_ranks(_battery_with_pairs, np_, timeout=200, env=MODES[mode])
    data = {"shm": "ShmPair single-copy", "shm-staged": "ShmPair staged"}.get(mode, "TcpPair")
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.status}\n{r.value}\n{r.stderr[-3000:]}"
        want = [data, "TcpPair"] * (np_ - 1)
        assert r.value["kinds"] == want, r.value["kinds"]
        for check in CHECKS:
            assert r.value["battery"].get(check) == "ok", (
                f"rank {r.rank} {check}:\n{r.value['battery'].get(check)}"
            )


def _large(rank: int) -> dict[str, Any]:
    import hashlib

    import numpy as np

    import hora as hvd
    import hora.backends.native as native

    # a fake: a core for each rank, as on most hosts (where ranks outnumber cores, sets of
    # three take the arena at every size instead of the single-copy reads below:
    # test_crowded_arena.py)
    native._host_cores = lambda: 1024
    hvd.init()
    size = hvd.size()
    ops = {"sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}
    ops["average"] = hvd.Average
    dtypes = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]
    dtypes += ["bool", "bfloat16"]
    n = 300_007  # odd, several inline frames or bulk frames per rank, above 64 KiB for uint8
    bad, digest = [], hashlib.sha256()

    def np_dtype(name: str) -> Any:
        if name == "bfloat16":
            import ml_dtypes

            return ml_dtypes.bfloat16
        return np.dtype(name)

    def value(r: int, dtype: str, op: str) -> np.ndarray:
        if dtype == "bool":
            return (np.arange(n) + r) % 2 == 0
        base = (np.arange(n) + r) % 2 + 1 if op == "product" else np.arange(n) % 5 + r + 1
        return base.astype(np_dtype(dtype))

    for dtype in dtypes:
        for name, op in ops.items():
            if dtype == "bool" and name == "average":
                continue
            got = hvd.allreduce(value(rank, dtype, name), op=op, name=f"{dtype}.{name}")
            xs = np.array([value(r, dtype, name) for r in range(size)]).astype(np.float64)
            want = {"sum": xs.sum(0), "average": xs.sum(0) / size, "min": xs.min(0)}.get(
                name, xs.max(0) if name == "max" else xs.prod(0)
            )
            if dtype == "bool":
                want = want != 0 if name in ("sum", "max") else xs.all(0)
            elif name == "average" and np.dtype(np_dtype(dtype)).kind in "iu":
                want = np.trunc(want)
            ok = np.allclose(np.asarray(got).astype(np.float64), want.astype(np.float64), atol=0.05)
            if not ok:
                bad.append(f"{dtype} {name}")
            digest.update(np.ascontiguousarray(got).tobytes())
    # in place: 5 MiB through the shared arena, 9 MiB read where it lies (single copy) among
    # three ranks and through the arena between two, 17 MiB read where it lies; without
    # single-copy reads, all through the arena in 2 MiB segments
    for mib in (5, 9, 17):
        ramp = (np.arange(mib * (1 << 18) + 3) % 1_000_003).astype(np.float32)  # sums exact
        big = ramp * (rank + 1)
        hvd.allreduce(big, op=hvd.Sum, output=big, name=f"big{mib}")
        want = ramp * (size * (size + 1) // 2)
        if not np.array_equal(big, want):
            bad.append(f"{mib} MiB float32 in place")
    counts = [70_000 + 13 * r for r in range(size)]
    gathered = hvd.allgather(np.full((counts[rank], 2), rank, np.float64), name="gather")
    if not np.array_equal(gathered[:, 0], np.repeat(np.arange(size), counts)):
        bad.append("allgather")
    hvd.shutdown()
    return {"bad": bad, "digest": digest.hexdigest()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("single_copy", [True, False], ids=["single-copy", "staged"])
def test_large_reductions_every_dtype_and_op_over_shared_memory(np_: int, single_copy: bool
                                                                ) -> None:  # fmt: skip
    env = DEBUG if single_copy else {**DEBUG, **STAGED}
    results = spawn_ranks(_large, np_, timeout=200, env=env)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.status}\n{r.value}\n{r.stderr[-3000:]}"
        assert r.value["bad"] == [], r.value["bad"]
        arena = f"allreduce: shared arena for process set 0 of {np_} members: mapped"
        assert arena in r.stderr
        mode = "single-copy" if single_copy else "staged"
        assert f"(shared memory), {mode}, open)" in r.stderr
        # single buffers above 8 MiB: read where they lie, or staged through the arena
        assert ("allreduce: direct over shared memory" in r.stderr) is single_copy
    # each block is reduced by one rank and then copied: every rank holds the same bits
    assert len({r.value["digest"] for r in results}) == 1
