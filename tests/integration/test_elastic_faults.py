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


def _launch(tmp_path: Path, hosts_text: str, cfg: dict, flags: list[str], **env_extra: str):
    """``hora run`` of the worker with a discovery script reading ``tmp_path/hosts`` (or fixed
    hosts when ``flags`` hold -H): (exit code, output, DONE reports by worker id, seconds)."""
    hosts = tmp_path / "hosts"
    hosts.write_text(hosts_text)
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    cfg = {"phase": "none", "fault": "none", "victim": "", "steps": STEPS, "max_np": 4,
           "dir": str(tmp_path), "hosts_file": str(hosts), "hosts_after": "", **cfg}  # fmt: skip
    where = [] if "-H" in flags else ["--host-discovery-script", str(discover)]
    timeout = [] if "HOROVOD_ELASTIC_TIMEOUT" in env_extra else ["--elastic-timeout", "40"]
    argv = [*HORA, "run", *where, *timeout, *flags,
            sys.executable, str(HERE / "elastic_faults_worker.py"), json.dumps(cfg)]  # fmt: skip
    env = dict(os.environ, HOROVOD_GLOO_TIMEOUT_SECONDS="10", **env_extra)
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=110, env=env)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    done = {}
    for line in out.splitlines():
        if "DONE " in line:
            report = json.loads(line.split("DONE ", 1)[1])
            done[report["id"]] = report
    assert not _left_behind(str(tmp_path)), out[-6000:]  # no process of the job left
    return proc.returncode, out, done, took


def _run_case(tmp_path: Path, phase: str, fault: str):
    case = _case(phase, fault)
    max_np = 5 if case["size"] == 5 else 4
    cfg = {"phase": phase, "fault": case["fault"], "victim": case["victim"],
           "hosts_after": case["after"], "max_np": max_np}  # fmt: skip
    flags = ["-np", "2", "--min-np", "2", "--max-np", str(max_np)]
    return (case, *_launch(tmp_path, case["hosts"], cfg, flags))


def _check_training(case: dict, done: dict, out: str, expected: list[float] | None = None) -> None:
    assert set(done) == case["survivors"], out
    if expected is None:
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
    if phase == "reform" and fault in ("exception", "sigkill", "sigterm"):
        # the survivors stopped waiting for the dead worker's connections because the launcher
        # said it died, not because the connect timeout (HOROVOD_GLOO_TIMEOUT_SECONDS) ran out
        assert "stopped waiting for its" in out and "exited with" in out, out[-6000:]


# -- Horovod's documented scenarios (test/integration/elastic_common.py of Horovod 0.28.1) ---


def _sizes(done: dict) -> set[int]:
    return {r["size"] for r in done.values()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_np", [4, 3])
def test_an_elastic_job_starts_every_discovered_slot_up_to_max_np(tmp_path, max_np) -> None:
    code, out, done, _ = _launch(
        tmp_path, BOTH, {"max_np": max_np}, ["-np", "2", "--min-np", "2", "--max-np", str(max_np)]
    )
    assert code == 0, out[-6000:]
    assert len(done) == max_np and _sizes(done) == {max_np}, out[-6000:]
    assert out.count("elastic: started worker") == max_np, out[-6000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["exception", "sigkill"])
def test_a_failure_on_fixed_hosts_blacklists_the_host(tmp_path, mode) -> None:
    """-H localhost:2,127.0.0.1:2 -np 2: four workers start; rank 0 fails in step 4; the host
    localhost is blacklisted (both its workers leave) and 127.0.0.1's two finish, one reset."""
    cfg = {"phase": "step", "fault": mode, "victim": "localhost:0"}
    flags = ["-np", "2", "--min-np", "2", "-H", "localhost:2,127.0.0.1:2"]
    code, out, done, _ = _launch(tmp_path, BOTH, cfg, flags)
    assert code == 0, out[-6000:]
    assert set(done) == {"127.0.0.1:0", "127.0.0.1:1"}, out[-6000:]
    assert _sizes(done) == {2} and {r["resets"] for r in done.values()} == {1}, out[-6000:]
    assert "host localhost is blacklisted; its 1 other workers leave the job" in out, out


@pytest.mark.timeout(120)
def test_every_worker_failing_ends_the_job_saying_why(tmp_path) -> None:
    cfg = {"phase": "step", "fault": "exception", "victim": "*"}
    code, out, done, _ = _launch(tmp_path, BOTH, cfg, ["-np", "2", "--min-np", "2"])
    assert code != 0, out[-6000:]
    assert not done, out[-6000:]
    assert "exited with non-zero status" in out, out[-6000:]


@pytest.mark.timeout(120)
def test_every_host_blacklisted_ends_the_job_saying_why(tmp_path) -> None:
    """One failure on each host (Horovod's test_all_hosts_blacklisted): the job ends."""
    cfg = {"phase": "step", "fault": "sigkill", "victim": "*"}
    flags = ["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1"]
    code, out, done, _ = _launch(tmp_path, "localhost:1\n127.0.0.1:1\n", cfg, flags)
    assert code != 0, out[-6000:]
    assert not done, out[-6000:]
    assert "exited with non-zero status" in out or "every host is blacklisted" in out, out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("limit", [1, 2])
def test_reset_limit_counts_resets_as_horovod(tmp_path, limit) -> None:
    """Horovod's test_reset_limit: localhost:2, then 127.0.0.1:2 added at step 1, then
    localhost removed at step 3 - two resets: --reset-limit 1 ends the job, 2 lets it finish."""
    schedule = {"1": BOTH, "3": "127.0.0.1:2\n"}
    cfg = {"schedule": schedule}
    flags = ["-np", "2", "--min-np", "2", "--max-np", "4", "--reset-limit", str(limit)]
    code, out, done, _ = _launch(tmp_path, LOCAL, cfg, flags)
    message = "number of resets during elastic job exceeded limit: 1"
    if limit == 1:
        assert code != 0 and message in out, out[-6000:]
        return
    assert code == 0, out[-6000:]
    assert set(done) == {"127.0.0.1:0", "127.0.0.1:1"}, out[-6000:]
    # the new workers joined in the first reset and lived through the second
    assert {r["resets"] for r in done.values()} == {1} and _sizes(done) == {2}, out[-6000:]
    assert out.count(" formed with ") == 2, out[-6000:]
    assert "host localhost is gone; worker 0 leaves at the next commit" in out, out[-6000:]


@pytest.mark.timeout(150)
def test_a_blacklisted_host_comes_back_after_its_cooldown(tmp_path) -> None:
    cfg = {"phase": "step", "fault": "exception", "victim": "127.0.0.1:0",
           "schedule": {"5": BOTH}}  # fmt: skip
    flags = ["-np", "2", "--min-np", "2", "--blacklist-cooldown-range", "1", "1"]
    code, out, done, _ = _launch(tmp_path, BOTH, cfg, flags)
    assert code == 0, out[-6000:]
    assert set(done) == {"localhost:0", "localhost:1", "127.0.0.1:0+1", "127.0.0.1:1+1"}, out
    assert _sizes(done) == {4}, out[-6000:]
    assert "host 127.0.0.1 is blacklisted for 1." in out, out[-6000:]
    assert "host 127.0.0.1 is back after its cooldown" in out, out[-6000:]


@pytest.mark.timeout(120)
def test_waiting_for_min_np_ends_after_horovod_elastic_timeout(tmp_path) -> None:
    """Horovod's test_min_hosts_timeout: --min-np 4 and a failure leave two workers; the job
    waits HOROVOD_ELASTIC_TIMEOUT seconds for slots, then ends saying so."""
    cfg = {"phase": "step", "fault": "exception", "victim": "localhost:1"}
    flags = ["-np", "4", "--min-np", "4"]
    code, out, done, took = _launch(tmp_path, BOTH, cfg, flags, HOROVOD_ELASTIC_TIMEOUT="3")
    assert code != 0 and not done, out[-6000:]
    assert "Timed out waiting for minimum number of slots to become available" in out, out
    assert "within 3s (--elastic-timeout)" in out, out[-6000:]


@pytest.mark.timeout(120)
def test_workers_that_arrive_after_the_training_ended_are_stopped(tmp_path) -> None:
    """Hosts added in the last step: their workers start but the job ends without them
    (Horovod: a worker's success ends the job), and no process is left."""
    cfg = {"schedule": {str(STEPS - 1): BOTH}, "settle": False, "late_start": 4, "linger": 2}
    code, out, done, _ = _launch(tmp_path, LOCAL, cfg, ["-np", "2", "--max-np", "4"])
    assert code == 0, out[-6000:]
    assert set(done) == {"localhost:0", "localhost:1"} and _sizes(done) == {2}, out[-6000:]
    assert "started worker 2 (127.0.0.1:0)" in out, out[-6000:]  # they did start


# -- a host replaced while its replacements are slow to start --------------------------------
#
# Horovod's "hosts added, then removed" with slow new workers: localhost:2 trains; at step 1
# 127.0.0.1:2 is added, whose workers sleep before hvd.init() (a slow framework import), and
# the discovery script drops localhost some seconds after the addition. The committed state
# lives only on localhost's workers until the new ones synced it, so those stay in the job
# until then. Of the 3 x 3 (sleep 0/5/20 s, removal 0/1/5 s after the addition), CI runs:
# * (0, 0): a swap at once: the old host is gone before the new workers even started; the
#   hand-over has to wait for them however fast they are ((5, 0) and (20, 0) wait longer the
#   same way);
# * (5, 1): the reported case: the removal comes while the new workers still import;
# * (20, 5): the slowest start, the removal while the old host trains on at full speed
#   ((20, 1) is the same path);
# (0, 1), (0, 5) and (5, 5) mostly let the new workers in before the removal, the path
# test_reset_limit_counts_resets_as_horovod takes. Each case costs its sleep plus about 5 s.
HANDOVER = [(0, 0), (5, 1), (20, 5)]
NEW = {"127.0.0.1:0", "127.0.0.1:1"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("sleep", "removal"), HANDOVER)
def test_a_replaced_host_hands_its_state_to_slow_new_workers(tmp_path, sleep, removal) -> None:
    cfg = {"swap": {"step": 1, "after_s": removal, "hosts": "127.0.0.1:2\n"},
           "late_start": sleep, "hold_s": 60}  # fmt: skip
    flags = ["-np", "2", "--min-np", "2", "--max-np", "4"]
    code, out, done, _ = _launch(tmp_path, LOCAL, cfg, flags)
    assert code == 0, out[-6000:]
    _check_training({"survivors": NEW, "size": 2}, done, out[-6000:])
    # one reset takes the new workers in (they sync from localhost's), one lets localhost go
    assert {r["resets"] for r in done.values()} == {1}, out[-6000:]
    assert out.count(" formed with ") == 2, out[-6000:]
    assert "holds the committed state and stays" in out, out[-6000:]


@pytest.mark.timeout(120)
def test_a_hand_over_that_never_comes_ends_after_elastic_timeout(tmp_path) -> None:
    """The new workers take longer than --elastic-timeout to start: the job ends, saying so,
    rather than waiting for ever or going on without the state."""
    cfg = {"swap": {"step": 1, "after_s": 0, "hosts": "127.0.0.1:2\n"}, "late_start": 30,
           "hold_s": 60}  # fmt: skip
    flags = ["-np", "2", "--min-np", "2", "--max-np", "4"]
    code, out, done, took = _launch(tmp_path, LOCAL, cfg, flags, HOROVOD_ELASTIC_TIMEOUT="4")
    assert code != 0 and not done, out[-6000:]
    assert "No hosts from previous set remaining, unable to broadcast state" in out, out
    assert "no new worker received the state within 4s" in out, out[-6000:]
    assert took < 25, out[-6000:]


@pytest.mark.timeout(120)
def test_a_new_worker_removed_before_its_first_init_exits_0(tmp_path) -> None:
    """127.0.0.1:2 is added and dropped again while its workers still start: they reach
    hvd.init() after their removal and leave with status 0 (as at a re-formation), which the
    launcher reports without counting it; the job goes on with localhost."""
    cfg = {"swap": {"step": 1, "after_s": 1.5, "hosts": LOCAL}, "late_start": 3.5,
           "step_s": 0.3, "linger": 6}  # fmt: skip
    flags = ["-np", "2", "--min-np", "2", "--max-np", "4"]
    code, out, done, _ = _launch(tmp_path, LOCAL, cfg, flags)
    assert code == 0, out[-6000:]
    assert set(done) == {"localhost:0", "localhost:1"}, out[-6000:]
    for wid in sorted(NEW):
        assert f"({wid}), no longer in the job, exited with 0" in out, out[-6000:]
    assert "has been removed from elastic job" in out, out[-6000:]
    assert "Traceback" not in out, out[-6000:]


@pytest.mark.timeout(120)
def test_a_worker_that_finishes_early_fails_the_job_at_once(tmp_path) -> None:
    """localhost:1 returns from its training at step 3 and exits 0; the others' next allreduce
    fails and they ask to re-form, which cannot happen once a worker finished. As in Horovod,
    they are stopped and the job fails at once (not after --elastic-timeout, 40 s here)."""
    cfg = {"early": {"id": "localhost:1", "step": 3}}
    code, out, done, took = _launch(tmp_path, BOTH, cfg, ["-np", "2", "--min-np", "2"])
    assert code != 0, out[-6000:]
    assert set(done) == {"localhost:1"}, out[-6000:]
    assert "asked to re-form without it" in out, out[-6000:]
    assert took < 30, out[-6000:]


@pytest.mark.timeout(120)
def test_a_worker_failing_after_another_finished_fails_the_job(tmp_path) -> None:
    """Every worker finishes the training; localhost:0 then fails (exit 3) after localhost:1
    exited 0. Horovod 0.28.1 counts that exit (its driver records results until every worker
    of the last rendezvous is in) and fails the job: so does hora."""
    cfg = {"fail_after": {"id": "localhost:0", "wait": 1.0}}
    code, out, done, _ = _launch(tmp_path, BOTH, cfg, ["-np", "2", "--min-np", "2"])
    assert code == 3, out[-6000:]
    assert len(done) == 4, out[-6000:]
    assert "worker 0 (localhost:0) of the last round exited with 3" in out, out[-6000:]


# -- the same scenarios under PyTorch, TensorFlow 2 and tf_keras ------------------------------
#
# The worker trains with hora.torch (DistributedOptimizer, TorchState), hora.tensorflow (a
# tf.function step with DistributedGradientTape and TensorFlowState) or tf_keras's model.fit
# under hora.tensorflow.keras (KerasState, the elastic callbacks, a commit at every batch), with
# the fault hooks and the ledger above. Every framework process costs seconds of import on a
# small machine (TensorFlow's most), so each framework runs one job per kind of change on two
# one-slot hosts: a host added, rank 0 failing mid-step (killed; in Keras, an exception out of a
# callback inside fit), so that the survivor's committed state is what goes on, and for torch a
# host removed too (see FRAMEWORK_RUNS); and, for tf2, a host replaced while its replacement
# still imports TensorFlow (the hand-over of the state to a slow new worker).
ONE = "localhost:1\n"
TWO = "localhost:1\n127.0.0.1:1\n"
FRAMEWORK_CASES = {
    "added": {"hosts": ONE, "after": TWO, "fault": "hosts", "np": 1,
              "survivors": {"localhost:0", "127.0.0.1:0"}, "size": 2},
    "removed": {"hosts": TWO, "after": ONE, "fault": "hosts", "np": 2,
                "survivors": {"localhost:0"}, "size": 1},
    "failed": {"hosts": TWO, "after": "", "fault": "sigkill", "np": 2,
               "survivors": {"127.0.0.1:0"}, "size": 1},  # keras: "exception"
}  # fmt: skip


def _framework_expected(framework: str) -> list[float]:
    # torch and tf2 add step + 1 at each step as the NumPy worker does; the Keras model moves each
    # weight by -0.01 per step (one batch of ones, loss the sum of the outputs)
    return [-0.01 * (STEPS if framework.startswith("keras") else sum(range(1, STEPS + 1)))] * 4


# A removed host ends its worker and resets the survivor as a failed one does, through the
# same commit and restore of the framework's state: the TensorFlow frameworks, whose jobs cost
# the most, run it once in torch's job rather than three times.
FRAMEWORK_RUNS = [(f, c) for f in ("torch", "tf2", "keras") for c in FRAMEWORK_CASES
                  if f == "torch" or c != "removed"]  # fmt: skip


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("framework", "change"), FRAMEWORK_RUNS,
                         ids=[f"{f}-{c}" for f, c in FRAMEWORK_RUNS])  # fmt: skip
def test_each_framework_survives_each_change(tmp_path, framework: str, change: str) -> None:
    _framework_case(tmp_path, framework, change)


@pytest.mark.timeout(150)
def test_a_keras_3_job_takes_in_a_new_host(tmp_path) -> None:
    """The same model.fit worker under hora.keras (Keras 3, whose optimizers say ``built``)."""
    _framework_case(tmp_path, "keras3", "added")


def _framework_case(tmp_path: Path, framework: str, change: str) -> None:
    pytest.importorskip("torch" if framework == "torch" else "tensorflow")
    if framework == "keras":
        pytest.importorskip("tf_keras")
    case = FRAMEWORK_CASES[change]
    fault = "exception" if framework == "keras" and change == "failed" else case["fault"]
    cfg = {"framework": framework, "phase": "step", "fault": fault,
           "victim": "localhost:0", "hosts_after": case["after"], "max_np": 2}  # fmt: skip
    flags = ["-np", str(case["np"]), "--min-np", "1", "--max-np", "2"]
    code, out, done, _ = _launch(tmp_path, case["hosts"], cfg, flags)
    assert code == 0, out[-6000:]
    _check_training(case, done, out[-6000:], _framework_expected(framework))
    assert {r["resets"] for r in done.values()} <= {0, 1}, out[-6000:]
    assert max(r["resets"] for r in done.values()) == 1, out[-6000:]
    assert out.count(" formed with ") == 1, out[-6000:]
    if change == "failed":
        status = "1" if framework == "keras" else "137"
        assert f"(localhost:0) exited with {status}" in out, out[-6000:]
        assert "a collective failed (" in out, out[-6000:]  # rolled back to the last commit


@pytest.mark.timeout(150)
def test_a_tensorflow_host_replaced_while_its_replacement_imports(tmp_path) -> None:
    """localhost:1 trains; at step 1 127.0.0.1:1 is added and localhost dropped a second
    later, while the new worker still imports TensorFlow: localhost's worker holds the only
    committed state and stays until the new one synced it (two resets), then leaves."""
    pytest.importorskip("tensorflow")
    cfg = {"framework": "tf2", "max_np": 2, "hold_s": 90,
           "swap": {"step": 1, "after_s": 1, "both": TWO, "hosts": "127.0.0.1:1\n"}}  # fmt: skip
    code, out, done, _ = _launch(tmp_path, ONE, cfg, ["-np", "1", "--min-np", "1",
                                                      "--max-np", "2"])  # fmt: skip
    assert code == 0, out[-6000:]
    case = {"survivors": {"127.0.0.1:0"}, "size": 1}
    _check_training(case, done, out[-6000:], _framework_expected("tf2"))
    assert out.count(" formed with ") == 2, out[-6000:]
    assert "holds the committed state and stays" in out, out[-6000:]
