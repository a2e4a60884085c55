"""The shared arena between real processes: every member maps every other's part, a member that
cannot map them makes every member go without, the allreduce over mapped memory for every dtype
and reduction, and nothing left open or named once it is closed."""

from __future__ import annotations

from typing import Any

import pytest

from harness import run_ranks, spawn_ranks


def _pairs(rank: int) -> tuple[Any, list[Any]]:
    import os

    from hora.transport.shm import ShmTransport

    key = bytes.fromhex(os.environ["HORA_SECRET_KEY"])
    size = int(os.environ["HORA_SIZE"])
    t = ShmTransport(rank, size, key, "test/0", connect_timeout=20)
    return t, [None if i == rank else t.pair(i) for i in range(size)]


def _arena_fds() -> list[int]:
    """This process's open descriptors of arena memory."""
    import os

    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "hora-arena" in target:
            found.append(int(fd))
    return found


def _share(rank: int, refuse: int) -> dict[str, Any]:
    import os

    import numpy as np

    from hora.collectives.allreduce_mapped import signal
    from hora.collectives.base import GroupComm
    from hora.transport.shm import arena as arena_mod

    t, pairs = _pairs(rank)
    comm = GroupComm(t)
    out: dict[str, Any] = {}
    arena = arena_mod.open_arena(pairs, rank, 1 << 20)
    assert arena is not None
    out["nbytes"] = arena.nbytes
    mine = arena.mine(1000, np.dtype(np.int64))
    mine[:] = rank * 1000 + np.arange(1000)
    signal(comm)
    views = arena.views(mine)
    assert views is not None
    out["seen"] = [bool(np.array_equal(v, r * 1000 + np.arange(1000))) for r, v in enumerate(views)]
    out["not a view"] = arena.views(mine[1:]) is None and arena.views(mine.copy()) is None
    # a region asked for again is the same views; as bytes or as float64 it is not the other
    out["regions"] = [str(v[rank].dtype) for v in (
        arena.region(0, 64, np.dtype(np.float64)), arena.region(0, 64), arena.region(0, 64),
        arena.region(0, 64, np.dtype(np.float64)))]
    out["region again"] = arena.region(0, 64) is arena.region(0, 64)
    signal(comm)
    views[(rank + 1) % comm.size][rank] = -1  # a write into the next member's part
    signal(comm)
    out["written"] = int(mine[(rank - 1) % comm.size])
    words = arena.words()[rank]
    out["words at first"] = words.tolist()
    words[:] = rank + 100  # each member's own words, apart from what callers lay out
    signal(comm)
    out["words"] = [w.tolist() for w in arena.words()]
    expected = rank * 1000 + np.arange(1000)
    expected[(rank - 1) % comm.size] = -1
    out["laid out intact"] = bool(np.array_equal(mine, expected))
    del views, mine, words
    arena.close()
    out["fds after close"] = _arena_fds()
    out["dev shm"] = sorted(n for n in os.listdir("/dev/shm") if "hora" in n.lower())
    out["crowded"] = arena.crowded  # no member said its host has more ranks than cores

    # one member says so: every member's arena knows (its single buffers take the arena)
    crowded = arena_mod.open_arena(pairs, rank, 1 << 20, crowded=rank == comm.size - 1)
    assert crowded is not None
    out["crowded when one says so"] = crowded.crowded
    crowded.close()

    # one member cannot map the others' parts: nobody uses an arena, and the pairs still work
    if rank == refuse:
        def refuse_map(pid: int, fd: int, size: int) -> Any:
            raise OSError("refused for the test")

        arena_mod._map = refuse_map
    out["refused"] = arena_mod.open_arena(pairs, rank, 1 << 20) is None
    signal(comm)
    out["fds after refusal"] = _arena_fds()

    # one member's pids name other processes (as across pid namespaces): here it maps its
    # own part in their place, and the tokens show it; again nobody uses an arena
    if rank == refuse:
        def own_part(pid: int, fd: int, size: int) -> Any:
            import mmap

            for n in _arena_fds():  # this process's own arena, same size
                return mmap.mmap(n, size)
            raise OSError("no arena of this process to map")

        arena_mod._map = own_part
    out["wrong process"] = arena_mod.open_arena(pairs, rank, 1 << 20) is None
    signal(comm)
    t.close()
    return out


@pytest.mark.timeout(60)
def test_every_member_maps_every_part_and_a_refusal_stops_all() -> None:
    results = run_ranks(_share, 3, args=(1,), timeout=50)
    for rank, out in enumerate(results):
        assert out["nbytes"] == 1 << 20
        assert out["seen"] == [True, True, True], rank
        assert out["not a view"], rank
        assert out["regions"] == ["float64", "uint8", "uint8", "float64"], rank
        assert out["region again"], rank
        assert out["written"] == -1, rank  # the previous member wrote into this part
        assert out["words at first"] == [0] * 8, rank
        assert out["words"] == [[r + 100] * 8 for r in range(3)], rank
        assert out["laid out intact"], rank
        assert out["fds after close"] == [] and out["dev shm"] == [], rank
        assert out["crowded"] is False and out["crowded when one says so"] is True, rank
        assert out["refused"], f"rank {rank} used an arena another member could not map"
        assert out["fds after refusal"] == [], rank
        assert out["wrong process"], f"rank {rank} used an arena mapped from the wrong process"


CASES = [
    ("float32", "sum"), ("float64", "product"), ("float16", "sum"), ("bfloat16", "sum"),
    ("int32", "min"), ("int64", "max"), ("uint8", "sum"), ("int8", "product"), ("bool", "max"),
    ("bool", "min"),
]


def _allreduce(rank: int, counts: list[int], shared: bool) -> dict[str, Any]:
    import hashlib

    import numpy as np

    from hora.collectives.allreduce_mapped import allreduce_mapped, allreduce_staged
    from hora.collectives.base import GroupComm
    from hora.collectives.reduce_ops import MAX, MIN, PRODUCT, SUM, reducer
    from hora.dtypes import storage_dtype
    from hora.transport.shm.arena import open_arena

    ops = {"sum": SUM, "min": MIN, "max": MAX, "product": PRODUCT}
    t, pairs = _pairs(rank)
    comm = GroupComm(t)
    n = comm.size
    arena = open_arena(pairs, rank, 8 << 20)
    assert arena is not None
    words = arena.words() if shared else None  # the signals through the arena's words
    out: dict[str, Any] = {}
    for dtype, op in CASES:
        for count in counts:
            st = storage_dtype(dtype)
            # small values, so that sums and products stay exact in every dtype
            per = [(np.arange(count) % 3 + r) % 2 + 1 for r in range(n)]
            if dtype == "bool":
                per = [(np.arange(count) + r) % 3 == 0 for r in range(n)]
            if dtype == "bfloat16":
                import ml_dtypes

                vals = [p.astype(ml_dtypes.bfloat16).view(np.uint16) for p in per]
            else:
                vals = [p.astype(st) for p in per]
            buf = arena.mine(count, st)
            buf[:] = vals[rank]
            views = arena.views(buf)
            assert views is not None
            allreduce_mapped(comm, views, reducer(ops[op], dtype), words)
            want = vals[0].copy()
            for v in vals[1:]:
                reducer(ops[op], dtype)(want, v)
            out[f"{dtype} {op} {count}"] = (
                bool(np.array_equal(buf, want)),
                hashlib.sha1(buf.tobytes()).hexdigest(),
            )
            # a buffer outside the arena, staged through it: the same result, in place
            mine = vals[rank].copy()
            allreduce_staged(comm, mine, views, reducer(ops[op], dtype), words=words)
            out[f"staged {dtype} {op} {count}"] = (
                bool(np.array_equal(mine, want)),
                hashlib.sha1(mine.tobytes()).hexdigest(),
            )
            # in segments: views shorter than the buffer
            mine = vals[rank].copy()
            allreduce_staged(comm, mine, [v[: count // 3 + 1] for v in views],
                             reducer(ops[op], dtype), words=words)  # fmt: skip
            out[f"segments {dtype} {op} {count}"] = (
                bool(np.array_equal(mine, want)),
                hashlib.sha1(mine.tobytes()).hexdigest(),
            )
            del views, buf
    out["signals"] = int(arena.words()[rank][1])
    arena.close()
    t.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shared", [False, True], ids=["messages", "words"])
@pytest.mark.parametrize("np_", [2, 3])
def test_allreduce_over_mapped_memory(np_: int, shared: bool) -> None:
    from hora.transport.shm.arena import STORES_IN_ORDER

    if shared and not STORES_IN_ORDER:
        pytest.skip("signals through the arena's words need x86's order of stores")
    counts = [0, 1, 5, 70_001, 300_007]  # the largest spans several pieces per block
    results = run_ranks(_allreduce, np_, args=(counts, shared), timeout=100)
    # two signals per mapped call and per staged segment, counted in each member's word
    segments = [-(-c // s) for c in counts for s in (max(c, 1), c // 3 + 1)]
    want = len(CASES) * (2 * len(counts) + 2 * sum(segments)) if shared else 0
    assert [out.pop("signals") for out in results] == [want] * np_
    for case, (ok, digest) in results[0].items():
        assert ok, f"rank 0: wrong result for {case}"
        for rank, out in enumerate(results[1:], 1):
            assert out[case] == (True, digest), f"rank {rank} differs from rank 0 for {case}"


def _one_goes(rank: int, gone: int) -> dict[str, Any]:
    import os
    import time

    import numpy as np

    from hora.collectives.allreduce_mapped import allreduce_mapped
    from hora.collectives.base import GroupComm
    from hora.collectives.reduce_ops import SUM, reducer
    from hora.errors import TransportError
    from hora.transport.shm.arena import open_arena

    t, pairs = _pairs(rank)
    comm = GroupComm(t)
    arena = open_arena(pairs, rank, 1 << 20)
    assert arena is not None
    buf = arena.mine(1000, np.dtype(np.float32))
    buf[:] = 1
    views = arena.views(buf)
    assert views is not None
    allreduce_mapped(comm, views, reducer(SUM, "float32"), arena.words())
    out: dict[str, Any] = {"first": float(buf[0])}
    if rank == gone:
        os._exit(0)  # gone without a word: the others wait in the first signal
    start = time.monotonic()
    try:
        allreduce_mapped(comm, views, reducer(SUM, "float32"), arena.words())
        out["error"] = None
    except TransportError as e:
        out["error"] = str(e)
    out["seconds"] = time.monotonic() - start
    return out


@pytest.mark.timeout(60)
def test_a_member_gone_during_signals_through_words_raises_on_the_others() -> None:
    from hora.transport.shm.arena import STORES_IN_ORDER

    if not STORES_IN_ORDER:
        pytest.skip("signals through the arena's words need x86's order of stores")
    results = spawn_ranks(_one_goes, 3, args=(2,), timeout=50)
    for r in results[:2]:
        assert r.ok, f"rank {r.rank}: {r.status}\n{r.stderr[-2000:]}"
        assert r.value["first"] == 3.0
        assert r.value["error"] is not None, f"rank {r.rank} went on without member 2"
        assert "closed" in r.value["error"], r.value["error"]
        assert r.value["seconds"] < 20, r.value  # raised, did not hang (the test's bound: 50)
