"""The measuring side of ``hora.lab allreduce``: one process per rank, one backend per job.

Run as ``python -m hora.lab.workers <hora|gloo|mpi> <plan.json>`` by :mod:`hora.lab.allreduce`
(``mpi`` under ``mpirun``; the CUDA backends' runners are in :mod:`hora.lab.gpu_workers`). The
plan names the sizes, the iterations and warm-up per size, and the file where rank 0 appends
one JSON line per measurement. Every backend reduces a float32 buffer in place with Sum:
``hvd.allreduce(x, op=hvd.Sum, output=x)``, ``dist.all_reduce(t)`` on a CPU tensor sharing
``x``'s memory, ``comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)``. The first call of each size is
checked against the expected sum; the timed calls then run on zeros. Each call is timed on its
own; a barrier starts every timed batch.

With ``engine_cost`` the hora worker also times, alternating call by call so that both sides
see the same machine, and with the CPU time rank 0's process spent on each call (every thread
of it, so the engine's work counts): (a) the API against the native backend's ``allreduce``
called directly on the engine's own process-set communicator (the engine is idle in between,
so the data channel is free), and (b) ResNet-50's gradients as one async allreduce per tensor,
submitted in backward order and then synchronized, and as one grouped allreduce of the same
tensors, against one buffer of the same total size (the three take turns); and (c) back-to-back
4 KiB allreduces, blocking and async, with the CPU the engine thread and the calling thread
spent per call. Every buffer of
(b) lies on 4 KiB pages (:func:`small_pages`), as PyTorch's CPU allocator gives them: left to
NumPy, the one large buffer alone would get transparent huge pages, which make single-copy
reads and reductions faster whatever the engine does, and the comparison would measure page sizes.

Single-threaded script; nothing here is imported by the rest of hora.
"""

from __future__ import annotations

import json
import math
import mmap
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import numpy as np

Call = Callable[[], Any]


def resnet50_shapes() -> list[tuple[int, ...]]:
    """The parameter (gradient) shapes of ResNet-50 for 1000 classes, in forward order.

    Stem conv and batch norm, 16 bottleneck blocks (3, 4, 6, 3) of three convs with their batch
    norms, a projection shortcut in each stage's first block, then the classifier: 161 tensors,
    25,557,032 floats.
    """
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            out = planes * 4
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,)]
            shapes += [(planes, planes, 3, 3), (planes,), (planes,)]
            shapes += [(out, planes, 1, 1), (out,), (out,)]
            if block == 0:
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]
            inplanes = out
    return shapes + [(1000, 2048), (1000,)]


def small_pages(shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed float32 array of ``shape`` in its own mapping, on 4 KiB pages.

    NumPy asks for transparent huge pages on allocations of 4 MiB and more; this mapping asks
    the kernel for none (``MADV_NOHUGEPAGE``, where the platform has it), so that buffers of
    every size are backed alike.
    """
    count = math.prod(shape)
    area = mmap.mmap(-1, max(count * 4, 1))
    if hasattr(area, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
        area.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(area, dtype=np.float32, count=count).reshape(shape)


def time_batch(call: Call, iters: int, warmup: int, barrier: Call) -> list[float]:
    """Seconds per call of ``iters`` timed calls, after ``warmup`` untimed ones and a barrier."""
    for _ in range(warmup):
        call()
    barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def time_alternating(
    calls: Sequence[Call], iters: int, warmup: int, barrier: Call
) -> list[tuple[list[float], list[float]]]:
    """Like :func:`time_batch` for several calls, taking turns so that all see the same noise.

    Per call: the wall-clock seconds of each timed call, and the CPU seconds this process
    (every thread of it: the engine's too) spent meanwhile.
    """
    for _ in range(warmup):
        for call in calls:
            call()
    barrier()
    out: list[tuple[list[float], list[float]]] = [([], []) for _ in calls]
    for _ in range(iters):
        for call, (wall, cpu) in zip(calls, out):
            c0, t0 = time.process_time(), time.perf_counter()
            call()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return out


def stats(times: list[float]) -> dict[str, float]:
    arr = np.asarray(times)
    return {
        "median_s": float(np.median(arr)),
        "p90_s": float(np.percentile(arr, 90)),
        "min_s": float(arr.min()),
        "mean_s": float(arr.mean()),
    }


class Sink:
    """Rank 0's result file: one JSON object per line, flushed as soon as it is known."""

    def __init__(self, path: str, rank: int, backend: str) -> None:
        self.path, self.rank, self.backend = path, rank, backend

    def put(
        self,
        case: str,
        size_bytes: int,
        tensors: int,
        warmup: int,
        times: list[float],
        cpu: list[float] | None = None,
        extra: dict[str, float] | None = None,
    ) -> None:
        if self.rank != 0:
            return
        row = {
            "backend": self.backend,
            "case": case,
            "size_bytes": size_bytes,
            "tensors": tensors,
            "iters": len(times),
            "warmup": warmup,
            **stats(times),
        }
        if cpu is not None:  # rank 0's process CPU per call (median), every thread counted
            row["cpu_median_s"] = float(np.median(cpu))
        row.update(extra or {})
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _checked(x: np.ndarray, reduce: Call, size: int, label: str) -> None:
    """Run one reduction of ``rank + 1`` everywhere, check the sum, then zero ``x``."""
    reduce()
    expected = size * (size + 1) / 2
    if not (x[0] == expected and x[-1] == expected and np.all(x == expected)):
        raise RuntimeError(f"{label} allreduce gave {x[:4]}..., expected {expected} everywhere")
    x[...] = 0


def measure_sizes(
    plan: dict[str, Any],
    rank: int,
    size: int,
    sink: Sink,
    make_call: Callable[[np.ndarray, int], Call],
    barrier: Call,
) -> None:
    for nbytes, iters, warmup in zip(plan["sizes"], plan["iters"], plan["warmup"]):
        x = np.full(nbytes // 4, rank + 1, dtype=np.float32)
        call = make_call(x, nbytes)
        _checked(x, call, size, sink.backend)
        sink.put("allreduce", nbytes, 1, warmup, time_batch(call, iters, warmup, barrier))


def run_hora(plan: dict[str, Any]) -> None:
    import hora as hvd

    hvd.init()
    try:
        rank, size = hvd.rank(), hvd.size()
        sink = Sink(plan["out"], rank, plan["label"])

        def make_call(x: np.ndarray, nbytes: int) -> Call:
            name = f"bench.{nbytes}"
            return lambda: hvd.allreduce(x, op=hvd.Sum, output=x, name=name)

        measure_sizes(plan, rank, size, sink, make_call, hvd.barrier)
        if plan.get("moved"):  # the bytes each rank moved per size (hora.lab.moved)
            from hora.lab.moved import count_sizes

            count_sizes(hvd, plan["sizes"], plan["moved"])
        if plan.get("layout"):  # where this rank's data went: hora.lab.netns reports it
            with open(f"{plan['layout']}.{rank}", "w") as f:
                json.dump(hora_layout(hvd), f)
        if plan["engine_cost"]:
            _engine_cost(plan, rank, size, sink, hvd)
    finally:
        hvd.shutdown()


def hora_layout(hvd: Any) -> dict[str, Any]:
    """This rank's place and the links its data took, read after the timed calls: its host
    name and network namespace, the host of every rank as hora's hierarchical collectives see
    it, the peers it holds shared-memory and TCP data pairs with, and the algorithms chosen
    (the notes of :func:`hora.collectives.hierarchical._note`)."""
    import os

    from hora.core.runtime import runtime
    from hora.transport.base import DATA

    comm = runtime().engine.members[0].comm
    transport = comm.transport
    tcp, shm = getattr(transport, "_tcp", transport), getattr(transport, "_shm", None)
    layout = comm.cache.get("hierarchical.layout")
    return {
        "rank": hvd.rank(),
        "host": runtime().identity.hostname,
        "local_rank": hvd.local_rank(),
        "cross_rank": hvd.cross_rank(),
        "netns": os.readlink("/proc/self/ns/net"),
        "hosts": list(layout.hosts) if layout is not None else None,
        "shm_peers": sorted(getattr(shm, "_pairs", {})) if shm is not None else [],
        "tcp_peers": sorted({p for p, kind in getattr(tcp, "_pairs", {}) if kind == DATA}),
        "choices": sorted(layout.logged) if layout is not None else [],
    }


def _engine_cost(plan: dict[str, Any], rank: int, size: int, sink: Sink, hvd: Any) -> None:
    from hora.collectives.reduce_ops import SUM
    from hora.core.runtime import runtime

    engine = runtime().engine
    comm, backend = engine.members[0].comm, engine.executor.backend
    for nbytes, iters, warmup in zip(plan["sizes"], plan["iters"], plan["warmup"]):
        x = np.zeros(nbytes // 4, dtype=np.float32)
        api, direct = time_alternating(
            [
                partial(hvd.allreduce, x, op=hvd.Sum, output=x, name=f"bench.{nbytes}"),
                partial(backend.allreduce, comm, x, "float32", SUM),
            ],
            iters,
            warmup,
            hvd.barrier,
        )
        sink.put("api", nbytes, 1, warmup, *api)
        sink.put("direct", nbytes, 1, warmup, *direct)

    _small_grouped(plan, sink, hvd, comm, backend)
    _per_op(plan, sink, hvd, engine.thread_id)
    shapes = resnet50_shapes()[::-1]  # gradients become ready from the last layer back
    grads = [small_pages(s) for s in shapes]
    total = sum(g.size for g in grads)
    one = small_pages((total,))

    def many() -> None:
        handles = [
            hvd.allreduce_async(g, op=hvd.Sum, output=g, name=f"resnet50.{i}")
            for i, g in enumerate(grads)
        ]
        for h in handles:
            hvd.synchronize(h)

    calls: list[Call] = [
        many,
        # the same tensors handed over at once: what remains of the gap to one buffer is
        # negotiating and reducing 161 tensors, not submitting and completing 161 handles
        partial(hvd.grouped_allreduce, grads, op=hvd.Sum, outputs=grads, name="resnet50.g"),
        partial(hvd.allreduce, one, op=hvd.Sum, output=one, name="resnet50.fused"),
    ]
    parts = getattr(backend, "reduces_parts", None)
    if parts is not None and parts(comm, total * 4, len(grads)):
        # the backend's own call on the same tensors, where they lie (what the engine runs):
        # the API's share of the gap to one buffer, apart from the transport's
        flat = [g.reshape(-1) for g in grads]
        own = backend.allreduce_parts  # type: ignore[attr-defined]
        calls.append(partial(own, comm, flat, "float32", SUM))
    iters, warmup = plan["resnet_iters"], plan["resnet_warmup"]
    times = time_alternating(calls, iters, warmup, hvd.barrier)
    cases = ["resnet50", "resnet50 grouped", "one buffer", "resnet50 backend"]
    for case, t in zip(cases, times):
        sink.put(case, total * 4, 1 if case == "one buffer" else len(grads), warmup, *t)


SMALL_TENSORS = (25, 11_000)  # many small gradients: 25 tensors of 44 KB, 1.1 MB in all


def _small_grouped(plan: dict[str, Any], sink: Sink, hvd: Any, comm: Any, backend: Any) -> None:
    """One grouped allreduce of many small tensors through the API against the backend's own
    call on the same tensors (``allreduce_parts`` where the engine would reduce them where they
    lie, else ``allreduce`` of one buffer of the same size, without the fusion buffer's
    copies): what the engine adds to a step of small gradients, back to back."""
    from hora.collectives.reduce_ops import SUM

    count, numel = SMALL_TENSORS
    grads = [np.zeros(numel, dtype=np.float32) for _ in range(count)]
    total = count * numel * 4
    parts = getattr(backend, "reduces_parts", None)
    if parts is not None and parts(comm, total, count):  # as the engine would choose
        direct = partial(backend.allreduce_parts, comm, grads, "float32", SUM)
    else:
        direct = partial(
            backend.allreduce, comm, np.zeros(count * numel, np.float32), "float32", SUM
        )
    iters, warmup = plan["small_iters"], plan["small_warmup"]
    api_t, direct_t = time_alternating(
        [partial(hvd.grouped_allreduce, grads, op=hvd.Sum, outputs=grads, name="small"), direct],
        iters,
        warmup,
        hvd.barrier,
    )
    sink.put("small grouped", total, count, warmup, *api_t)
    sink.put("small direct", total, count, warmup, *direct_t)


PER_OP_BYTES = 4096


def thread_cpu(ident: int | None) -> float | None:
    """Seconds of CPU the thread ``ident`` (``threading``'s ident) of this process has run:
    its CPU clock, which counts to the nanosecond and includes the run it is in (the
    scheduler's statistics are updated only when a thread is switched out, and a caller that
    polls for its op's headers may not be for several calls); None where there is none."""
    if ident is None:
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError):
        return None


def _per_op(plan: dict[str, Any], sink: Sink, hvd: Any, engine_tid: int) -> None:
    """Back-to-back 4 KiB allreduces, blocking (``allreduce``) and async (``allreduce_async``
    then ``synchronize``), each a batch of its own: the wall time per call, and the CPU the
    engine thread and the calling thread spent per call over the batch. What the engine costs
    a training step in CPU, beside its latency."""
    import threading

    x = np.zeros(PER_OP_BYTES // 4, dtype=np.float32)

    def blocking() -> None:
        hvd.allreduce(x, op=hvd.Sum, output=x, name="per_op.blocking")

    def asynchronous() -> None:
        hvd.synchronize(hvd.allreduce_async(x, op=hvd.Sum, output=x, name="per_op.async"))

    me = threading.get_ident()
    engine = next((t.ident for t in threading.enumerate() if t.native_id == engine_tid), None)
    iters, warmup = plan["small_iters"], plan["small_warmup"]
    for case, call in (("per op blocking", blocking), ("per op async", asynchronous)):
        for _ in range(warmup):
            call()
        hvd.barrier()
        e0, c0 = thread_cpu(engine), thread_cpu(me)
        times = time_batch(call, iters, 0, lambda: None)
        e1, c1 = thread_cpu(engine), thread_cpu(me)
        extra = {}
        if e0 is not None and e1 is not None and c0 is not None and c1 is not None:
            extra = {"engine_cpu_s": (e1 - e0) / iters, "caller_cpu_s": (c1 - c0) / iters}
        sink.put(case, PER_OP_BYTES, 1, warmup, times, extra=extra)


def run_gloo(plan: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=plan["timeout"]))
    try:
        rank, size = dist.get_rank(), dist.get_world_size()

        def make_call(x: np.ndarray, nbytes: int) -> Call:
            t = torch.from_numpy(x)
            return lambda: dist.all_reduce(t)

        measure_sizes(plan, rank, size, Sink(plan["out"], rank, "gloo"), make_call, dist.barrier)
    finally:
        dist.destroy_process_group()


def run_mpi(plan: dict[str, Any]) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()

    def make_call(x: np.ndarray, nbytes: int) -> Call:
        return lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)

    measure_sizes(plan, rank, size, Sink(plan["out"], rank, "mpi"), make_call, comm.Barrier)


RUNNERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "hora": run_hora,
    "hora-tcp": run_hora,
    "hora-shm-staged": run_hora,
    "gloo": run_gloo,
    "mpi": run_mpi,
}


def main(argv: list[str], runners: dict[str, Callable[[dict[str, Any]], None]] = RUNNERS,
         module: str = "hora.lab.workers") -> int:
    """``python -m <module> BACKEND PLAN.json``: run ``runners[BACKEND]`` on the plan."""
    if len(argv) != 2 or argv[0] not in runners:
        sys.stderr.write(f"usage: python -m {module} {{{'|'.join(runners)}}} PLAN.json\n")
        return 2
    with open(argv[1]) as f:
        plan = json.load(f)
    runners[argv[0]](plan)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
