"""``hora bench scaling`` for real: a short run of a small model at np 1 and 2 through the
launcher, on the native backend, Gloo (and MPI where it is available) and torch DDP, then
``hora bench report`` on its folder; and the table across servers on two network-namespace
hosts where they can be made."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hora.lab import scaling

HORA = [sys.executable, "-c", "import sys; from hora.launch.cli import main; sys.exit(main())"]
PNG = b"\x89PNG\r\n\x1a\n"
# on the CPU even where there is a GPU (--device auto would train there and run nccl)
SHORT = ["--model", "mlp", "--batch-size", "8", "--steps", "4", "--warmup", "1",
         "--timeout", "150", "--device", "cpu"]  # fmt: skip


def _hora(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HORA, *argv], capture_output=True, text=True, timeout=timeout)


def _table(stdout: str, title: str) -> list[list[str]]:
    """The rows of the table under ``title`` (cells split on runs of two or more spaces)."""
    lines = stdout.splitlines()
    start = lines.index(title) + 1
    assert re.split(r"\s{2,}", lines[start])[:4] == [
        "backend", "servers", "processes/server", "avg step time (ms)"
    ]
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        rows.append([c for c in line.split("  ") if c.strip()])
    return [[c.strip() for c in r] for r in rows]


@pytest.mark.timeout(600)
def test_short_scaling_run_fills_the_tables_and_writes_the_files(tmp_path: Path) -> None:
    backends = ["native", "gloo"] + (["mpi"] if scaling.unavailable("mpi") is None else [])
    backends.append("ddp")  # torch's DistributedDataParallel on the same model, the peer
    out = tmp_path / "run"
    argv = ["bench", "scaling", *SHORT, "--np", "1,2", "--out", str(out)]
    proc = _hora(*argv, "--backends", ",".join([*backends, "nccl"]), timeout=560)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # nccl trains GPU tensors only: without a GPU it cannot run at all, with one not on the CPU
    why = scaling.unavailable("nccl", "cpu")
    assert why is not None and f"skipped nccl: {why}" in proc.stderr + proc.stdout
    for backend in backends:
        assert f"mlp {backend} 1x2:" in proc.stderr  # one line per finished configuration

    rows = _table(proc.stdout, "Speedup inside one server: mlp")
    # a DDP row says which torch backend DDP ran on: Gloo on the CPU
    shown = [b if b != "ddp" else "ddp (gloo)" for b in backends]
    assert [(r[0], r[1], r[2]) for r in rows] == [(b, "1", n) for b in shown for n in "12"]
    for r in rows:
        mean, spread = (float(x) for x in r[3].split(" ± "))
        assert mean > 0 and spread >= 0 and float(r[4]) > 0
        assert r[5] == "1.00" if r[2] == "1" else float(r[5]) > 0
    assert "Speedup across servers" not in proc.stdout
    assert "no run across servers" in proc.stdout
    assert "Environment" in proc.stdout and "torch 2." in proc.stdout

    doc = json.loads((out / "results.json").read_text())
    assert doc["skipped"].keys() == {"nccl"} and doc["failed"] == []
    by = {(r["backend"], r["np"]): r for r in doc["rows"]}
    for backend in backends:
        one, two = by[(backend, 1)], by[(backend, 2)]
        assert two["speedup"] == pytest.approx(two["throughput"] / one["throughput"])
        assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
        assert two["throughput"] == pytest.approx(2 * 8 / two["step_mean_s"])
        assert len(two["step_times_s"]) == 4 and min(two["step_times_s"]) > 0
        assert two["backend_used"] == backend and one["wait_s"] >= 0
        assert two["params"] == 3_213_002
        if backend == "ddp":  # its wait is inside backward: no phase of its own, no share
            assert two["comm_share"] is None and two["wait_s"] < 1e-3  # an empty phase
        else:
            assert 0 <= two["comm_share"] < 1
    ddp_rows = [r for r in rows if r[0] == "ddp (gloo)"]
    assert ddp_rows and all(r[7] == "-" for r in ddp_rows), rows
    assert "ddp: torch DistributedDataParallel" in proc.stdout
    for name in ("scaling_mlp.png", "breakdown.png"):
        assert (out / name).read_bytes()[:8] == PNG
    assert len((out / "results.csv").read_text().splitlines()) == 2 * len(backends) + 1
    assert "## Speedup inside one server: mlp" in (out / "tables.md").read_text()

    again = _hora("bench", "report", str(out), "--out", str(tmp_path / "again"), timeout=120)
    assert again.returncode == 0, again.stderr
    assert _table(again.stdout, "Speedup inside one server: mlp") == rows
    assert (tmp_path / "again" / "breakdown.png").read_bytes()[:8] == PNG
    same = _hora("bench", "report", str(out), str(out), "--fail-below", "0.99", timeout=120)
    assert same.returncode == 0 and same.stdout.count("1.000") == 2 * len(backends)


@pytest.mark.timeout(120)
def test_a_failing_configuration_is_reported_not_fatal(tmp_path: Path) -> None:
    proc = _hora("bench", "scaling", *SHORT, "--np", "1", "--backends", "native", "--repeat",
                 "2", "--examples-dir", str(tmp_path), timeout=100)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "mlp native 1 server x 1 (round 2/2) failed:" in proc.stderr
    assert "FileNotFoundError" in proc.stderr and "--examples-dir" in proc.stderr
    assert "failed mlp native 1x1 (round 1):" in proc.stdout
    assert "failed mlp native 1x1 (round 2):" in proc.stdout


@pytest.mark.multihost
@pytest.mark.timeout(400)
def test_across_two_namespace_hosts_fills_the_second_table(tmp_path: Path) -> None:
    from netns import Cluster, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with Cluster(["hostA", "hostB"], tmp_path) as cluster:
        proc = _hora(
            "bench", "scaling", *SHORT, "--np", "1,2", "--backends", "native,ddp",
            "-H", "hostA:1,hostB:1", "--ssh-config-file", str(cluster.ssh_config),
            timeout=360,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _table(proc.stdout, "Speedup across servers: mlp")
    # DDP's process group meets at the address hora's peers reach rank 0 on: across hosts too
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (b, n, "1") for b in ("native", "ddp (gloo)") for n in "12"
    ]
    assert all(float(r[4]) > 0 and float(r[5]) > 0 for r in rows[1::2])
    env = proc.stdout[proc.stdout.index("Environment") :]
    assert re.search(r"^hardware\s+servers\s+2\s*$", env, re.M), env
