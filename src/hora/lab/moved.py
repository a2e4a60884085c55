"""What hora's allreduce moves per rank: counted bytes by path, against the optimal bound.

In a worker (:func:`count_sizes`), each rank calls the native backend's ``allreduce`` once per
size (after one call that opens what the algorithm needs) between two snapshots of
:mod:`hora.transport.tally`; rank 0 gathers every rank's counts and writes them beside the
timings (``<results>.moved``). :func:`table` renders them for the report: per size, the most
any rank sent, received, copied and reduced, in units of the buffer, and the ratio of the
larger of sent and received to a ring's ``2 (n - 1) / n``, the bandwidth-optimal amount.
Counts do not depend on timing, so they mean the same on a loaded machine as on an idle one.

Runs in the worker's main thread (counting) and in the caller's thread (rendering).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from hora.lab.report import format_table, human_size


def count_one(hvd: Any, nbytes: int) -> dict[str, int]:
    """This rank's counts for one float32 Sum allreduce of ``nbytes`` by the native backend."""
    from hora.collectives.reduce_ops import SUM
    from hora.core.runtime import runtime
    from hora.transport import tally

    engine = runtime().engine
    comm, backend = engine.members[0].comm, engine.executor.backend
    x = np.ones(nbytes // 4, dtype=np.float32)
    backend.allreduce(comm, x, "float32", SUM)  # opens an arena or pairs the first time
    hvd.barrier()
    before = tally.snapshot()
    backend.allreduce(comm, x, "float32", SUM)
    moved = tally.since(before)
    hvd.barrier()
    return moved


def count_sizes(hvd: Any, sizes: Sequence[int], out: str) -> None:
    """Count every size on every rank; rank 0 writes ``{size: [per-rank counts]}`` to ``out``."""
    found = {}
    for nbytes in sizes:
        found[str(nbytes)] = hvd.allgather_object(count_one(hvd, nbytes), name=f"moved.{nbytes}")
    if hvd.rank() == 0:
        with open(out, "w") as f:
            json.dump(found, f)


def load(path: str) -> dict[str, list[dict[str, int]]] | None:
    """What :func:`count_sizes` wrote, or None where it wrote nothing."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        found: dict[str, list[dict[str, int]]] = json.load(f)
    return found


def bound(nranks: int) -> float:
    """A bandwidth-optimal allreduce's bytes sent (and received) per rank, per buffer byte."""
    return 2 * (nranks - 1) / nranks


def table(moved: dict[str, list[dict[str, int]]]) -> str:
    """Per size, the most any rank moved per path (in buffers), and the ratio to the bound."""
    from hora.transport.tally import PATHS, totals

    body = []
    for size in sorted(moved, key=int):
        ranks, nbytes = moved[size], int(size)
        n, label = len(ranks), human_size(nbytes)
        for path in PATHS:
            most = [max(r.get(f"{path} {w}", 0) for r in ranks) / nbytes
                    for w in ("sent", "received", "copied")]  # fmt: skip
            if any(most):
                body.append([label, path, *(f"{m:.3f}" for m in most), "", ""])
                label = ""
        sums = [totals(r) for r in ranks]
        most = [max(t[w] for t in sums) / nbytes for w in ("sent", "received", "copied", "reduced")]
        ratio = f"{max(most[:2]) / bound(n):.2f}x" if n > 1 else ""
        body.append([label, "all paths", *(f"{m:.3f}" for m in most), ratio])
    headers = ["size", "path", "sent", "received", "copied", "reduced", "vs 2(n-1)/n"]
    return format_table(headers, body, left=2)
