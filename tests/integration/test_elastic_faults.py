"""Fault injection into elastic jobs: every phase x every fault, on two "hosts" of this machine
(``localhost`` and ``127.0.0.1``, as Horovod's own elastic tests use).

Each case runs ``hora run -np 2 --min-np 2 --max-np 4 --host-discovery-script`` with
elastic_faults_worker.py and checks, as Horovod 0.28.1 behaves:

* the job finishes (exit 0) with the expected workers and size, within the test's hard timeout;
* the committed-sample counter is exact: the history of committed steps is 1..N, each once,
  and the counter is the sum of the batch times the world size at each committed step;
* every rank ends with identical parameters, equal to the value computed without faults;
* the reset count is Horovod's (one per re-formation; a removed host costs one, not two);
* no process of the job is left behind.

A failed worker blacklists its host: with ``127.0.0.1:0`` failing, the job goes on with the two
workers of ``localhost``; with ``localhost:0`` (rank 0) failing, with those of ``127.0.0.1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
HORA = [sys.executable, "-c", "import sys; from hora.launch.cli import main; sys.exit(main())"]
STEPS = 8
BOTH = "localhost:2\n127.0.0.1:2\n"
LOCAL = "localhost:2\n"

PHASES = ["start", "step", "allreduce", "sync", "reform"]
FAULTS = ["exception", "sigkill", "sigterm", "host-added", "host-removed"]


def _case(phase: str, fault: str) -> dict:
    """The job for one case: its discovery file at start and after the fault, the victim, and
    what must come out (the surviving workers, their final size, the reset count)."""
    late = phase in ("sync", "reform")  # a reset adds 127.0.0.1:2 first; the victim is new
    victim = {"exception": "127.0.0.1:0", "sigkill": "localhost:0", "sigterm": "127.0.0.1:1"}
    if late:
        victim = dict.fromkeys(victim, "127.0.0.1:0")
    both, local = {"localhost:0", "localhost:1"}, {"127.0.0.1:0", "127.0.0.1:1"}
    if fault in victim:
        who = victim[fault]
        survivors = local if who.startswith("localhost") else both
        return {
            "hosts": LOCAL if late else BOTH,
            "after": "",
            "victim": who,
            "fault": fault,
            "survivors": survivors,
            "size": 2,
            "resets": 2 if late else 1,
        }
    added = fault == "host-added"
    if late:  # the victim (a new worker) changes the hosts while it syncs or joins
        after = "localhost:2\n127.0.0.1:2\n127.0.0.2:1\n" if added else LOCAL
        survivors = both | local | {"127.0.0.2:0"} if added else both
        return {
            "hosts": LOCAL,
            "after": after,
            "victim": "127.0.0.1:0",
            "fault": "hosts",
            "survivors": survivors,
            "size": 5 if added else 2,
            "resets": 2,
        }
    return {
        "hosts": LOCAL if added else BOTH,
        "after": BOTH if added else LOCAL,
        "victim": "localhost:0",
        "fault": "hosts",
        "survivors": both | local if added else both,
        "size": 4 if added else 2,
        "resets": 1,
    }


def _left_behind(marker: str) -> list[int]:
    """Processes whose command line names ``marker`` (this case's directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if marker.encode() in cmd:
            found.append(int(entry))
    return found


def _run_case(tmp_path: Path, phase: str, fault: str, extra: list[str] | None = None):
    case = _case(phase, fault)
    hosts = tmp_path / "hosts"
    hosts.write_text(case["hosts"])
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    cfg = {"phase": phase, "fault": case["fault"], "victim": case["victim"], "steps": STEPS,
           "dir": str(tmp_path), "hosts_file": str(hosts), "hosts_after": case["after"],
           "max_np": 5 if case["size"] == 5 else 4}  # fmt: skip
    max_np = str(cfg["max_np"])
    argv = [*HORA, "run", "-np", "2", "--min-np", "2", "--max-np", max_np,
            "--host-discovery-script", str(discover), "--elastic-timeout", "40", *(extra or []),
            sys.executable, str(HERE / "elastic_faults_worker.py"), json.dumps(cfg)]  # fmt: skip
    env = dict(os.environ, HOROVOD_GLOO_TIMEOUT_SECONDS="10")
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=110, env=env)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    done = {}
    for line in out.splitlines():
        if "DONE " in line:
            report = json.loads(line.split("DONE ", 1)[1])
            done[report["id"]] = report
    return case, proc.returncode, out, done, took


def _check_training(case: dict, done: dict, out: str) -> None:
    assert set(done) == case["survivors"], out
    expected = [-0.01 * sum(range(1, STEPS + 1))] * 4
    first = next(iter(done.values()))
    for report in done.values():
        assert report["size"] == case["size"], out
        assert report["step"] == STEPS, out
        # no committed step lost or repeated, and the counter is exact
        assert [s for s, _ in report["history"]] == list(range(1, STEPS + 1)), out
        assert report["samples"] == sum(8 * n for _, n in report["history"]), out
        assert report["params"] == first["params"], out  # identical on every rank
        assert report["params"] == pytest.approx(expected), out
    assert sorted(r["rank"] for r in done.values()) == list(range(case["size"])), out


def _record(phase: str, fault: str, code: int, took: float, resets: int, tmp: Path, done) -> None:
    """Appends the case's outcome to $HORA_ELASTIC_FAULTS_LOG (when set), for the write-up."""
    path = os.environ.get("HORA_ELASTIC_FAULTS_LOG")
    if not path:
        return
    recovery = None
    t_fault = tmp / "t_fault"
    if t_fault.exists():
        after = [r["resumed"][-1] for r in done.values() if r["resumed"]]
        if after:
            recovery = round(max(after) - float(t_fault.read_text()), 2)
    with open(path, "a") as f:
        f.write(json.dumps({"phase": phase, "fault": fault, "code": code, "seconds": round(took, 1),
                            "resets": resets, "recovery_s": recovery}) + "\n")  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("phase", PHASES)
def test_a_fault_in_each_phase(tmp_path, phase: str, fault: str) -> None:
    case, code, out, done, took = _run_case(tmp_path, phase, fault)
    _record(phase, fault, code, took, max((r["resets"] for r in done.values()), default=-1),
            tmp_path, done)  # fmt: skip
    assert code == 0, out[-6000:]
    _check_training(case, done, out[-6000:])
    # Horovod's reset count: the oldest survivors went through every re-formation
    assert max(r["resets"] for r in done.values()) == case["resets"], out[-6000:]
    assert out.count(" formed with ") == case["resets"], out[-6000:]
    assert not _left_behind(str(tmp_path)), out[-6000:]
