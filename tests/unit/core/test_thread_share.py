"""Each rank's torch thread pool gets its share of the host's cores at init() when the user chose
no size, said once per host; a size the user chose is kept; ``HORA_CPU_BIND=auto`` binds a
rank only where its threads fit its slice of cores. Real ranks, real torch."""

from __future__ import annotations

import os
from typing import Any

import pytest

from harness import spawn_ranks

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
pytestmark = pytest.mark.skipif(
    len(CORES) != 2 or os.cpu_count() != 2,
    reason="the expected shares are worked out for an unbound process on exactly two cores",
)


def _threads(rank: int, omp: str | None, user_threads: int | None) -> dict[str, Any]:
    import os

    if omp is None:  # the harness sets OMP_NUM_THREADS=1; this rank runs as if nobody had
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp
    import torch

    if user_threads is not None:
        torch.set_num_threads(user_threads)
    before = torch.get_num_threads()
    import hora.torch as hvd

    hvd.init()
    try:
        total = hvd.allreduce(torch.ones(3), op=hvd.Sum)
        return {
            "before": before,
            "after": torch.get_num_threads(),
            "cores": sorted(os.sched_getaffinity(0)),
            "sum": total.tolist(),
        }
    finally:
        hvd.shutdown()


def _run(omp: str | None, user_threads: int | None, bind: str, level: str = "info") -> list[Any]:
    results = spawn_ranks(_threads, 2, args=(omp, user_threads), timeout=90,
                          env={"HORA_CPU_BIND": bind, "HOROVOD_LOG_LEVEL": level})  # fmt: skip
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.status}\n{r.stderr[-3000:]}"
        assert r.value["sum"] == [2.0, 2.0, 2.0]
    return results


SAID = "OMP_NUM_THREADS is not set: each of the 2 ranks on this host runs 1 intra-op thread"


@pytest.mark.timeout(120)
def test_unset_threads_become_each_ranks_share_said_once() -> None:
    first, second = _run(None, None, "none")
    assert [first.value["before"], second.value["before"]] == [2, 2]  # torch's own default
    assert [first.value["after"], second.value["after"]] == [1, 1]  # 2 cores / 2 ranks
    assert first.value["cores"] == second.value["cores"] == CORES  # HORA_CPU_BIND=none
    assert SAID in first.stderr and first.stderr.count(SAID) == 1
    assert SAID not in second.stderr  # local rank 0 says it for the host


@pytest.mark.timeout(120)
def test_the_share_is_information_not_a_warning_at_the_default_log_level() -> None:
    for r in _run(None, None, "none", level="warning"):  # hora's default level
        assert r.value["after"] == 1  # the share is still taken
        assert "OMP_NUM_THREADS" not in r.stderr and "WARNING" not in r.stderr, r.stderr


@pytest.mark.timeout(120)
def test_threads_the_user_chose_are_kept_and_not_bound_when_they_do_not_fit() -> None:
    for r in _run("2", None, "auto"):  # OMP_NUM_THREADS=2: two threads on a one-core slice
        assert r.value["after"] == 2
        assert r.value["cores"] == CORES  # left unbound: binding would halve its cores
        assert "OMP_NUM_THREADS is not set" not in r.stderr


@pytest.mark.timeout(120)
def test_auto_binds_ranks_whose_threads_fit_their_slice() -> None:
    shared = _run(None, None, "auto")  # the share (1 thread) fits a one-core slice
    chosen = _run(None, 1, "auto")  # torch.set_num_threads(1) before init(): kept, fits
    for first, second in (shared, chosen):
        assert first.value["after"] == second.value["after"] == 1
        assert len(first.value["cores"]) == len(second.value["cores"]) == 1
        assert set(first.value["cores"]) | set(second.value["cores"]) == set(CORES)
    assert "OMP_NUM_THREADS is not set" not in chosen[0].stderr

