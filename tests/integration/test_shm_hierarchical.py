"""Hierarchical allreduce and allgather with ranks that pretend to live on two hosts.

Each rank sets ``HORA_HOSTNAME`` before ``init``: ranks of one pretend host talk over shared
memory, ranks of different ones over TCP, and the collectives reduce inside each host, across
the hosts' leaders, then share inside each host. Forced by the Horovod knobs, or chosen
automatically for large buffers; the choice is in the debug log."""

from __future__ import annotations

from typing import Any

import pytest

from harness import spawn_ranks

HIERARCHICAL = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_HIERARCHICAL_ALLGATHER": "1"}
DEBUG = {"HORA_LOG_LEVEL": "DEBUG"}
LAYOUTS = {"contiguous": [0, 0, 1, 1], "interleaved": [0, 1, 0, 1]}  # pretend host per rank


def _job(rank: int, hosts: list[int]) -> dict[str, Any]:
    import hashlib
    import os

    import numpy as np

    os.environ["HORA_HOSTNAME"] = f"node{hosts[rank]}"
    import hora as hvd
    from hora.core import runtime
    from hora.transport.base import DATA

    subset = hvd.ProcessSet([0, 1, 3])  # hosts with two ranks and with one
    hvd.init(process_sets=[subset])
    size = hvd.size()
    transport = runtime.runtime().engine.transport
    out: dict[str, Any] = {"bad": [], "kinds": {}}
    for peer in range(size):
        if peer != rank:
            same = hosts[peer] == hosts[rank]
            kind = type(transport.pair(peer, DATA)).__name__
            out["kinds"][peer] = (same, kind)
    digest = hashlib.sha256()
    for n in (1, 37, 100_003, 1_500_001):  # small ones and ones above the automatic threshold
        for dtype, op, name in ((np.float32, hvd.Sum, "sum"), (np.int64, hvd.Max, "max")):
            x = (np.arange(n) % 7 + rank).astype(dtype)
            got = hvd.allreduce(x, op=op, name=f"ar.{n}.{name}")
            xs = np.array([(np.arange(n) % 7 + r) for r in range(size)])
            want = xs.sum(0) if name == "sum" else xs.max(0)
            if not np.array_equal(got, want.astype(dtype)):
                out["bad"].append(f"allreduce {name} {n}")
            digest.update(got.tobytes())
        avg = hvd.allreduce(np.full(n, float(rank)), op=hvd.Average, name=f"avg.{n}")
        if not np.allclose(avg, (size - 1) / 2):
            out["bad"].append(f"average {n}")
        counts = [n // 3 + 5 * r for r in range(size)]
        part = np.tile(np.arange(counts[rank])[:, None] + 1000 * rank, (1, 3)).astype(np.int32)
        got = hvd.allgather(part, name=f"ag.{n}")
        want = np.concatenate([np.arange(counts[r]) + 1000 * r for r in range(size)])
        if got.shape != (sum(counts), 3) or not np.array_equal(got[:, 2], want):
            out["bad"].append(f"allgather {n}")
    if rank in (0, 1, 3):
        got = hvd.allreduce(
            np.full(200_000, rank + 1.0), op=hvd.Sum, name="sub", process_set=subset
        )
        if not np.array_equal(got, np.full(200_000, 1.0 + 2 + 4)):
            out["bad"].append("subset allreduce")
        got = hvd.allgather(np.full((rank + 1, 2), rank), name="subag", process_set=subset)
        if got[:, 0].tolist() != [0, 1, 1, 3, 3, 3, 3]:
            out["bad"].append("subset allgather")
    hvd.barrier()  # a rank that shuts down shuts the job down
    hvd.shutdown()
    out["digest"] = digest.hexdigest()
    return out


def _check(results: list[Any]) -> None:
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.status}\n{r.value}\n{r.stderr[-3000:]}"
        assert r.value["bad"] == [], (r.rank, r.value["bad"])
        for peer, (same_host, kind) in r.value["kinds"].items():
            assert kind == ("ShmPair" if same_host else "TcpPair"), (r.rank, peer, kind)
    assert len({r.value["digest"] for r in results}) == 1, "ranks disagree on some result"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_forced_hierarchical_collectives_on_two_pretend_hosts(layout: str) -> None:
    env = {**HIERARCHICAL, **DEBUG}
    results = spawn_ranks(_job, 4, args=(LAYOUTS[layout],), timeout=200, env=env, local_size=2)
    _check(results)
    for r in results:
        assert "allreduce: hierarchical (2 hosts, up to 2 ranks per host)" in r.stderr
        assert "allgather: hierarchical (2 hosts, up to 2 ranks per host)" in r.stderr


@pytest.mark.timeout(240)
def test_hierarchical_is_chosen_automatically_for_large_buffers() -> None:
    results = spawn_ranks(
        _job, 4, args=(LAYOUTS["contiguous"],), timeout=200, env=DEBUG, local_size=2
    )
    _check(results)
    for r in results:
        assert "allreduce: hierarchical (auto)" in r.stderr
        assert "allgather: hierarchical (auto)" in r.stderr
        assert "allreduce: hierarchical (2" not in r.stderr  # not forced


@pytest.mark.timeout(240)
def test_tcp_only_hierarchical_still_agrees() -> None:
    env = {**HIERARCHICAL, **DEBUG, "HORA_SHM_DISABLE": "1"}
    results = spawn_ranks(
        _job, 4, args=(LAYOUTS["contiguous"],), timeout=200, env=env, local_size=2
    )
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.status}\n{r.value}\n{r.stderr[-3000:]}"
        assert r.value["bad"] == [], (r.rank, r.value["bad"])
        assert {kind for _, kind in r.value["kinds"].values()} == {"TcpPair"}
        assert "allreduce: hierarchical" in r.stderr
