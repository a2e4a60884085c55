"""hora.lab allreduce for real: two small sizes at np=2 through worker processes it starts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hora.lab import allreduce as bench


@pytest.mark.timeout(240)
def test_short_gloo_and_hora_runs_from_the_command_line(tmp_path: Path) -> None:
    out_json, out_csv, out_png = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "r.png"
    cmd = [
        sys.executable,
        "-m",
        "hora.lab",
        "allreduce",
        "--np",
        "2",
        "--sizes",
        "4K,64K",
        "--iters",
        "5",
        "--backends",
        "gloo,hora,hora-tcp",
        "--timeout",
        "180",
        "--json",
        str(out_json),
        "--csv",
        str(out_csv),
        "--plot",
        str(out_png),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[gloo] allreduce 4 KiB: p50" in proc.stderr
    assert "[hora] allreduce 64 KiB: p50" in proc.stderr
    doc = json.loads(out_json.read_text())
    assert doc["skipped"] == {}
    rows = {(r["backend"], r["size_bytes"]): r for r in doc["rows"]}
    assert set(rows) == {(b, s) for b in ("gloo", "hora", "hora-tcp") for s in (4096, 65536)}
    for r in rows.values():
        assert r["iters"] == 5 and r["np"] == 2 and r["case"] == "allreduce"
        assert 0 < r["min_s"] <= r["median_s"] <= r["p90_s"]
        assert r["busbw_gbps"] == pytest.approx(r["size_bytes"] / r["median_s"] / 1e9)
    table = proc.stdout.splitlines()
    assert any(line.startswith("64 KiB") for line in table)
    assert any(line.split()[-1].endswith("x") for line in table if " hora-tcp " in line)
    assert len(out_csv.read_text().splitlines()) == 7
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(120)
def test_a_failing_backend_is_reported_with_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = "import sys; print('worker could not start'); sys.exit(3)"
    monkeypatch.setattr(bench, "worker_cmd", lambda _b, _p: [sys.executable, "-c", script])
    messages: list[str] = []
    config = bench.AllreduceBenchConfig(sizes=[4096], iters=2, backends=["gloo"], timeout=60)
    result = bench.run_allreduce_bench(config, messages.append)
    assert result.rows == []
    reason = result.skipped["gloo"]
    assert re.match(r"failed: worker [01] exited with 3", reason), reason
    assert "worker could not start" in reason
    assert any(m.startswith("[gloo] failed") for m in messages)


@pytest.mark.timeout(60)
def test_unavailable_backend_is_skipped_without_starting_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench, "unavailable", lambda b: "mpirun is not on PATH")
    monkeypatch.setattr(bench, "_spawn", lambda *a: pytest.fail("workers were started"))
    result = bench.run_allreduce_bench(bench.AllreduceBenchConfig(backends=["mpi"]))
    assert result.skipped == {"mpi": "mpirun is not on PATH"} and result.rows == []


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_short_mpi_run() -> None:
    if bench.unavailable("mpi"):
        pytest.skip(f"mpi backend unavailable: {bench.unavailable('mpi')}")
    config = bench.AllreduceBenchConfig(sizes=[4096], iters=3, backends=["mpi"], timeout=150)
    result = bench.run_allreduce_bench(config)
    assert result.skipped == {}
    (row,) = result.rows
    assert (row["backend"], row["size_bytes"], row["iters"]) == ("mpi", 4096, 3)


@pytest.mark.timeout(240)
def test_engine_cost_run_measures_every_case(tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "hora.lab", "allreduce", "--backends", "hora", "--sizes", "1M"]
    cmd += ["--iters", "3", "--engine-cost", "--timeout", "180", "--json", str(out_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["case"]: r for r in json.loads(out_json.read_text())["rows"]}
    cases = {"allreduce", "api", "direct", "resnet50", "resnet50 grouped", "one buffer",
             "resnet50 backend"}  # the backend's own call on the same tensors (one host)
    assert set(rows) == cases | {"small grouped", "small direct", "per op blocking", "per op async"}
    for case in ("per op blocking", "per op async"):  # the engine's CPU per op, on Linux
        assert rows[case]["size_bytes"] == 4096 and rows[case]["iters"] == 3
        assert rows[case]["engine_cpu_s"] >= 0 and rows[case]["caller_cpu_s"] > 0
    assert rows["per op async"]["engine_cpu_s"] > 0  # async ops run in the engine thread
    assert rows["small grouped"]["tensors"] == rows["small direct"]["tensors"] == 25
    assert rows["resnet50"]["tensors"] == rows["resnet50 grouped"]["tensors"] == 161
    assert rows["one buffer"]["size_bytes"] == rows["resnet50"]["size_bytes"] == 25557032 * 4
    table = proc.stdout[proc.stdout.index("engine cost") :].splitlines()
    assert any(" API " in line and "backend direct" in line for line in table)
    assert any("161 tensors grouped" in line and line.split()[-1][0].isdigit() for line in table)
    assert rows["resnet50 backend"]["tensors"] == 161
    assert any("161 tensors grouped" in line and "same tensors" in line for line in table)
    assert any("25 tensors grouped" in line and "backend direct" in line for line in table)
    per_op = proc.stdout[proc.stdout.index("per op (hora)") :].splitlines()
    assert any("allreduce_async + synchronize" in line for line in per_op)
