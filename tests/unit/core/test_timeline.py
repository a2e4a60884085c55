"""Timeline: records, pseudo-pids, cycle marks, valid JSON after every flush and after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hora.core.timeline import Timeline


def _load(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())


def _events(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["ph"] != "M"]


def _pid_of(records: list[dict[str, Any]], name: str) -> int:
    (pid,) = [
        r["pid"]
        for r in records
        if r["ph"] == "M" and r["name"] == "process_name" and r["args"]["name"] == name
    ]
    return pid


@pytest.mark.timeout(30)
def test_header_is_valid_json_with_pid0_metadata(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    before = time.time_ns() // 1000
    tl = Timeline(str(path))
    try:
        records = _load(path)
    finally:
        tl.close()
    assert path.read_text().startswith("[")
    assert records[0]["name"] == "process_name" and records[0]["pid"] == 0
    assert records[0]["args"]["start_time_since_epoch_in_micros"] >= before
    assert records[1] == {
        "name": "process_sort_index",
        "ph": "M",
        "pid": 0,
        "args": {"sort_index": 0},
    }


@pytest.mark.timeout(30)
def test_allreduce_phases_produce_expected_records(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path))
    name = "allreduce.grad.0"
    tl.negotiate_start(name, "allreduce")
    tl.negotiate_rank_ready(name, 1)
    tl.negotiate_rank_ready(name, 0)
    tl.negotiate_end(name)
    tl.start(name, "ALLREDUCE")
    tl.activity_start(name, "QUEUE")
    tl.activity_end(name)
    tl.activity_start(name, "MEMCPY_IN_FUSION_BUFFER")
    tl.activity_end(name)
    tl.activity_start(name, "TCP_ALLREDUCE")
    tl.end(name, "float32", (2, 3))  # closes TCP_ALLREDUCE first
    tl.close()
    records = _load(path)
    pid = _pid_of(records, name)
    assert pid != 0
    sort = [r for r in records if r.get("name") == "process_sort_index" and r["pid"] == pid]
    assert sort == [
        {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}
    ]
    events = _events(records)
    assert all(e["pid"] == pid for e in events)
    shape = [(e["ph"], e.get("name")) for e in events]
    assert shape == [
        ("B", "NEGOTIATE_ALLREDUCE"),
        ("X", "1"),
        ("X", "0"),
        ("E", None),
        ("B", "ALLREDUCE"),
        ("B", "QUEUE"),
        ("E", None),
        ("B", "MEMCPY_IN_FUSION_BUFFER"),
        ("E", None),
        ("B", "TCP_ALLREDUCE"),
        ("E", None),
        ("E", None),
    ]
    assert all(e["dur"] == 0 for e in events if e["ph"] == "X")
    assert events[-1]["args"] == {"dtype": "float32", "shape": "[2, 3]"}
    stamps = [e["ts"] for e in events]
    assert stamps == sorted(stamps) and all(isinstance(t, int) and t >= 0 for t in stamps)


@pytest.mark.timeout(30)
def test_each_tensor_gets_one_pseudo_pid(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path))
    for _ in range(3):
        for name in ("a", 'we"ird\\name', "b"):
            tl.start(name, "BROADCAST")
            tl.end(name)
    tl.close()
    records = _load(path)
    names = [
        r["args"]["name"] for r in records if r.get("name") == "process_name" and r["pid"] != 0
    ]
    assert names == ["a", 'we"ird\\name', "b"]
    pids = {name: _pid_of(records, name) for name in names}
    assert sorted(pids.values()) == [1, 2, 3]
    for pid in pids.values():
        mine = [e for e in _events(records) if e["pid"] == pid]
        assert [e["ph"] for e in mine] == ["B", "E"] * 3
        assert all("args" not in e for e in mine if e["ph"] == "E")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mark", [False, True])
def test_mark_cycles(tmp_path: Path, mark: bool) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path), mark_cycles=mark)
    for _ in range(4):
        tl.mark_cycle()
    tl.close()
    cycles = [r for r in _load(path) if r.get("name") == "CYCLE_START"]
    if mark:
        assert len(cycles) == 4
        assert all(c["ph"] == "i" and c["s"] == "g" and "ts" in c for c in cycles)
    else:
        assert cycles == []


@pytest.mark.timeout(60)
def test_file_parses_after_every_flush(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path), mark_cycles=True, flush_interval=0.0)
    total = 0
    for step in range(50):
        for i in range(step % 7):
            tl.mark_cycle()
            tl.start(f"t{i}", "ALLGATHER")
            tl.end(f"t{i}", "int64", (step,))
            total += 1
        assert tl.flush(timeout=10.0)
        records = _load(path)
        assert sum(1 for r in records if r.get("name") == "ALLGATHER") == total
    tl.close()
    assert len(_events(_load(path))) == 3 * total


@pytest.mark.timeout(30)
def test_close_is_idempotent_from_another_thread_and_drops_later_events(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path))
    tl.start("x", "ALLREDUCE")
    tl.end("x")
    closer = threading.Thread(target=tl.close)
    closer.start()
    closer.join(timeout=20)
    assert not closer.is_alive()
    assert tl.closed
    tl.close()
    tl.start("late", "ALLREDUCE")
    tl.mark_cycle()
    assert tl.flush(timeout=1.0) is False
    records = _load(path)
    assert [e.get("name") for e in _events(records)] == ["ALLREDUCE", None]
    assert all(r.get("args", {}).get("name") != "late" for r in records)


@pytest.mark.timeout(30)
def test_an_old_file_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text("not json at all " * 1000)
    tl = Timeline(str(path))
    try:
        assert _load(path)[0]["args"]["name"] == "hora"
    finally:
        tl.close()
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_bad_arguments_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="non-empty file path"):
        Timeline("")
    with pytest.raises(ValueError, match="flush_interval"):
        Timeline(str(tmp_path / "t.json"), flush_interval=-1)
    with pytest.raises(OSError):
        Timeline(str(tmp_path / "missing-dir" / "t.json"))


_CHILD = textwrap.dedent(
    """
    import sys
    from hora.core.timeline import Timeline

    tl = Timeline(sys.argv[1], mark_cycles=True, flush_interval=0.001)
    i = 0
    while True:
        name = f"allreduce.layer{i % 50}"
        tl.mark_cycle()
        tl.negotiate_start(name, "ALLREDUCE")
        tl.negotiate_rank_ready(name, 0)
        tl.negotiate_end(name)
        tl.start(name, "ALLREDUCE")
        tl.activity_start(name, "MEMCPY_IN_FUSION_BUFFER")
        tl.activity_end(name)
        tl.end(name, "float32", (i, 4))
        i += 1
    """
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0.3, 0.7, 1.1])
def test_sigkill_mid_run_leaves_parseable_file(tmp_path: Path, delay: float) -> None:
    path = tmp_path / "t.json"
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    child = subprocess.Popen([sys.executable, str(script), str(path)])
    try:
        deadline = time.monotonic() + 60
        while (not path.exists() or path.stat().st_size < 4096) and time.monotonic() < deadline:
            assert child.poll() is None, "timeline writer child exited early"
            time.sleep(0.05)
        assert path.exists() and path.stat().st_size >= 4096, "child wrote nothing in 60 s"
        time.sleep(delay)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    records = _load(path)
    assert records[0]["name"] == "process_name"
    assert any(r.get("name") == "CYCLE_START" for r in records)
    assert any(r.get("name") == "ALLREDUCE" for r in records)


def test_header_meta_fused_bytes_and_marks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json as _json

    from hora.core.runtime import timeline_path
    from hora.core.timeline import Timeline

    path = tmp_path / "t.json"
    tl = Timeline(path, meta={"rank": 3, "fusion_threshold_bytes": 1024})
    tl.start("a", "ALLREDUCE")
    tl.end("a", "float32", (2, 3), fused_bytes=48)
    tl.start("b", "ALLREDUCE")
    tl.end("b", "float32", (2,))
    tl.mark("AUTOTUNE", {"cycle_time_ms": 2.5})
    tl.close()
    events = _json.loads(path.read_text())
    assert events[0]["args"]["rank"] == 3 and events[0]["args"]["fusion_threshold_bytes"] == 1024
    ends = [e["args"] for e in events if e["ph"] == "E"]
    assert ends == [
        {"dtype": "float32", "shape": "[2, 3]", "fused_bytes": 48},
        {"dtype": "float32", "shape": "[2]"},
    ]
    [mark] = [e for e in events if e["ph"] == "i"]
    assert mark["name"] == "AUTOTUNE" and mark["args"] == {"cycle_time_ms": 2.5}
    assert timeline_path("/x/tl.{rank}.json", 2) == "/x/tl.2.json"
    assert timeline_path("/x/tl.json", 0) == "/x/tl.json" and timeline_path("/x/tl.json", 1) == ""
