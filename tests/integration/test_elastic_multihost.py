"""Elastic training across two hosts made of network namespaces, each with a real sshd.

A host whose namespace is torn down mid-training (every process in it killed, its link down)
is blacklisted; the workers of the other host roll back to their last commit and finish, with
an exact committed-sample counter. Skipped, with the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import Cluster, unavailable_reason

pytestmark = pytest.mark.multihost

HERE = Path(__file__).resolve().parent
HORA = [sys.executable, "-c", "import sys; from hora.launch.cli import main; sys.exit(main())"]
STEPS = 40


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with Cluster(["hostA", "hostB"], tmp_path_factory.mktemp("netns")) as made:
        yield made


@pytest.mark.timeout(330)
def test_a_host_torn_down_mid_training_is_dropped_and_training_goes_on(
    cluster: Cluster, tmp_path: Path
) -> None:
    progress = tmp_path / "progress"
    hosts = tmp_path / "hosts"
    hosts.write_text("hostA:2\nhostB:2\n")
    cfg = {"phase": "none", "fault": "none", "victim": "", "steps": STEPS, "max_np": 4,
           "dir": str(tmp_path), "hosts_file": str(hosts), "hosts_after": "",
           "settle": False, "progress": str(progress)}  # fmt: skip
    argv = [*HORA, "run", "--ssh-config-file", str(cluster.ssh_config), "-np", "2",
            "--min-np", "2", "-H", "hostA:2,hostB:2", "--elastic-timeout", "60",
            sys.executable, str(HERE / "elastic_faults_worker.py"), json.dumps(cfg)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            lines = progress.read_text().split() if progress.exists() else []
            if len(lines) >= 2 * 5:  # rank 0 wrote "step size" for five steps
                break
            time.sleep(0.1)
        else:
            proc.kill()
            pytest.fail("the job did not reach step 5: " + (proc.communicate()[0] or "")[-4000:])
        cluster.take_down("hostB")
        # the survivors notice the vanished host through keepalive (about 8 s) or, with data in
        # flight to it, the transport's watch (10 s without an acknowledgement,
        # hora.transport.tcp.liveness), then re-form without it
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-6000:]
    done = {}
    for line in out.splitlines():
        if "DONE " in line:
            report = json.loads(line.split("DONE ", 1)[1])
            done[report["id"]] = report
    assert set(done) == {"hostA:0", "hostA:1"}, out[-6000:]
    for report in done.values():
        assert report["size"] == 2 and report["step"] == STEPS, out[-6000:]
        assert [s for s, _ in report["history"]] == list(range(1, STEPS + 1)), out[-6000:]
        assert report["samples"] == sum(8 * n for _, n in report["history"]), out[-6000:]
        assert report["resets"] == 1, out[-6000:]
    assert done["hostA:0"]["params"] == done["hostA:1"]["params"], out[-6000:]
    assert "host hostB is blacklisted" in out, out[-6000:]
