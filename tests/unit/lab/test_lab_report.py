"""hora.lab report: bandwidth arithmetic and table/CSV/JSON/PNG rendering from synthetic rows."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest

from hora.lab import report
from hora.lab.allreduce import BenchResult, render


def _row(backend: str, size: int, median: float, case: str = "allreduce", **kw: Any) -> dict:
    return {
        "backend": backend,
        "case": case,
        "size_bytes": size,
        "tensors": 1,
        "iters": 10,
        "warmup": 2,
        "median_s": median,
        "p90_s": median * 1.5,
        "min_s": median / 2,
        "mean_s": median,
        **kw,
    }


ROWS = report.with_bandwidth(
    [
        _row("hora", 4096, 100e-6),
        _row("gloo", 4096, 700e-6),
        _row("mpi", 4096, 4e-6),
        _row("hora", 1 << 20, 0.5e-3),
        _row("gloo", 1 << 20, 1.0e-3),
    ],
    nranks=2,
)


def test_bus_bandwidth_arithmetic() -> None:
    assert report.algorithm_bandwidth(1000, 0.5) == 2000
    assert report.bus_bandwidth(1000, 0.5, 2) == 2000  # 2(n-1)/n = 1 at n = 2
    assert report.bus_bandwidth(1000, 0.5, 4) == pytest.approx(3000)  # 1.5 at n = 4
    assert report.bus_bandwidth(1000, 0.5, 1) == 0
    with pytest.raises(ValueError, match="positive"):
        report.bus_bandwidth(1000, 0.0, 2)
    with pytest.raises(ValueError, match="ranks"):
        report.bus_bandwidth(1000, 1.0, 0)


def test_with_bandwidth_adds_gbps() -> None:
    hora_1m = ROWS[3]
    assert hora_1m["np"] == 2
    assert hora_1m["busbw_gbps"] == pytest.approx((1 << 20) / 0.5e-3 / 1e9)
    assert hora_1m["algbw_gbps"] == hora_1m["busbw_gbps"]


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (12, "12 B"),
        (4096, "4 KiB"),
        (1536, "1.5 KiB"),
        (256 << 20, "256 MiB"),
        (1 << 30, "1 GiB"),
        (102228128, "97.49 MiB"),
    ],
)
def test_human_size(nbytes: int, text: str) -> None:
    assert report.human_size(nbytes) == text


def test_allreduce_table_aligns_columns_and_shows_ratios() -> None:
    text = report.allreduce_table(ROWS)
    lines = text.splitlines()
    assert lines[0].split() == [
        "size",
        "backend",
        "iters",
        "p50",
        "ms",
        "p90",
        "ms",
        "busbw",
        "GB/s",
        "vs",
        "gloo",
        "vs",
        "mpi",
    ]
    assert set(lines[1]) <= {"-", " "}
    widths = {len(line) for line in lines[:2]}
    assert len(widths) == 1  # header and rule are as wide as the widest column set
    hora_4k = next(line for line in lines if line.startswith("4 KiB"))
    assert hora_4k.split()[2:] == ["hora", "10", "0.100", "0.150", "0.041", "7.00x", "0.04x"]
    hora_1m = next(line for line in lines if line.startswith("1 MiB"))
    assert hora_1m.endswith("2.00x")  # no mpi measurement at 1 MiB: no ratio
    gloo_rows = [line for line in lines if " gloo " in line]
    assert all(not line.rstrip().endswith("x") for line in gloo_rows)
    p50_col = lines[0].index("p50 ms") + len("p50 ms")
    assert all(line[p50_col - 1].isdigit() for line in lines[2:])  # numbers right-aligned


def test_engine_cost_table() -> None:
    rows = report.with_bandwidth(
        [
            {**_row("hora", 1 << 20, 1.1e-3, case="api"), "cpu_median_s": 0.9e-3},
            {**_row("hora", 1 << 20, 1.0e-3, case="direct"), "cpu_median_s": 0.8e-3},
            _row("hora", 102228128, 0.12, case="resnet50", tensors=161),
            _row("hora", 102228128, 0.11, case="resnet50 grouped", tensors=161),
            _row("hora", 102228128, 0.10, case="one buffer"),
            _row("hora", 1100000, 0.9e-3, case="small grouped", tensors=25),
            _row("hora", 1100000, 0.5e-3, case="small direct", tensors=25),
            _row("hora-tcp", 1 << 20, 1.5e-3, case="api"),
            _row("hora-tcp", 1 << 20, 1.2e-3, case="direct"),
        ],
        nranks=2,
    )
    lines = report.engine_cost_table(rows).splitlines()
    assert lines[0].split()[:2] == ["backend", "case"]
    cells = [line.split() for line in lines[2:]]
    assert cells[0] == [
        "hora",
        "allreduce",
        "1",
        "MiB",
        "API",
        "backend",
        "direct",
        "1.100",
        "1.000",
        "1.100",
        "0.900",  # CPU per call, where the worker measured it
        "0.800",
    ]
    assert lines[0].rstrip().endswith("A/B  A cpu ms  B cpu ms")
    assert cells[1][:3] == ["hora", "small", "tensors"] and cells[1][-3:] == ["1.800", "-", "-"]
    assert "25 tensors grouped" in lines[3] and "backend direct" in lines[3]
    assert cells[2][:3] == ["hora", "ResNet-50", "97.49"] and cells[2][-3:] == ["1.200", "-", "-"]
    assert "161 tensors" in lines[4] and "grouped" not in lines[4]
    assert cells[3][:3] == ["hora", "ResNet-50", "97.49"] and cells[3][-3] == "1.100"
    assert "161 tensors grouped" in lines[5]
    assert cells[4][0] == "hora-tcp" and cells[4][-3] == "1.250"
    assert len(cells) == 5


def test_csv_round_trips() -> None:
    parsed = list(csv.DictReader(io.StringIO(report.to_csv(ROWS))))
    assert [r["backend"] for r in parsed] == ["hora", "gloo", "mpi", "hora", "gloo"]
    assert list(parsed[0]) == report.CSV_COLUMNS
    assert float(parsed[1]["median_s"]) == pytest.approx(700e-6)
    assert float(parsed[3]["busbw_gbps"]) == pytest.approx(ROWS[3]["busbw_gbps"])


def test_json_round_trips() -> None:
    doc = json.loads(report.to_json({"np": 2}, ROWS, {"mpi": "mpirun is not on PATH"}))
    assert doc["meta"] == {"np": 2}
    assert doc["rows"] == ROWS
    assert doc["skipped"] == {"mpi": "mpirun is not on PATH"}


@pytest.mark.timeout(60)
def test_plot_is_a_png(tmp_path: Path) -> None:
    path = tmp_path / "bw.png"
    report.plot_bus_bandwidth(ROWS, str(path), "allreduce test")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
    with pytest.raises(ValueError, match="no allreduce"):
        report.plot_bus_bandwidth([], str(tmp_path / "none.png"), "empty")


def test_render_lists_skipped_backends() -> None:
    result = BenchResult(
        {"np": 2, "host": "box (2 CPUs)"}, ROWS, {"mpi": "mpi4py is not installed"}
    )
    text = render(result)
    assert text.startswith("allreduce float32 Sum, np=2, box (2 CPUs)")
    assert "vs gloo" in text and "engine cost" not in text
    assert text.rstrip().endswith("skipped mpi: mpi4py is not installed")


def test_title_names_the_memory_copy_speed_when_measured() -> None:
    meta = {"np": 2, "host": "box (2 CPUs)", "copy_speed": "5.7 GB/s"}
    assert BenchResult(meta, ROWS, {}).title() == (
        "allreduce float32 Sum, np=2, box (2 CPUs), memory copy 5.7 GB/s per core"
    )


def test_best_of_keeps_the_fastest_round_per_measurement() -> None:
    rounds = [
        _row("hora", 4096, 3e-4, round=1),
        _row("gloo", 4096, 7e-4, round=1),
        _row("hora", 4096, 1e-4, round=2),
        _row("gloo", 4096, 9e-4, round=2),
    ]
    best = report.best_of(rounds)
    assert [(r["backend"], r["median_s"], r["round"]) for r in best] == [
        ("hora", 1e-4, 2),
        ("gloo", 7e-4, 1),
    ]


def test_best_of_keeps_paired_measurements_from_one_round() -> None:
    rounds = [
        _row("hora", 1 << 20, 3e-3, case="api", round=1),
        _row("hora", 1 << 20, 0.6e-3, case="direct", round=1),
        _row("hora", 1 << 20, 1.1e-3, case="api", round=2),
        _row("hora", 1 << 20, 1.0e-3, case="direct", round=2),
        _row("hora", 1 << 20, 2e-3, round=1),
    ]
    best = report.best_of(rounds)
    assert sorted((r["case"], r["round"]) for r in best) == [
        ("allreduce", 1),
        ("api", 2),
        ("direct", 2),
    ]


def test_per_op_table() -> None:
    rows = [
        _row("hora", 4096, 50e-6, case="per op blocking", engine_cpu_s=0.0, caller_cpu_s=40e-6),
        _row("hora", 4096, 110e-6, case="per op async", engine_cpu_s=45e-6, caller_cpu_s=25e-6),
        _row("hora", 4096, 60e-6, case="per op async"),  # where thread CPU is not known
        _row("hora", 1 << 20, 1e-3, case="api"),  # not a per-op row
    ]
    lines = report.per_op_table(rows).splitlines()
    assert "engine thread cpu us" in lines[0] and "caller cpu us" in lines[0]
    cells = [line.split() for line in lines[2:]]
    assert cells == [
        ["hora", "allreduce", "4", "KiB", "50", "75", "0", "40"],
        ["hora", "allreduce_async", "+", "synchronize", "4", "KiB", "110", "165", "45", "25"],
        ["hora", "allreduce_async", "+", "synchronize", "4", "KiB", "60", "90", "-", "-"],
    ]
