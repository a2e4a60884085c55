"""The bytes each algorithm hora picks moves per rank, counted (hora.transport.tally) and
asserted exactly: an algorithm that starts moving more fails here. Real ranks, real shared
memory and TCP; each case is one float32 Sum allreduce by the native backend.

B is the buffer, n the ranks; a bandwidth-optimal allreduce sends and receives 2(n-1)/n B.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness import run_ranks

SMALL = 16 << 10  # recursive doubling
ARENA = 3 << 20  # through the shared arena (64 KiB < B <= 8 MiB), divisible by 3 and 4
DIRECT = 12 << 20  # the direct allreduce with single-copy reads (one host), hierarchical


def _count(rank: int, sizes: list[int], hosts: list[int] | None,
           cores: int | None) -> dict[int, dict[str, int]]:  # fmt: skip
    import os

    if hosts is not None:
        os.environ["HORA_HOSTNAME"] = f"node{hosts[rank]}"
    import hora as hvd
    import hora.backends.native as native
    from hora.lab.moved import count_one

    if cores is not None:  # a fake: the host's core count the case needs
        native._host_cores = lambda: cores

    hvd.init()
    try:
        return {size: count_one(hvd, size) for size in sizes}
    finally:
        hvd.shutdown()


def _run(np_: int, sizes: list[int], hosts: list[int] | None = None,
         env: dict[str, str] | None = None,
         cores: int | None = None) -> list[dict[int, dict[str, int]]]:  # fmt: skip
    out: list[dict[int, dict[str, int]]] = run_ranks(_count, np_, (sizes, hosts, cores),
                                                     timeout=90, env=env)  # fmt: skip
    return out


def _moved(path: str, sent: float, received: float, copied: float, reduced: float
           ) -> dict[str, Any]:  # fmt: skip
    want = {f"{path} sent": sent, f"{path} received": received, f"{path} copied": copied,
            "reduced": reduced}  # fmt: skip
    return {k: int(v) for k, v in want.items() if v}


def _doubling(path: str, n: int, rank: int, b: int, copies: int) -> dict[str, Any]:
    """Recursive doubling (n = 3 or 4): log2(p) exchanges of B; at n = 3 rank 0 folds into
    rank 1 (one B each way) and rank 1 exchanges with rank 2."""
    if n == 4:
        return _moved(path, 2 * b, 2 * b, copies * 4 * b // 2, 2 * b)
    sent = [b, 2 * b, b][rank]
    reduced = [0, 2 * b, b][rank]
    return _moved(path, sent, sent, copies * sent, reduced)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("crowded", [False, True], ids=["a-core-each", "ranks-outnumber-cores"])
def test_one_host(n: int, crowded: bool) -> None:
    """Where ranks outnumber the host's cores, a large buffer goes through the shared arena
    as a smaller one does (hora.backends.native), else with single-copy reads."""
    got = _run(n, [SMALL, ARENA, DIRECT], cores=1 if crowded else 1024)
    for rank, moved in enumerate(got):
        assert moved[SMALL] == _doubling("inline", n, rank, SMALL, 2), moved[SMALL]
        for b in (ARENA, DIRECT) if crowded else (ARENA,):
            part = b * (n - 1) // n  # the arena: the others' blocks copied in, read by them,
            # the result written into theirs, and theirs copied out
            assert moved[b] == _moved("mapped", part, part, 3 * part, part), moved[b]
        if not crowded:
            part = DIRECT * (n - 1) // n  # reduce-scatter, then allgather: the bound
            assert moved[DIRECT] == _moved("single copy", 2 * part, 2 * part, 2 * part, part)


@pytest.mark.timeout(120)
def test_one_host_without_single_copy_reads() -> None:
    """HORA_SHM_SINGLE_COPY=0 (as under Yama's ptrace_scope=1): a buffer above 8 MiB goes
    through the shared arena as a smaller one does, in segments, instead of the staging slots
    (which would copy 3(n-1)/n B besides)."""
    n = 3
    got = _run(n, [ARENA, DIRECT], env={"HORA_SHM_SINGLE_COPY": "0"})
    for moved in got:
        for b in (ARENA, DIRECT):
            part = b * (n - 1) // n
            assert moved[b] == _moved("mapped", part, part, 3 * part, part), moved[b]


@pytest.mark.timeout(120)
def test_tcp_ring() -> None:
    n = 3
    got = _run(n, [SMALL, ARENA], env={"HORA_SHM_DISABLE": "1"})
    for rank, moved in enumerate(got):
        assert moved[SMALL] == _doubling("tcp", n, rank, SMALL, 2), moved[SMALL]
        part = ARENA * (n - 1) // n
        assert moved[ARENA] == _moved("tcp", 2 * part, 2 * part, 4 * part, part), moved[ARENA]


@pytest.mark.timeout(120)
def test_hierarchical_two_hosts_of_two() -> None:
    """Reduce-scatter in the host, each block allreduced across by the ranks at the same place
    of each host, allgather in the host: every rank moves the bound, 1.5 B at n = 4 (the leader
    used to send 2.5 B: its whole result to the other rank of its host)."""
    got = _run(4, [DIRECT], hosts=[0, 0, 1, 1])
    half = DIRECT // 2
    for moved in got:
        want = {**_moved("single copy", DIRECT, DIRECT, DIRECT, half),
                **_moved("tcp", half, half, 2 * half, half // 2)}  # fmt: skip
        want["reduced"] = half + half // 2
        assert moved[DIRECT] == want, moved[DIRECT]


@pytest.mark.timeout(120)
def test_hierarchical_uneven_hosts() -> None:
    """Hosts of two ranks and one: the leader gathers, allreduces with the other leader and
    scatters the blocks back before the allgather."""
    got = _run(3, [DIRECT], hosts=[0, 0, 1])
    b, half = DIRECT, DIRECT // 2
    leader = {**_moved("single copy", 3 * half, 3 * half, 3 * half, half),
              **_moved("tcp", b, b, 2 * b, half)}  # fmt: skip
    leader["reduced"] = b
    other = _moved("single copy", 3 * half, 3 * half, 3 * half, half)
    alone = _moved("tcp", b, b, 2 * b, half)
    assert [g[DIRECT] for g in got] == [leader, other, alone]
