"""`hora run` across two hosts made of network namespaces, each with a real sshd.

Skipped, with the reason, where namespaces cannot be made (not root, no `ip netns`, no sshd).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import Cluster, unavailable_reason

pytestmark = pytest.mark.multihost

HORA = [sys.executable, "-c", "import sys; from hora.launch.cli import main; sys.exit(main())"]

# Each rank reports its place, proves the rendezvous store answers, and runs an allreduce.
WORKER = """
import os, socket
import numpy as np
import hora as hvd
from hora.rendezvous.client import StoreClient

e = os.environ
rank = int(e["HORA_RANK"])
with StoreClient(e["HORA_RENDEZVOUS_ADDR"], int(e["HORA_RENDEZVOUS_PORT"]),
                 bytes.fromhex(e["HORA_SECRET_KEY"]), timeout=20) as store:
    store.set(f"test/{rank}", str(rank).encode())
    store_ok = store.get(f"test/{rank}") == str(rank).encode()
hvd.init()
total = hvd.allreduce(np.full(3, float(rank + 1)), op=hvd.Sum)
print(f"rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()}/{hvd.local_size()} "
      f"cross={hvd.cross_rank()}/{hvd.cross_size()} host={e['HORA_HOSTNAME']} "
      f"store={store_ok} via={e['HORA_RENDEZVOUS_ADDR']} iface={e.get('HORA_GLOO_IFACE')} "
      f"sum={total.tolist()}", flush=True)
hvd.shutdown()
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = unavailable_reason()
    if reason is not None:
        print(f"multi-host tests skipped: {reason}")
        pytest.skip(reason)
    with Cluster(["hostA", "hostB"], tmp_path_factory.mktemp("netns")) as made:
        yield made


def _run(cluster: Cluster, args: list[str], timeout: float = 100) -> subprocess.CompletedProcess:
    argv = [*HORA, "run", "--ssh-config-file", str(cluster.ssh_config), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def _only_sshd_left(cluster: Cluster, timeout: float = 5.0) -> dict[str, list[str]]:
    """Processes other than the listening sshd still in each namespace after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = {}
        for name in cluster.names:
            extra = []
            for pid in set(cluster.processes(name)) - cluster.sshd_pids:
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:  # the process ended meanwhile
                    continue
                extra.append(cmd)
            if extra:
                left[name] = extra
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.mark.timeout(150)
def test_four_ranks_on_two_hosts_allreduce(cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    done = _run(cluster, ["-np", "4", "-H", "hostA:2,hostB:2", "--verbose",
                          sys.executable, str(script)])  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if "rank=" in line)
    via, expected_sum = cluster.launcher_address, [10.0, 10.0, 10.0]
    expected = [
        f"[{r}]<stdout>:rank={r} size=4 local={r % 2}/2 cross={r // 2}/2 host={h} "
        f"store=True via={via} iface=eth0 sum={expected_sum}"
        for r, h in enumerate(["hostA", "hostA", "hostB", "hostB"])
    ]
    assert lines == expected, done.stdout + done.stderr
    assert "eth0 (the only interface present on every host" in done.stderr
    assert _only_sshd_left(cluster) == {}


@pytest.mark.timeout(120)
def test_remote_failure_stops_every_rank_on_every_host(cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    # rank 3 fails after the others had time to start and print, even on a loaded machine
    script.write_text("import os, sys, time\nprint('up', flush=True)\n"
                      "if os.environ['HORA_RANK'] == '3':\n    time.sleep(8)\n    sys.exit(3)\n"
                      "time.sleep(100)\n")  # fmt: skip
    done = _run(cluster, ["-np", "4", "-H", "hostA:2,hostB:2", sys.executable, str(script)])
    assert done.returncode != 0
    assert "Process 3 exit with status code 3." in done.stderr
    assert done.stdout.count("up") == 4
    assert _only_sshd_left(cluster) == {}


@pytest.mark.timeout(120)
def test_sigterm_to_the_launcher_stops_remote_ranks(cluster: Cluster) -> None:
    argv = [*HORA, "run", "--ssh-config-file", str(cluster.ssh_config), "-np", "2",
            "-H", "hostA:1,hostB:1", sys.executable, "-c",
            "import time; print('up', flush=True); time.sleep(100)"]  # fmt: skip
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    assert sorted(launcher.stdout.readline().strip() for _ in range(2)) == [
        "[0]<stdout>:up", "[1]<stdout>:up"
    ]  # fmt: skip
    assert set(_only_sshd_left(cluster, timeout=0)) == {"hostA", "hostB"}  # workers running
    launcher.send_signal(signal.SIGTERM)
    launcher.communicate(timeout=60)
    assert launcher.returncode != 0
    assert _only_sshd_left(cluster) == {}


@pytest.mark.timeout(120)
def test_unreachable_host_fails_preflight(cluster: Cluster) -> None:
    # 15 s: long enough for the reachable host's ssh check on a loaded 2-core CI machine
    done = _run(cluster, ["-np", "2", "-H", f"hostA:1,{cluster.unreachable_host}:1",
                          "--start-timeout", "15", "true"])  # fmt: skip
    assert done.returncode == 2
    assert "preflight failed" in done.stderr and cluster.unreachable_host in done.stderr
    assert "hostA" not in done.stderr.split("preflight failed", 1)[1]
