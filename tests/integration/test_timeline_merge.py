"""``hora timeline``: every rank records its own file; the merge has one process row per rank
and the summary's totals add up to what the merged trace holds."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from harness import run_ranks
from hora.lab import timeline as tool

NP = 3
SLOW = 2  # the rank that sleeps before each submission: the straggler


def _job(rank: int) -> None:
    import time

    import numpy as np

    import hora as hvd

    hvd.init()
    for _step in range(4):
        if rank == SLOW:
            time.sleep(0.3)
        handles = [hvd.allreduce_async(np.ones(1000, np.float32), name=f"w{i}") for i in range(3)]
        handles.append(hvd.allgather_async(np.ones(2), name="g"))
        for h in handles:
            hvd.synchronize(h)
    hvd.shutdown()


def _top_level_spans(events: list[dict]) -> dict[tuple[int, int], float]:
    """Per (pid, tid): the summed duration of the outermost B/E spans."""
    depth: dict[tuple[int, int], int] = defaultdict(int)
    start: dict[tuple[int, int], float] = {}
    total: dict[tuple[int, int], float] = defaultdict(float)
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        if e["ph"] == "B":
            if depth[key] == 0:
                start[key] = e["ts"]
            depth[key] += 1
        elif e["ph"] == "E":
            depth[key] -= 1
            if depth[key] == 0:
                total[key] += e["ts"] - start[key]
    return total


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    tmp = tmp_path_factory.mktemp("tl")
    env = {"HOROVOD_TIMELINE": str(tmp / "tl.{rank}.json")}
    run_ranks(_job, NP, timeout=90, env=env)
    return [tmp / f"tl.{r}.json" for r in range(NP)]


def _run(*argv: str) -> tuple[int, str]:
    """``hora timeline ARGV`` in this process (the command module the CLI dispatches to)."""
    parser = argparse.ArgumentParser(prog="hora timeline")
    tool.configure(parser)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = tool.command(parser.parse_args(list(argv)))
    return rc, out.getvalue()


@pytest.mark.timeout(120)
def test_every_rank_records_and_the_merge_has_a_row_per_rank(
    traces: list[Path], tmp_path: Path
) -> None:
    for r, path in enumerate(traces):
        head = json.loads(path.read_text())[0]
        assert head["args"]["rank"] == r and head["args"]["size"] == NP
    merged = tmp_path / "merged.json"
    rc, _ = _run(*map(str, reversed(traces)), "-o", str(merged))
    assert rc == 0
    events = json.loads(merged.read_text())
    rows = [e for e in events if e.get("name") == "process_name"]
    assert sorted((e["pid"], e["args"]["name"]) for e in rows) == [
        (r, f"rank {r}") for r in range(NP)
    ]
    assert {e["pid"] for e in events} == set(range(NP))
    # the same tensor has the same thread id on every rank
    threads = {
        (e["pid"], e["args"]["name"]): e["tid"] for e in events if e.get("name") == "thread_name"
    }
    assert len({threads[(r, "allreduce.w0")] for r in range(NP)}) == 1


@pytest.mark.timeout(120)
def test_summary_totals_add_up_to_the_trace(traces: list[Path], tmp_path: Path) -> None:
    merged, summary_path = tmp_path / "merged.json", tmp_path / "summary.json"
    rc, text = _run(*map(str, traces), "-o", str(merged), "--summary-json", str(summary_path))
    assert rc == 0
    s = json.loads(summary_path.read_text())
    in_trace = sum(_top_level_spans(json.loads(merged.read_text())).values())
    assert s["total_us"] == pytest.approx(in_trace, rel=1e-9)
    assert sum(p["us"] for p in s["phases"].values()) == pytest.approx(in_trace, rel=1e-9)
    assert sum(t["total_us"] for t in s["tensors"].values()) == pytest.approx(in_trace, rel=1e-9)
    assert sum(p["share"] for p in s["phases"].values()) == pytest.approx(1.0)
    assert s["operations"] == 4 * 4
    # the printed table: the phase lines add up to the total line
    table = {ln[:24].strip(): float(ln[24:36]) for ln in text.splitlines()[3:11]}
    assert table.pop("total") == pytest.approx(sum(table.values()), abs=0.01)
    assert table.keys() == set(s["phases"])
    # the sleeping rank is the straggler, and the advice says so
    assert s["tensors"]["allreduce.w0"]["straggler"]["rank"] == SLOW
    assert s["phases"]["wait for slowest rank"]["share"] > 0.5
    assert any(r.startswith(f"rank {SLOW} submitted last") for r in s["recommendations"])
    assert f"rank {SLOW} submitted last" in text


@pytest.mark.timeout(60)
def test_rank_zero_alone_uses_its_ready_marks(traces: list[Path], tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    rc, _ = _run(str(traces[0]), "--summary-json", str(summary_path))
    assert rc == 0
    s = json.loads(summary_path.read_text())
    assert s["ranks"] == [0] and s["tensors"]["allreduce.w1"]["straggler"]["rank"] == SLOW


def test_bad_input_is_named(tmp_path: Path, traces: list[Path]) -> None:
    junk = tmp_path / "junk.json"
    junk.write_text("{}")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert _run(str(junk))[0] == 2
        assert _run(str(traces[0]), str(traces[0]))[0] == 2
    assert "junk.json: not a hora/Horovod timeline" in err.getvalue()
    assert "two files hold the timeline of rank(s) [0]" in err.getvalue()


@pytest.mark.timeout(60)
def test_hora_timeline_is_a_cli_command(traces: list[Path]) -> None:
    cli = "import sys; from hora.launch.cli import main; sys.exit(main())"
    done = subprocess.run(
        [sys.executable, "-c", cli, "timeline", *map(str, traces)],
        capture_output=True, text=True, timeout=50,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "wait for slowest rank" in done.stdout and "recommendations:" in done.stdout


@pytest.mark.timeout(60)
def test_align_ops_undoes_a_skewed_clock(traces: list[Path], tmp_path: Path) -> None:
    """Rank 1's file claims a start 5 s late (a host whose clock is ahead): by wall clock its
    operations land 5 s late; lining up the shared collectives puts them back."""
    events = json.loads(traces[1].read_text())
    events[0]["args"]["start_time_since_epoch_in_micros"] += 5_000_000
    skewed = tmp_path / "tl.1.json"
    skewed.write_text(json.dumps(events))
    files = [str(traces[0]), str(skewed), str(traces[2])]

    def lead(merged: list[dict]) -> float:
        # rank 1's first operation measured from rank 0's: independent of which rank's start
        # the merged trace takes as its origin (the earliest, which rank 1 may have been)
        def first(pid: int) -> float:
            return min(e["ts"] for e in merged if e["pid"] == pid and e["ph"] == "B")

        return first(1) - first(0)

    def rank1_first_op(align: str, out: Path) -> float:
        assert _run(*files, "-o", str(out), "--align", align)[0] == 0
        return lead(json.loads(out.read_text()))

    assert _run(*map(str, traces), "-o", str(tmp_path / "ref.json"))[0] == 0
    want = lead(json.loads((tmp_path / "ref.json").read_text()))
    assert rank1_first_op("wall", tmp_path / "wall.json") == pytest.approx(want + 5e6, abs=1e3)
    assert rank1_first_op("ops", tmp_path / "ops.json") == pytest.approx(want, abs=5e4)
