"""Elastic jobs end to end: `hora run --min-np ...` with real workers that die or join.

Each test starts a real launcher and real worker processes on this host; every one has a hard
timeout, and the launcher's own ``--elastic-timeout`` is short so that a job that cannot re-form
fails fast instead of waiting."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HORA = [sys.executable, "-c", "import sys; from hora.launch.cli import main; sys.exit(main())"]

# A worker that counts committed epochs: each epoch allreduces ones, so the sum is the world
# size and the epoch adds exactly 1.0 to ``total`` whatever the size. ``VICTIM`` (a worker id)
# kills itself at the start of epoch ``KILL_AT``, without a commit.
WORKER = """
import os, signal, sys, time
import numpy as np
import hora as hvd
from hora.elastic import ObjectState, run

EPOCHS, KILL_AT, VICTIM = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ME = os.environ["HORA_ELASTIC_ID"]
JOIN_FILE = sys.argv[4] if len(sys.argv) > 4 else ""
hvd.init()
state = ObjectState(hvd.broadcast_object, hvd.rank, epoch=0, total=0.0)
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])

@run
def train(state):
    while state.epoch < EPOCHS:
        if state.epoch == KILL_AT and ME == VICTIM:
            os.kill(os.getpid(), signal.SIGKILL)
        if JOIN_FILE and state.epoch == KILL_AT and hvd.rank() == 0 and hvd.size() == 2:
            with open(JOIN_FILE, "w") as f:
                f.write("localhost:3\\n")
        out = hvd.allreduce(np.ones(1000, np.float32), op=hvd.Sum, name="grad")
        assert float(out[0]) == hvd.size(), (out[0], hvd.size())
        state.total += float(out[0]) / hvd.size()
        state.epoch += 1
        time.sleep(0.4 if JOIN_FILE and hvd.size() == 2 else 0.05)  # time for a joiner
        state.commit()

train(state)
print(f"DONE id={ME} rank={hvd.rank()} size={hvd.size()} epoch={state.epoch} "
      f"total={state.total} resets={resets}", flush=True)
hvd.shutdown()
"""


def _run(tmp_path: Path, flags: list[str], args: list[str], timeout: float) -> tuple[int, str]:
    script = tmp_path / "elastic_worker.py"
    script.write_text(textwrap.dedent(WORKER))
    proc = subprocess.run(
        [*HORA, "run", *flags, sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout + proc.stderr


def _done(out: str) -> dict[str, str]:
    """The DONE line of each worker id that printed one."""
    lines = [ln.split("DONE ", 1)[1] for ln in out.splitlines() if "DONE " in ln]
    return {ln.split()[0]: ln for ln in lines}


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "victim,survivors",
    [("127.0.0.1:0", ["localhost:0", "localhost:1"]), ("localhost:0", ["127.0.0.1:0"])],
    ids=["rank2", "rank0"],
)
def test_a_killed_worker_blacklists_its_host_and_the_rest_finish_from_the_last_commit(
    tmp_path, victim, survivors
) -> None:
    code, out = _run(
        tmp_path,
        ["-np", "3", "--min-np", "1", "-H", "localhost:2,127.0.0.1:1", "--elastic-timeout", "60"],
        ["6", "3", victim],
        timeout=140,
    )
    assert code == 0, out
    done = _done(out)
    assert set(done) == {f"id={s}" for s in survivors}, out
    size = len(survivors)
    for line in done.values():
        # every epoch was counted exactly once, the last three in the smaller world
        assert f"size={size} epoch=6 total=6.0 resets=[{size}]" in line, out
    assert sorted(line.split()[1] for line in done.values()) == [
        f"rank={r}" for r in range(size)
    ], out
    assert "exited with 137" in out, out  # 128 + SIGKILL
    assert f"host {victim.split(':')[0]} is blacklisted" in out, out
    assert f"round 1 formed with {size} workers" in out, out


@pytest.mark.timeout(60)
def test_too_few_workers_left_ends_the_job(tmp_path) -> None:
    code, out = _run(
        tmp_path,
        ["-np", "2", "--min-np", "2", "-H", "localhost:1,127.0.0.1:1", "--elastic-timeout", "30"],
        ["6", "2", "127.0.0.1:0"],
        timeout=50,
    )
    assert code != 0, out
    assert "only 1 workers are left, fewer than --min-np 2" in out, out
    assert not _done(out), out


@pytest.mark.timeout(150)
def test_a_discovered_slot_joins_and_gets_the_state(tmp_path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    code, out = _run(
        tmp_path,
        [
            "-np",
            "2",
            "--min-np",
            "2",
            "--max-np",
            "3",
            "--host-discovery-script",
            str(discover),
            "--elastic-timeout",
            "60",
        ],
        ["30", "3", "nobody", str(hosts)],
        timeout=140,
    )
    assert code == 0, out
    done = _done(out)
    assert set(done) == {"id=localhost:0", "id=localhost:1", "id=localhost:2"}, out
    for line in done.values():
        assert "size=3 epoch=30 total=30.0" in line, out
    assert "round 1 formed with 3 workers" in out, out


@pytest.mark.timeout(150)
def test_a_blacklisted_host_gets_a_new_worker_after_its_cooldown(tmp_path) -> None:
    flags = ["-np", "3", "--min-np", "2", "-H", "localhost:2,127.0.0.1:1",
             "--elastic-timeout", "60"]  # fmt: skip
    code, out = _run(
        tmp_path,
        [*flags, "--blacklist-cooldown-range", "1", "1"],
        # the last argument only slows the epochs while the world has two workers
        ["30", "3", "127.0.0.1:0", str(tmp_path / "not_read")],
        timeout=140,
    )
    assert code == 0, out
    done = _done(out)
    assert set(done) == {"id=localhost:0", "id=localhost:1", "id=127.0.0.1:0+1"}, out
    for line in done.values():
        assert "size=3 epoch=30 total=30.0" in line, out  # every epoch counted exactly once
    assert "worker 2 (127.0.0.1:0) exited with 137" in out, out
    assert "host 127.0.0.1 is blacklisted for 1.0s" in out, out
    assert "started worker 3 (127.0.0.1:0+1)" in out, out
    assert "formed with 3 workers" in out, out


def _pid_of(worker_id: str) -> int | None:
    """The python process started for elastic worker ``worker_id`` (from its environment)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        mine = f"HORA_ELASTIC_ID={worker_id}".encode() in env and b"elastic.py" in cmd
        if mine and not cmd.startswith(b"/bin/sh"):
            return int(entry)
    return None


@pytest.mark.timeout(300)
def test_the_elastic_mnist_example_survives_a_killed_worker() -> None:
    """The example under `hora run`: SIGKILL one worker in epoch 1; the job re-forms with two
    workers (localhost's; 127.0.0.1 is blacklisted), the TorchState (model, optimizer, sampler)
    rolls back, and training finishes."""
    argv = [*HORA, "run", "-np", "3", "--min-np", "2", "-H", "127.0.0.1:1,localhost:2",
            "--elastic-timeout", "60", sys.executable,
            str(ROOT / "examples" / "pytorch_mnist_elastic.py"), "--epochs", "3"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)  # fmt: skip
    lines: list[str] = []
    killed = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if killed is None and "Train Epoch: 1 batch 10 " in line:
                killed = _pid_of("127.0.0.1:0")
                assert killed is not None, "".join(lines)
                os.kill(killed, signal.SIGKILL)
        code = proc.wait(timeout=280)
    finally:
        proc.kill()
    out = "".join(lines)
    assert code == 0, out[-4000:]
    assert killed is not None, out[-4000:]
    assert "exited with 137" in out and "host 127.0.0.1 is blacklisted" in out, out[-4000:]
    assert "Job re-formed: 2 workers" in out, out[-4000:]
    assert re.search(r"Train Epoch: 2 batch \d+ size 2\t", out), out[-4000:]
    accuracy = re.search(r"Done: 2 workers, test accuracy (\d+\.\d+)%", out)
    assert accuracy is not None and float(accuracy.group(1)) > 60.0, out[-4000:]
