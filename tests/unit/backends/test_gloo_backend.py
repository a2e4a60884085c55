"""The Gloo backend on its own: hora's store as a torch Store, and two backends (ranks 0 and 1,
one thread each, real Gloo over loopback) running every collective directly, without the
engine. Each thread is joined with a timeout, so a hang fails the test."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from backend_ranks import run_two_ranks  # noqa: E402

from hora.backends.base import SetComm  # noqa: E402
from hora.backends.gloo import GlooBackend, StoreAdapter  # noqa: E402
from hora.backends.registry import BackendContext  # noqa: E402
from hora.collectives.reduce_ops import MAX, MIN, PRODUCT, SUM  # noqa: E402
from hora.identity import Identity  # noqa: E402
from hora.rendezvous.client import StoreClient  # noqa: E402
from hora.settings import load  # noqa: E402


@pytest.mark.timeout(30)
def test_store_adapter_prefixes_and_converts(store: list[StoreClient]) -> None:
    a = StoreAdapter(store[0], "p/")
    a.set("k", "text")
    a.set("b", b"\x00\x01")
    assert store[1].get("p/k") == b"text" and a.get("b") == b"\x00\x01"
    assert a.add("n", 2) == 2 and a.add("n", 3) == 5
    assert a.check(["k", "b"]) and not a.check(["k", "missing"])
    a.wait(["k"])
    with pytest.raises(Exception, match="not set within"):
        from datetime import timedelta

        a.wait(["missing"], timedelta(seconds=0.2))


def _loop_nices() -> list[int]:
    """The nice value of every Gloo TCP loop thread of this process (Linux; else empty)."""
    tasks = "/proc/self/task"
    out = []
    for tid in os.listdir(tasks) if os.path.isdir(tasks) else []:
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                if f.read().strip() == "gloo_tcp_loop":
                    out.append(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread (of the other rank's work, say) ended meanwhile
    return out


def _two_ranks(store: list[StoreClient], work: Callable[[GlooBackend, SetComm], Any]) -> list[Any]:
    """Run ``work`` on ranks 0 and 1 at once; their results, or the first error."""

    def make(ctx: BackendContext) -> GlooBackend:
        backend = GlooBackend(ctx)
        backend.add_process_set(0, [0, 1])
        backend.add_process_set(1, [1])  # a set rank 0 is not in
        return backend

    return run_two_ranks(store, make, work)


@pytest.mark.timeout(60)
def test_every_collective_between_two_ranks(store: list[StoreClient]) -> None:
    def work(b: GlooBackend, comm: SetComm) -> dict[str, Any]:
        r = comm.rank
        out: dict[str, Any] = {}
        for dtype, op in [("float32", SUM), ("int64", PRODUCT), ("float16", MAX),
                          ("uint8", MIN), ("bool", SUM), ("bool", PRODUCT)]:  # fmt: skip
            x = (np.arange(5) + r + 1).astype(dtype) if dtype != "bool" else np.array([r, 0, 1])
            x = x.astype(dtype)
            b.allreduce(comm, x, dtype, op)
            out[f"{dtype}.{op}"] = x.tolist()
        bf = np.array([0x3F80, 0x4000], dtype=np.uint16)  # bfloat16 1.0, 2.0
        b.allreduce(comm, bf, "bfloat16", SUM)
        out["bf16"] = bf.tolist()
        recv = np.empty(3, np.float64)
        b.allgatherv(comm, np.full(1 + r, 10.0 + r), recv, [1, 2])
        out["gather"] = recv.tolist()
        buf = np.array([r, r], dtype=np.int16)
        b.broadcast(comm, buf, 1)
        out["bcast"] = buf.tolist()
        send = np.arange(3, dtype=np.int32) + 10 * r
        got = np.empty(3, np.int32)
        b.alltoallv(comm, send, [1, 2] if r == 0 else [2, 1], got, [1, 2] if r == 0 else [2, 1])
        out["a2a"] = got.tolist()
        part = np.empty(2 - r, np.float32)
        b.reducescatterv(comm, np.arange(3, dtype=np.float32), part, [2, 1], "float32", SUM)
        out["rs"] = part.tolist()
        b.barrier(comm)
        out["loop_nice"] = _loop_nices()
        return out

    o0, o1 = _two_ranks(store, work)
    assert o0["float32.1"] == o1["float32.1"] == [3.0, 5.0, 7.0, 9.0, 11.0]
    assert o0["int64.5"] == [2, 6, 12, 20, 30]
    assert o0["float16.4"] == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert o1["uint8.3"] == [1, 2, 3, 4, 5]
    assert o0["bool.1"] == o1["bool.1"] == [True, False, True]  # or
    assert o0["bool.5"] == [False, False, True]  # and
    assert o0["bf16"] == [0x4000, 0x4080]  # 2.0, 4.0
    assert o0["gather"] == o1["gather"] == [10.0, 11.0, 11.0]
    assert o0["bcast"] == o1["bcast"] == [1, 1]
    # rank 0 sends [0] to itself and [1, 2] to rank 1; rank 1 sends [10, 11] to 0, [12] to itself
    assert o0["a2a"] == [0, 10, 11] and o1["a2a"] == [1, 2, 12]
    assert o0["rs"] == [0.0, 2.0] and o1["rs"] == [4.0]
    # Gloo's busy-polling TCP loop threads yield to the others (see gloo._lower_loop_priority)
    if os.path.isdir("/proc/self/task"):
        assert o0["loop_nice"] and all(n == 19 for n in o0["loop_nice"]), o0["loop_nice"]


@pytest.mark.timeout(30)
def test_world_of_one_needs_no_store() -> None:
    backend = GlooBackend(BackendContext(Identity(), load({})))
    backend.add_process_set(0, [0])
    comm = SetComm([0], 0, None, 0)  # type: ignore[arg-type]
    x = np.arange(4, dtype=np.int16)  # int16: hora's own algorithm (nothing to do at size 1)
    backend.allreduce(comm, x, "int16", SUM)
    y = np.arange(4, dtype=np.float64)
    backend.allreduce(comm, y, "float64", SUM)
    assert x.tolist() == [0, 1, 2, 3] and y.tolist() == [0.0, 1.0, 2.0, 3.0]
    backend.barrier(comm)
    backend.close()


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_loop_threads_are_lowered_as_soon_as_each_group_exists() -> None:
    # Gloo's threads name themselves only once running; right after a group is made, some
    # may still carry the creator's name, which a single look at the thread names would miss.
    def loops() -> dict[int, int]:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() == "gloo_tcp_loop":
                        out[int(tid)] = os.getpriority(os.PRIO_PROCESS, int(tid))
            except (FileNotFoundError, ProcessLookupError):
                continue
        return out

    earlier = set(loops())
    backend = GlooBackend(BackendContext(Identity(), load({})))
    try:
        for ps_id in range(8):
            backend.add_process_set(ps_id, [0])
        time.sleep(0.2)  # every thread has named itself by now: a missed one shows at nice 0
        new = {t: n for t, n in loops().items() if t not in earlier}
        assert new and all(n == 19 for n in new.values()), new
    finally:
        backend.close()
