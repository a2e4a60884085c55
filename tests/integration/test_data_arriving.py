"""Data still arriving when an op is submitted (a CUDA tensor's copy into pinned memory in
flight, in hora.torch): the engine waits for it just before it first reads the array, in the
thread that runs the op, and the caller does not. Real ranks; the "copy" here is a callback
that writes the data, so a read before it would reduce zeros."""

from __future__ import annotations

import pytest

from harness import run_ranks


def _arriving(rank: int) -> dict[str, object]:
    import threading

    import numpy as np

    import hora as hvd
    from hora.frameworks.submit import engine_waits

    hvd.init()
    out: dict[str, object] = {}
    # every path: negotiated in full, then cache hits, then direct mode (with the inputs in
    # the round's headers for the small one), through the engine thread (async)
    for size, label in ((16, "small"), (300_000, "large")):
        sums, threads = [], []
        for _ in range(4):
            x = np.zeros(size, dtype=np.float32)  # the data lands only when ready() runs

            def land(x: np.ndarray = x, threads: list[str] = threads) -> None:
                threads.append(threading.current_thread().name)
                x[...] = rank + 1

            with engine_waits([land]):
                h = hvd.allreduce_async(x, op=hvd.Sum, name=label)
            sums.append(float(hvd.synchronize(h)[-1]))
        out[label] = (sums, threads)
    # a group: each tensor's own wait
    xs = [np.zeros(8, dtype=np.float32), np.zeros(3, dtype=np.float64)]
    calls: list[int] = []

    def land_i(i: int) -> None:
        calls.append(i)
        xs[i][...] = (rank + 1) * (i + 1)

    with engine_waits([lambda: land_i(0), lambda: land_i(1)]):
        h = hvd.grouped_allreduce_async(xs, op=hvd.Sum, name="group")
    got = hvd.synchronize(h)
    out["group"] = ([float(g[0]) for g in got], sorted(calls))
    # a later submission without the context carries no wait
    plain = hvd.allreduce(np.full(4, 1.0), op=hvd.Sum, name="plain")
    out["plain"] = float(plain[0])
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
def test_the_engine_waits_for_data_still_arriving() -> None:
    for out in run_ranks(_arriving, 2, timeout=90):
        for label in ("small", "large"):
            sums, threads = out[label]  # type: ignore[misc]
            assert sums == [3.0] * 4, (label, sums)  # 1 + 2: the landed data, never zeros
            assert threads == ["hora-engine"] * 4, (label, threads)  # not the caller's
        sums, calls = out["group"]  # type: ignore[misc]
        assert sums == [3.0, 6.0] and calls == [0, 1], out["group"]
        assert out["plain"] == 2.0, out


def _arriving_torch(rank: int) -> dict[str, object]:
    """hora.torch's ops on "device" tensors staged through pinned memory on the fake runtime:
    each tensor is produced by work still queued on the caller's stream, so its copy into
    pinned memory lands only when someone waits on the "copied" event."""
    import threading

    import torch

    import hora.torch as hvd
    from hora.torch import adapter, async_ops
    from hora.torch.device import FakeCudaRuntime

    fake = FakeCudaRuntime()
    waited: dict[int, str] = {}  # event id -> the thread that waited on it
    staged: list[int] = []  # the "copied" events of the tensors staged
    fake_sync = fake.event_synchronize

    def recording_sync(event: object) -> None:
        waited.setdefault(event.id, threading.current_thread().name)  # type: ignore[attr-defined]
        fake_sync(event)  # type: ignore[arg-type]

    def stage(t: torch.Tensor, what: str = "tensor", runtime: object = None,
              defer: bool = False, alone: bool = False) -> adapter.Staged:  # fmt: skip
        s = adapter.stage_device(t, fake, defer)
        staged.append(s.event.id)
        return s

    fake.event_synchronize = recording_sync  # type: ignore[method-assign]
    async_ops.stage = stage  # CPU tensors stand in for CUDA ones
    async_ops.to_tensor = lambda a, like, runtime=None: adapter.to_device(a, like, fake)

    def produced(value: float, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
                 ) -> torch.Tensor:  # fmt: skip
        t = torch.zeros(shape, dtype=dtype)
        fake.enqueue(fake.current_stream(t.device), lambda: t.fill_(value), "produce")
        return t

    def landed(x: object) -> object:
        """What the caller's stream sees once its queued work (the way back) has run."""
        fake.event_synchronize(fake.record_event(fake.current_stream(torch.device("cpu"))))
        return x

    hvd.init()
    n, r1 = hvd.size(), float(rank + 1)
    out: dict[str, object] = {}

    def as_list(x: object) -> object:
        if isinstance(x, (list, tuple)):
            return [as_list(v) for v in x]
        return x.tolist()  # type: ignore[attr-defined]

    def check(label: str, run: object) -> None:
        before = len(staged)
        values = [as_list(landed(run())) for _ in range(3)]  # type: ignore[operator]
        threads = sorted({waited.get(e, "never") for e in staged[before:]})
        out[label] = (values[-1], threads, len(staged) - before)

    sync = hvd.synchronize
    check("allgather_async", lambda: sync(hvd.allgather_async(produced(r1, (rank + 1, 2)),
                                                              name="ag")))
    check("allgather", lambda: hvd.allgather(produced(r1, (1,)), name="ag2"))
    check("grouped_allgather", lambda: hvd.grouped_allgather(
        [produced(r1, (1,)), produced(-r1, (2,), torch.int64)], name="gag"))
    check("broadcast_async", lambda: sync(hvd.broadcast_async(produced(r1, (3,)), 1,
                                                              name="bc")))
    check("broadcast_", lambda: hvd.broadcast_(produced(r1, (3,)), 1, name="bc_"))
    check("broadcast", lambda: hvd.broadcast(produced(r1, (2,)), 0, name="bcb"))
    check("alltoall_async", lambda: sync(hvd.alltoall_async(produced(r1, (2 * n,)),
                                                            name="a2a")))
    check("alltoall", lambda: hvd.alltoall(produced(r1, (n + 1,)),
                                           [1, n] if rank == 0 else [n, 1], name="a2a2")[0])
    check("reducescatter_async", lambda: sync(hvd.reducescatter_async(
        produced(r1, (2 * n, 2)), op=hvd.Sum, name="rs")))
    check("reducescatter", lambda: hvd.reducescatter(produced(r1, (n,)), op=hvd.Average,
                                                     name="rs2"))
    check("grouped_reducescatter", lambda: hvd.grouped_reducescatter(
        [produced(r1, (n,)), produced(2 * r1, (n, 3))], op=hvd.Sum, name="grs"))
    check("allreduce", lambda: hvd.allreduce(produced(r1, (4,)), op=hvd.Sum, name="ar"))
    hvd.shutdown()
    return out


@pytest.mark.timeout(150)
def test_hora_torch_ops_leave_the_wait_for_a_device_copy_to_the_engine() -> None:
    """Every op of hora.torch stages a CUDA tensor without waiting for its copy: the engine
    waits on the "copied" event, in its own thread, and the data that wait landed (never the
    zeros before it) is what the op used. Two ranks; the fake runtime stands in for the GPU."""
    outs = run_ranks(_arriving_torch, 2, timeout=120)
    same = {
        "allgather_async": [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]],
        "allgather": [1.0, 2.0],
        "grouped_allgather": [[1.0, 2.0], [-1, -1, -2, -2]],
        "broadcast_async": [2.0, 2.0, 2.0],
        "broadcast_": [2.0, 2.0, 2.0],
        "broadcast": [1.0, 1.0],
        "alltoall_async": [[1.0, 1.0, 2.0, 2.0], [2, 2]],
        "reducescatter_async": [[3.0, 3.0], [3.0, 3.0]],
        "reducescatter": [1.5],
        "grouped_reducescatter": [[3.0], [[6.0, 6.0, 6.0]]],
        "allreduce": [3.0] * 4,
    }
    alltoall = [[1.0, 2.0, 2.0], [1.0, 1.0, 2.0]]  # uneven splits: per rank
    for rank, out in enumerate(outs):
        assert sorted(out) == sorted([*same, "alltoall"])
        for label, (value, threads, staged) in out.items():  # type: ignore[attr-defined]
            assert staged >= 3, (label, staged)  # every call staged its tensors
            assert threads == ["hora-engine"], (label, threads)  # not the caller's thread
            want = same[label] if label in same else alltoall[rank]
            assert value == want, (rank, label, value)  # the landed data, never zeros
