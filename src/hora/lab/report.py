"""Turning allreduce measurements into numbers people read: bandwidth, tables, CSV, JSON, a plot.

A measurement row is a dict as the workers write it (``backend``, ``case``, ``size_bytes``,
``tensors``, ``iters``, ``warmup``, ``median_s``, ``p90_s``, ``min_s``, ``mean_s``); the functions
here add the derived bandwidths and render. Pure functions of their arguments (the plot writes
its file); thread-safe.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from typing import Any

Row = dict[str, Any]

HORA = "hora"  # hora's backends are "hora" and variants named "hora-<variant>"
CSV_COLUMNS = [
    "backend",
    "case",
    "np",
    "size_bytes",
    "tensors",
    "iters",
    "warmup",
    "median_s",
    "p90_s",
    "min_s",
    "mean_s",
    "algbw_gbps",
    "busbw_gbps",
    "cpu_median_s",
    "engine_cpu_s",
    "caller_cpu_s",
]


def algorithm_bandwidth(size_bytes: int, seconds: float) -> float:
    """Bytes per second of one rank's buffer through the collective: ``size / time``."""
    if seconds <= 0:
        raise ValueError(f"a time must be positive to give a bandwidth, got {seconds}")
    return size_bytes / seconds


def bus_bandwidth(size_bytes: int, seconds: float, nranks: int) -> float:
    """Allreduce bus bandwidth in bytes/s: algorithm bandwidth times ``2 (n - 1) / n``.

    The factor is the share of the buffer each rank must send (and receive) in a bandwidth-optimal
    allreduce, so the figure is comparable across world sizes and with the link's speed.
    """
    if nranks < 1:
        raise ValueError(f"the number of ranks must be >= 1, got {nranks}")
    return algorithm_bandwidth(size_bytes, seconds) * 2 * (nranks - 1) / nranks


# Cases measured as alternating pairs: the two rows of a pair must come from the same round.
PAIRS = {
    "api": "api/direct",
    "direct": "api/direct",
    "resnet50": "resnet50",
    "one buffer": "resnet50",
}


def best_of(rows: Sequence[Row]) -> list[Row]:
    """Per measurement, the rows of the round (``row["round"]``, default 0) with the lowest median.

    Repeated rounds of a benchmark on a shared machine differ by what else ran meanwhile; the
    fastest round is the closest to what the backend itself can do. The two sides of a paired
    measurement (``PAIRS``) are kept together, from the round where their sum is lowest.
    """
    groups: dict[tuple[str, str, int], dict[int, list[Row]]] = {}
    for row in rows:
        case: str = row["case"]
        key = (row["backend"], PAIRS.get(case, case), row["size_bytes"])
        groups.setdefault(key, {}).setdefault(row.get("round", 0), []).append(row)
    best: list[Row] = []
    for by_round in groups.values():
        best += min(by_round.values(), key=lambda group: sum(r["median_s"] for r in group))
    return best


def with_bandwidth(rows: Sequence[Row], nranks: int) -> list[Row]:
    """Copies of ``rows`` with ``np``, ``algbw_gbps`` and ``busbw_gbps`` (10^9 bytes/s) added."""
    out = []
    for row in rows:
        t = row["median_s"]
        out.append(
            {
                **row,
                "np": nranks,
                "algbw_gbps": algorithm_bandwidth(row["size_bytes"], t) / 1e9,
                "busbw_gbps": bus_bandwidth(row["size_bytes"], t, nranks) / 1e9,
            }
        )
    return out


def human_size(nbytes: int) -> str:
    """``4096 -> '4 KiB'``, ``1536 -> '1.5 KiB'``, ``256 * 2**20 -> '256 MiB'`` (4 digits)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"


def format_table(headers: Sequence[str], body: Sequence[Sequence[str]], left: int = 1) -> str:
    """Aligned columns: the first ``left`` ones to the left (labels), the rest to the right."""
    widths = [max(len(r[i]) for r in [headers, *body]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in body)])


def _is_hora(backend: str) -> bool:
    return backend == HORA or backend.startswith(HORA + "-")


def _ratio(ours: Row, other: Row) -> float:
    """Our bus bandwidth over ``other``'s; the inverse ratio of the medians where that is 0."""
    if other["busbw_gbps"] > 0:
        return float(ours["busbw_gbps"] / other["busbw_gbps"])
    return float(other["median_s"] / ours["median_s"])


def allreduce_table(rows: Sequence[Row]) -> str:
    """Latency and bus bandwidth per size and backend, with hora's bandwidth ratio to the others.

    ``rows`` carry bandwidths (:func:`with_bandwidth`); only ``case == "allreduce"`` is shown.
    A ratio above 1 means hora moved more bytes per second than that backend. At one rank bus
    bandwidth is 0 (no link crossed): an algorithm bandwidth column is added, and the ratios
    compare the medians (which is the same ratio whenever both bus bandwidths are known).
    """
    main = [r for r in rows if r["case"] == "allreduce"]
    backends = list(dict.fromkeys(r["backend"] for r in main))
    ours = [b for b in backends if _is_hora(b)]
    peers = [b for b in backends if not _is_hora(b)] if ours else []
    by_key = {(r["size_bytes"], r["backend"]): r for r in main}
    alone = any(r["np"] == 1 for r in main)
    headers = ["size", "backend", "iters", "p50 ms", "p90 ms", "busbw GB/s"]
    headers += ["algbw GB/s"] if alone else []
    headers += [f"vs {p}" for p in peers]
    body = []
    for size in sorted({r["size_bytes"] for r in main}):
        first = True
        for b in backends:
            r = by_key.get((size, b))
            if r is None:
                continue
            cells = [
                human_size(size) if first else "",
                b,
                str(r["iters"]),
                f"{r['median_s'] * 1e3:.3f}",
                f"{r['p90_s'] * 1e3:.3f}",
                f"{r['busbw_gbps']:.3f}",
            ]
            cells += [f"{r['algbw_gbps']:.3f}"] if alone else []
            for p in peers:
                other = by_key.get((size, p))
                cells.append(f"{_ratio(r, other):.2f}x" if _is_hora(b) and other else "")
            body.append(cells)
            first = False
    return format_table(headers, body, left=2)


def engine_cost_table(rows: Sequence[Row]) -> str:
    """Per hora backend: the API against the backend called directly (per size, and for one
    grouped allreduce of 25 small tensors), and ResNet-50's tensors against one buffer of the
    same total size and against the backend's own call on the same tensors (the transport's
    cost of scattered tensors apart). A/B is the ratio of the medians; the CPU
    columns are the CPU time rank 0's process spent per call (median, all its threads), where
    measured: what A costs beyond B in CPU against what it costs in time tells computing from
    waiting."""
    by_key = {(r["backend"], r["case"], r["size_bytes"]): r for r in rows}
    body = []

    def cpu(row: Row) -> str:
        return f"{row['cpu_median_s'] * 1e3:.3f}" if "cpu_median_s" in row else "-"

    def add(backend: str, case: str, a: Row, b: Row, a_label: str, b_label: str) -> None:
        am, bm = a["median_s"], b["median_s"]
        body.append(
            [
                backend,
                case,
                a_label,
                b_label,
                f"{am * 1e3:.3f}",
                f"{bm * 1e3:.3f}",
                f"{am / bm:.3f}",
                cpu(a),
                cpu(b),
            ]
        )

    order = {"api": 0, "small grouped": 1, "resnet50": 2, "resnet50 grouped": 3}
    for backend, case, size in sorted(
        (k for k in by_key if k[1] in order), key=lambda k: (k[0], order[k[1]], k[2])
    ):
        a = by_key[(backend, case, size)]
        if case == "api" and (backend, "direct", size) in by_key:
            b = by_key[(backend, "direct", size)]
            add(backend, f"allreduce {human_size(size)}", a, b, "API", "backend direct")
        elif case == "small grouped" and (backend, "small direct", size) in by_key:
            b = by_key[(backend, "small direct", size)]
            label = f"{a['tensors']} tensors grouped"
            add(backend, f"small tensors {human_size(size)}", a, b, label, "backend direct")
        elif case.startswith("resnet50"):
            how = " grouped" if case.endswith("grouped") else ""
            for against, b_label in (("one buffer", "one buffer"),
                                     ("resnet50 backend", "backend, same tensors")):
                if (backend, against, size) in by_key:
                    add(backend, f"ResNet-50 {human_size(size)}", a,
                        by_key[(backend, against, size)], f"{a['tensors']} tensors{how}",
                        b_label)  # fmt: skip
    headers = ["backend", "case", "A", "B", "A p50 ms", "B p50 ms", "A/B", "A cpu ms", "B cpu ms"]
    return format_table(headers, body, left=4)


PER_OP_CASES = {"per op blocking": "allreduce", "per op async": "allreduce_async + synchronize"}


def per_op_table(rows: Sequence[Row]) -> str:
    """Per hora backend: back-to-back small allreduces, blocking and async, with the CPU time
    the engine thread and the calling thread of rank 0 spent per call (over the batch)."""

    def us(row: Row, key: str) -> str:
        return f"{row[key] * 1e6:.0f}" if key in row else "-"

    body = [
        [r["backend"], PER_OP_CASES[r["case"]], human_size(r["size_bytes"]), us(r, "median_s"),
         us(r, "p90_s"), us(r, "engine_cpu_s"), us(r, "caller_cpu_s")]
        for r in rows if r["case"] in PER_OP_CASES
    ]
    headers = ["backend", "call", "size", "p50 us", "p90 us", "engine thread cpu us",
               "caller cpu us"]
    return format_table(headers, body, left=3)


def to_csv(rows: Sequence[Row]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def to_json(meta: dict[str, Any], rows: Sequence[Row], skipped: dict[str, str]) -> str:
    return json.dumps({"meta": meta, "rows": list(rows), "skipped": skipped}, indent=2) + "\n"


def plot_bus_bandwidth(rows: Sequence[Row], path: str, title: str) -> None:
    """A PNG of bus bandwidth against message size (log x), one line per backend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    main = [r for r in rows if r["case"] == "allreduce"]
    if not main:
        raise ValueError("no allreduce measurements to plot")
    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for backend in dict.fromkeys(r["backend"] for r in main):
        mine = sorted((r for r in main if r["backend"] == backend), key=lambda r: r["size_bytes"])
        ax.plot(
            [r["size_bytes"] for r in mine],
            [r["busbw_gbps"] for r in mine],
            marker="o",
            label=backend,
        )
    sizes = sorted({r["size_bytes"] for r in main})
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: human_size(int(v))))
    ax.set_xlabel("message size per rank (bytes, float32)")
    ax.set_ylabel("bus bandwidth (GB/s, 10^9 bytes/s)")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
