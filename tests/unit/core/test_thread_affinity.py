"""HOROVOD_THREAD_AFFINITY: one core per local rank for its engine thread; bad values are
refused with what to give instead."""

from __future__ import annotations

import os
from typing import Any

import pytest

from harness import run_ranks
from hora.core.placement import engine_core
from hora.core.runtime import ROUND_SPIN_S, SHARED_SPIN_S
from hora.identity import Identity


def _ident(local_rank: int, local_size: int) -> Identity:
    return Identity(rank=local_rank, size=local_size, local_rank=local_rank,
                    local_size=local_size, cross_rank=0, cross_size=1, hostname="h")  # fmt: skip


def test_each_local_rank_takes_its_core() -> None:
    assert engine_core(_ident(0, 2), "") is None
    assert engine_core(_ident(0, 2), "1,0") == 1
    assert engine_core(_ident(1, 2), "1,0") == 0


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("a,b", "expected core ids separated by commas, one per local rank"),
        ("0", "names 1 core(s) for 2 local ranks: give one core id per local rank"),
        ("0,100000", "local rank 1 cannot run on core 100000; this host has cores 0-"),
    ],
)
def test_bad_values_say_what_to_give(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match="HOROVOD_THREAD_AFFINITY") as info:
        engine_core(_ident(1, 2), spec)
    assert says in str(info.value)


def _pinned(rank: int) -> dict[str, Any]:
    import os

    import hora
    from hora.core.runtime import runtime

    hora.init()
    try:
        # read before the allreduce: after it, the other rank may shut down first, which ends
        # this rank's engine thread
        engine = sorted(os.sched_getaffinity(runtime().engine.thread_id))
        total = hora.allreduce(__import__("numpy").ones(4), op=hora.Sum)
        return {"engine": engine, "main": sorted(os.sched_getaffinity(0)), "sum": float(total[0])}
    finally:
        hora.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin ranks to")
def test_two_local_ranks_pin_their_engine_threads() -> None:
    a, b = sorted(os.sched_getaffinity(0))[:2]
    env = {"HOROVOD_THREAD_AFFINITY": f"{b},{a}", "HORA_CPU_BIND": "none"}
    results = run_ranks(_pinned, 2, env=env, timeout=50)
    assert [r["engine"] for r in results] == [[b], [a]]
    assert all(r["sum"] == 2.0 for r in results)
    assert all(len(r["main"]) >= 2 for r in results)  # only the engine thread was pinned


def _affinity(rank: int) -> list[int]:
    import os

    import hora

    hora.init()
    try:
        return sorted(os.sched_getaffinity(0))
    finally:
        hora.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to bind ranks to")
def test_ranks_are_not_bound_to_cores_by_default() -> None:
    """Binding slows whatever else a training process runs (its torch threads, DataLoader
    workers), so ranks keep every core unless HORA_CPU_BIND=auto asks otherwise."""
    if {"HORA_CPU_BIND", "HOROVOD_CPU_BIND"} & set(os.environ):
        pytest.skip("the environment sets the CPU binding")
    before = sorted(os.sched_getaffinity(0))
    assert run_ranks(_affinity, 2, timeout=50) == [before, before]


@pytest.mark.timeout(60)
@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) != (os.cpu_count() or 0) or (os.cpu_count() or 0) < 2,
    reason="needs an unbound process on at least two cores",
)
def test_cpu_bind_auto_gives_each_local_rank_its_own_cores() -> None:
    first, second = run_ranks(_affinity, 2, env={"HORA_CPU_BIND": "auto"}, timeout=50)
    assert first and second and not set(first) & set(second)


def test_an_unknown_cpu_bind_value_is_refused() -> None:
    from hora.core.placement import bind_cpus

    with pytest.raises(ValueError, match="HORA_CPU_BIND='yes'.*'none'.*'auto'"):
        bind_cpus(_ident(0, 2), "yes", [0, 1], 1)
    bind_cpus(_ident(0, 1), "NONE", [0, 1], 1)  # case does not matter; nothing to do


def test_a_process_bound_by_its_launcher_keeps_the_cores_it_was_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """mpirun or Slurm gave this rank 4 of a host's 64 cores: its pools get those 4, not a
    share of the whole host (nor 1)."""
    from hora.core import placement as rt

    asked: list[int] = []
    def hook(share: int) -> tuple[int, bool]:
        asked.append(share)
        return share, False

    monkeypatch.setattr(rt, "_thread_hooks", [hook])
    monkeypatch.setattr(rt.os, "sched_getaffinity", lambda pid: {8, 9, 10, 11})
    ident = Identity(rank=1, size=16, local_rank=1, local_size=16, cross_rank=0, cross_size=1,
                     hostname="h")  # fmt: skip
    assert rt.share_threads(ident, None) == 4
    assert rt.share_threads(ident, list(range(64))) == 4  # unbound: 64 cores / 16 ranks
    assert asked == [4, 4]


def test_a_caller_polls_for_round_headers_only_where_each_local_rank_has_a_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Polling without sleeping takes a core; where the ranks share cores it would take one
    from the rank being waited for."""
    from hora.core import placement as rt

    assert rt.core_each(_ident(0, 2), [0, 1])
    assert not rt.core_each(_ident(0, 4), [0, 1])
    # bound by a launcher: only the cores it was bound to count
    monkeypatch.setattr(rt.os, "sched_getaffinity", lambda pid: {3})
    assert not rt.core_each(_ident(0, 2), None)
    monkeypatch.setattr(rt.os, "sched_getaffinity", lambda pid: {2, 3})
    assert rt.core_each(_ident(1, 2), None)


def _spin_setting(rank: int) -> tuple[float, bool]:
    import hora as hvd
    from hora.core import runtime

    hvd.init()
    try:
        engine = runtime.runtime().engine
        return engine.spin_s, engine.spin_yield
    finally:
        hvd.shutdown()


@pytest.mark.timeout(60)
def test_ranks_with_a_core_each_poll_briefly_and_more_ranks_than_cores_yield_between_polls(
) -> None:  # fmt: skip
    cores = len(os.sched_getaffinity(0))
    for n in (2, 4):
        want = (ROUND_SPIN_S, False) if cores >= n else (SHARED_SPIN_S, True)
        assert run_ranks(_spin_setting, n, timeout=50) == [want] * n, (n, cores)


_CORES = sorted(os.sched_getaffinity(0))


def _affinity_and_child(rank: int) -> tuple[list[int], list[int], list[int]]:
    """This rank's cores after init(), those of a child it forks then (a DataLoader worker's),
    and its cores after shutdown()."""
    import os

    import hora

    hora.init()
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its cores, then out at once
            os.write(write, ",".join(map(str, sorted(os.sched_getaffinity(0)))).encode())
            os._exit(0)
        os.close(write)
        child = [int(c) for c in os.read(read, 4096).decode().split(",")]
        os.close(read)
        os.waitpid(pid, 0)
        mine = sorted(os.sched_getaffinity(0))
    finally:
        hora.shutdown()
    return mine, child, sorted(os.sched_getaffinity(0))


@pytest.mark.timeout(90)
@pytest.mark.skipif(
    len(_CORES) != (os.cpu_count() or 0) or len(_CORES) > 3,
    reason="needs an unbound process on at most three cores (one rank more than cores)",
)
@pytest.mark.parametrize(
    ("env", "bound"),
    [
        ({"OMP_NUM_THREADS": "1"}, True),  # the default, crowded
        ({"OMP_NUM_THREADS": "1", "HORA_CPU_BIND": "none"}, False),
        ({"OMP_NUM_THREADS": "2"}, False),  # two threads would time-share one core
    ],
)
def test_more_ranks_than_cores_take_one_core_each_in_turn(env: dict[str, str],
                                                          bound: bool) -> None:  # fmt: skip
    """Where ranks outnumber cores, the default deals the cores out, one to each rank, so that
    the kernel never runs all but one rank on one core; not where binding is turned off, nor
    where a rank's threads would have to share its core. A child a rank forks (a DataLoader
    worker) gets every core back either way, as does the rank at shutdown()."""
    if {"HORA_CPU_BIND", "HOROVOD_CPU_BIND"} & set(os.environ):
        pytest.skip("the environment sets the CPU binding")
    n = len(_CORES) + 1
    got = run_ranks(_affinity_and_child, n, env=env, timeout=80)
    ranks = [r for r, _, _ in got]
    if bound:
        assert ranks == [[_CORES[r % len(_CORES)]] for r in range(n)]
    else:
        assert ranks == [_CORES] * n
    assert [c for _, c, _ in got] == [_CORES] * n
    assert [after for _, _, after in got] == [_CORES] * n
