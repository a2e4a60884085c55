"""``hora bench allreduce --netns`` for real: two network-namespace hosts of two ranks each on a
tc-limited bridge, hora, Gloo and Open MPI (where it runs) with tiny sizes; the report's rows,
ratios and link bound, hora's links (shared memory within a host, TCP across), the bytes the
links carried, and nothing left behind, also after Ctrl-C and SIGTERM. The bench runs as a
subprocess of the test (``python -m hora.lab``); the option checks run in the test process."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hora.lab import allreduce, netns

SIZES = (256 << 10, 1 << 20)  # both above hora's small-message threshold: hierarchical


def _reason() -> str | None:
    return netns.unavailable_reason()


needs_hosts = pytest.mark.skipif(
    _reason() is not None, reason=f"cannot make namespace hosts: {_reason()}"
)


def _bench(tmp: Path, *argv: str) -> subprocess.Popen[str]:
    env = {**os.environ, "TMPDIR": str(tmp), "TF_CPP_MIN_LOG_LEVEL": "3"}
    cmd = [sys.executable, "-m", "hora.lab", "allreduce", "--netns", "2", *argv]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def _left_behind(pid: int, tmp: Path) -> list[str]:
    """Namespaces and the bridge of bench process ``pid``, and processes started from ``tmp``."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found = [n.split()[0] for n in names.splitlines() if n.startswith(f"{netns.NS_PREFIX}{pid}-")]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found += re.findall(rf"\b({netns.BRIDGE_PREFIX}{pid}\w*)", links)
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(tmp) in cmdline and int(entry) != os.getpid():
            found.append(f"process {entry}: {cmdline.replace(chr(0), ' ')}")
    return found


def _rows(stdout: str) -> dict[tuple[str, str], list[str]]:
    """The report table's rows by (size, backend)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["size", "backend"])
    assert lines[start].split() == ["size", "backend", "iters", "p50", "ms", "p90", "ms",
                                    "busbw", "GB/s", "vs", "best", "of", "link"]  # fmt: skip
    rows, size = {}, ""
    for line in lines[start + 2 :]:
        cells = line.split()
        if not cells or not cells[-1][0].isdigit():
            break
        if len(cells) == 9:  # the first row of a size names it ("256 KiB")
            size, cells = " ".join(cells[:2]), cells[2:]
        rows[(size, cells[0])] = cells
    return rows


@pytest.mark.multihost
@needs_hosts
@pytest.mark.timeout(90)
def test_two_hosts_report_rows_ratios_link_bound_and_hora_links(tmp_path: Path) -> None:
    out = tmp_path / "ar.json"
    proc = _bench(tmp_path, "--link-rate", "1gbit", "--sizes", "256K,1M", "--iters", "3",
                  "--backends", "hora,gloo,mpi", "--timeout", "45", "--json", str(out))  # fmt: skip
    stdout, stderr = proc.communicate(timeout=80)
    assert proc.returncode == 0, stdout + stderr
    doc = json.loads(out.read_text())
    ran = [b for b in ("hora", "gloo", "mpi") if b not in doc["skipped"]]
    assert ran[:2] == ["hora", "gloo"], doc["skipped"]  # Open MPI may be skipped, with why
    rows = _rows(stdout)
    assert set(rows) == {(s, b) for s in ("256 KiB", "1 MiB") for b in ran}, stdout
    for cells in rows.values():
        _, iters, p50, p90, busbw, vs, of_link = cells
        assert iters == "3" and float(p50) > 0 and float(p90) >= float(p50)
        assert vs.endswith("x") and float(vs[:-1]) > 0
        assert float(of_link) == pytest.approx(float(busbw) / 0.125, abs=0.02)
    assert "2 hosts x 2 ranks (network namespaces), 1gbit links" in stdout.splitlines()[0]
    assert "link: 1gbit per host and direction" in stdout
    assert "flat ring of all 4 ranks" in stdout and "busbw <= 0.125 GB/s" in stdout
    assert "(hierarchical), busbw <= 0.188 GB/s" in stdout
    meta = doc["meta"]
    assert (meta["hosts"], meta["ranks_per_host"], meta["np"]) == (2, 2, 4)

    # hora: ranks 0,1 on host0 and 2,3 on host1, in two network namespaces; shared memory to
    # the host's other rank, TCP to the other host's, and the hierarchical allreduce chosen
    layout = {r["rank"]: r for r in meta["layouts"]["hora"]}
    assert sorted(layout) == [0, 1, 2, 3]
    assert [layout[r]["host"] for r in range(4)] == ["host0", "host0", "host1", "host1"]
    assert layout[0]["netns"] == layout[1]["netns"] != layout[2]["netns"] == layout[3]["netns"]
    for rank, mate, others in ((0, 1, {2, 3}), (1, 0, {2, 3}), (2, 3, {0, 1}), (3, 2, {0, 1})):
        assert layout[rank]["hosts"] == [0, 0, 1, 1]
        assert layout[rank]["shm_peers"] == [mate], layout[rank]
        assert mate not in layout[rank]["tcp_peers"], layout[rank]
        assert set(layout[rank]["tcp_peers"]) & others, layout[rank]
        assert "allreduce:hierarchical (auto)" in layout[rank]["choices"]
    assert "hora rank 0 on host0: shared memory to [1], TCP to [2" in stdout

    # every allreduce sends at least 2(H-1)/H of the buffer out of each of the H hosts: the
    # check, 2 warm-up and 3 timed calls per size, over the shaped links
    least = sum(2 * s * (1 + 2 + 3) for s in SIZES)
    for backend in ran:
        assert meta["link_bytes"][backend] >= least, (backend, meta["link_bytes"])
    assert "bytes sent over the hosts' links: hora" in stdout
    assert _left_behind(proc.pid, tmp_path) == []


@pytest.mark.multihost
@needs_hosts
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_run_leaves_nothing_behind(tmp_path: Path, sig: int) -> None:
    proc = _bench(tmp_path, "--link-rate", "100mbit", "--sizes", "64M", "--iters", "50",
                  "--backends", "hora", "--timeout", "50")  # fmt: skip
    try:
        deadline = time.monotonic() + 40
        while "[hora] starting" not in _peek(proc) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # the ranks are up in their namespaces, moving 64 MiB at 100 Mbit/s
        assert proc.poll() is None, proc.communicate()
        assert len(_left_behind(proc.pid, tmp_path)) > 3  # namespaces, bridge, ranks
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert _left_behind(proc.pid, tmp_path) == [], stderr


@pytest.mark.multihost
@needs_hosts
@pytest.mark.timeout(30)
def test_what_a_killed_run_left_is_removed_by_the_next() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid now names nobody
    ns, bridge = f"{netns.NS_PREFIX}{dead.pid}-0", f"{netns.BRIDGE_PREFIX}{dead.pid}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], check=True)
    try:
        assert set(netns.remove_stale()) >= {ns, bridge}
        assert _left_behind(dead.pid, Path("/nonexistent-dir")) == []
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


_seen: dict[int, str] = {}


def _peek(proc: subprocess.Popen[str]) -> str:
    """What ``proc`` wrote to stderr so far (read line by line without blocking for long)."""
    import select

    assert proc.stderr is not None
    while select.select([proc.stderr], [], [], 0.1)[0]:
        line = proc.stderr.readline()
        if not line:
            break
        _seen[proc.pid] = _seen.get(proc.pid, "") + line
    return _seen.get(proc.pid, "")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    allreduce.configure(parser)
    return parser.parse_args(list(argv))


def test_netns_options_are_checked_before_anything_is_made() -> None:
    with pytest.raises(ValueError, match=r"--np 3 does not split evenly over --netns 2"):
        allreduce.config_from_args(_args("--netns", "2", "--np", "3"))
    with pytest.raises(ValueError, match=r"--link-rate '10gb'"):
        allreduce.config_from_args(_args("--netns", "2", "--link-rate", "10gb"))
    with pytest.raises(ValueError, match=r"at least 2 hosts"):
        allreduce.config_from_args(_args("--netns", "1"))
    assert netns.parse_rate("10gbit") == 10**10 and netns.parse_rate("500mbit") == 5 * 10**8
    assert [netns.default_iters(s << 20) for s in (1, 16, 64, 256)] == [200, 32, 8, 5]
