"""`hora run` end to end on this host: failure propagation, signals, output, secrets, mpirun,
and hora.run. Real processes; every wait has a timeout."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from harness import pid_alive

HORA = [sys.executable, "-c", "import sys; from hora.launch.cli import main; sys.exit(main())"]


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _pids(text: str) -> list[int]:
    return [int(line.split("pid=")[1].split()[0]) for line in text.splitlines() if "pid=" in line]


@pytest.mark.timeout(60)
def test_failed_rank_is_named_and_the_others_are_stopped(tmp_path) -> None:
    worker = _script(
        tmp_path,
        """
        import os, sys, time
        rank = int(os.environ["HORA_RANK"])
        print(f"pid={os.getpid()}", flush=True)
        if rank == 2:
            time.sleep(5.0)  # the others have started and printed, even on a loaded machine
            sys.exit(3)
        time.sleep(60)
    """,
    )
    started = time.monotonic()
    done = subprocess.run([*HORA, "run", "-np", "4", sys.executable, worker],
                          capture_output=True, text=True, timeout=45)  # fmt: skip
    assert done.returncode != 0
    assert "Process 2 exit with status code 3." in done.stderr
    assert "Terminating remaining workers after failure of Process 2." in done.stderr
    pids = _pids(done.stdout)
    assert len(pids) == 4
    assert _wait_gone(pids, 3.0) == []
    assert time.monotonic() - started < 30  # not the workers' 60 s sleep


@pytest.mark.parametrize(("sig", "word"), [(signal.SIGTERM, "terminated"),
                                           (signal.SIGINT, "interrupted")])  # fmt: skip
@pytest.mark.timeout(60)
def test_signal_to_the_launcher_stops_every_worker(tmp_path, sig, word) -> None:
    worker = _script(
        tmp_path,
        """
        import os, time
        print(f"pid={os.getpid()}", flush=True)
        time.sleep(60)
    """,
    )
    argv = [*HORA, "run", "-np", "3", sys.executable, worker]
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    lines = [launcher.stdout.readline() for _ in range(3)]
    pids = _pids("".join(lines))
    assert len(pids) == 3 and all(pid_alive(p) for p in pids)
    launcher.send_signal(sig)
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + sig
    assert word in err
    assert _wait_gone(pids, 3.0) == []


@pytest.mark.timeout(60)
def test_output_prefixes_files_and_secret_stays_off_command_lines(tmp_path) -> None:
    worker = _script(
        tmp_path,
        """
        import os, sys, time
        rank = os.environ["HORA_RANK"]
        secret = os.environ["HORA_SECRET_KEY"]
        cmdlines = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmdlines.append(f.read())
                except OSError:
                    pass
        print("secret-on-a-command-line", any(secret.encode() in c for c in cmdlines))
        print("local", os.environ["HORA_LOCAL_RANK"], os.environ["HOROVOD_SIZE"])
        sys.stdout.write("a\\rb\\n")
        print("oops", file=sys.stderr)
    """,
    )
    out_dir = tmp_path / "logs"
    argv = [*HORA, "run", "-np", "2", "--output-filename", str(out_dir), sys.executable, worker]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=45)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.replace("\r", "\n").splitlines()
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:secret-on-a-command-line False" in lines
        assert f"[{rank}]<stdout>:local {rank} 2" in lines
        assert f"[{rank}]<stdout>:a" in lines and f"[{rank}]<stdout>:b" in lines
        assert f"[{rank}]<stderr>:oops" in done.stderr.splitlines()
        assert (out_dir / f"rank.{rank}" / "stdout").read_bytes().endswith(b"a\rb\n")
        assert (out_dir / f"rank.{rank}" / "stderr").read_text() == "oops\n"


@pytest.mark.timeout(60)
def test_timestamp_prefix_and_exit_zero() -> None:
    done = subprocess.run([*HORA, "run", "-np", "1", "--prefix-output-with-timestamp",
                           sys.executable, "-c", "print('x')"],
                          capture_output=True, text=True, timeout=45)  # fmt: skip
    assert done.returncode == 0
    assert done.stdout.rstrip().endswith("[0]<stdout>:x")
    assert not done.stdout.startswith("[0]")


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else text.strip()


@pytest.mark.timeout(60)
@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                    reason="the kernel gives no transparent huge pages here")  # fmt: skip
def test_torch_tensors_of_a_worker_lie_on_huge_pages(tmp_path) -> None:
    worker = _script(
        tmp_path,
        """
        import torch
        t = torch.ones(8 << 20)  # 32 MiB, every page touched
        ptr, huge = t.data_ptr(), 0
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split()[0]
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= ptr < hi
                elif inside and head == "AnonHugePages:":
                    huge = int(line.split()[1])
        print(f"huge_kib={huge}")
        """,
    )
    done = subprocess.run([*HORA, "run", "-np", "1", sys.executable, worker],
                          capture_output=True, text=True, timeout=45)  # fmt: skip
    assert done.returncode == 0, done.stderr
    huge = int(done.stdout.split("huge_kib=")[1].split()[0])
    assert huge >= 16 << 10, done.stdout  # at least half the tensor on 2 MiB pages


@pytest.mark.timeout(60)
def test_preflight_errors_before_any_worker_starts() -> None:
    done = subprocess.run([*HORA, "run", "-np", "2", "-H", "localhost:1", "true"],
                          capture_output=True, text=True, timeout=45)  # fmt: skip
    assert done.returncode == 2 and "only 1 slots" in done.stderr
    done = subprocess.run([*HORA, "run", "-np", "1", "-H", "no-such-host.invalid:1",
                           "--start-timeout", "10", "true"],
                          capture_output=True, text=True, timeout=45)  # fmt: skip
    assert done.returncode == 2
    assert "preflight failed" in done.stderr and "no-such-host.invalid" in done.stderr


@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_mpi_launch_prints_open_mpi_ranks() -> None:
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI's mpirun is not installed")
    code = (  # one write per line: unbuffered print() writes each piece on its own
        "import os,sys; e=os.environ; sys.stdout.write('ompi %s %s %d\\n' % ("
        "e['OMPI_COMM_WORLD_RANK'], e['HORA_CONTROLLER'], len(e['HORA_SECRET_KEY'])))"
    )
    done = subprocess.run([*HORA, "run", "--mpi", "-np", "2", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=80)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "[1,0]<stdout>:ompi 0 mpi 64" in lines and "[1,1]<stdout>:ompi 1 mpi 64" in lines


@pytest.mark.timeout(90)
def test_run_api_returns_results_by_rank() -> None:
    from hora.errors import LaunchError
    from hora.runner import run

    # Defined here so that cloudpickle sends them by value (workers cannot import this file).
    def rank_info(scale: int) -> tuple[int, int, int]:
        return int(os.environ["HORA_RANK"]) * scale, int(os.environ["HORA_SIZE"]), os.getpid()

    def fails_on_rank_one() -> None:
        if os.environ["HORA_RANK"] == "1":
            raise ZeroDivisionError("rank one failed")
        time.sleep(60)

    results = run(rank_info, args=(10,), num_proc=3)
    assert [r[:2] for r in results] == [(0, 3), (10, 3), (20, 3)]
    assert len({r[2] for r in results}) == 3 and os.getpid() not in {r[2] for r in results}
    with pytest.raises(LaunchError, match="rank 1 raised") as info:
        run(fails_on_rank_one, num_proc=2)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    with pytest.raises(LaunchError, match="could not be sent back"):
        run(threading.Lock, num_proc=1)


@pytest.mark.timeout(90)
def test_run_api_names_a_rank_that_aborts_after_returning() -> None:
    """A rank whose value came back but whose process then died (here: an abort at exit, as a
    C++ library can do) fails the job with a message that says so and names the signal."""
    from hora.errors import LaunchError
    from hora.runner import run

    def aborts_at_exit_on_rank_one() -> int:
        import atexit

        from hora.identity import detect
        from hora.rendezvous.client import StoreClient

        ident = detect()
        if ident.rank == 1:

            def abort_once_rank_zero_returned() -> None:
                assert ident.rendezvous_addr and ident.rendezvous_port and ident.secret
                with StoreClient(
                    ident.rendezvous_addr, ident.rendezvous_port, ident.secret
                ) as store:
                    store.get("runfunc_result/0", timeout=30)
                os.abort()

            atexit.register(abort_once_rank_zero_returned)
        return ident.rank

    with pytest.raises(LaunchError) as info:
        run(aborts_at_exit_on_rank_one, num_proc=2)
    assert re.search(
        r"every rank returned its result, then rank 1 exited with status "
        r"(-6 \(killed by SIGABRT\)|134 \(SIGABRT, as a shell reports it\)) while shutting down",
        str(info.value),
    ), str(info.value)
