"""Nothing of the shared-memory transport outlives a job, whichever way its ranks end: normal
shutdown, an exception, SIGTERM or SIGKILL. Its staging areas are anonymous (memfd) and its
sockets abstract, so after the processes are gone neither ``/dev/shm`` nor the kernel's table
of Unix sockets holds anything of the job; the survivors of a killed rank fail in seconds."""

from __future__ import annotations

import os
from typing import Any

import pytest

from harness import spawn_ranks


def _dev_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "hora" in n.lower()}


def _unix_sockets() -> str:
    with open("/proc/net/unix") as f:
        return f.read()


def _doomed_job(rank: int, how: str) -> dict[str, Any]:
    import os
    import signal
    import time

    import numpy as np

    import hora as hvd
    from hora.transport.shm.transport import socket_name

    hvd.init()
    secret = bytes.fromhex(os.environ["HORA_SECRET_KEY"])
    names = [socket_name(secret, "hora/0", r)[1:] for r in range(hvd.size())]
    x = np.ones(1 << 20, np.float32)  # 4 MiB: bulk frames over shared memory
    for i in range(3):
        hvd.allreduce(x, op=hvd.Sum, output=x, name=f"warm{i}")
    if rank == 2:
        time.sleep(0.5)  # the others now wait for rank 2's next request
        if how == "exception":
            raise RuntimeError("rank 2 fails")
        os.kill(os.getpid(), signal.SIGKILL if how == "sigkill" else signal.SIGTERM)
    t0 = time.monotonic()
    try:
        hvd.allreduce(x, op=hvd.Sum, name="doomed")
        error = "completed?!"
    except hvd.HorovodInternalError as e:
        error = str(e)
    seconds = time.monotonic() - t0
    hvd.shutdown()
    return {"error": error, "seconds": seconds, "sockets": names}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["sigkill", "sigterm", "exception"])
def test_a_rank_that_dies_leaves_nothing_behind(how: str) -> None:
    before = _dev_shm()
    results = spawn_ranks(_doomed_job, 3, args=(how,), timeout=90)
    survivors = results[:2]
    if how == "exception":
        assert results[2].status == "error" and "rank 2 fails" in results[2].value
    else:
        want = -9 if how == "sigkill" else -15
        assert results[2].status == "died" and results[2].returncode == want, results[2]
    for r in survivors:
        assert r.ok, f"rank {r.rank}: {r.status}\n{r.value}\n{r.stderr[-3000:]}"
        assert "rank 2" in r.value["error"] and "shut down" in r.value["error"], r.value
        assert r.value["seconds"] < 10, r.value  # noticed in seconds, not by a long timeout
    assert _dev_shm() - before == set()
    table = _unix_sockets()
    leftover = [n for n in survivors[0].value["sockets"] if n in table]
    assert leftover == [], leftover


def _killed_inside_a_collective(rank: int) -> dict[str, Any]:
    import os
    import signal
    import threading
    import time

    import numpy as np

    import hora as hvd

    hvd.init()
    x = np.ones(4 << 20, np.float32)  # 16 MiB: the ranks spend their time moving data
    hvd.allreduce(x, op=hvd.Sum, output=x, name="warm")
    if rank == 1:  # dies while the ranks are inside one of the next allreduces
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        for i in range(10_000):
            hvd.allreduce(x, op=hvd.Sum, output=x, name=f"step{i % 2}")
        error = "no error"
    except hvd.HorovodInternalError as e:
        error = str(e)
    seconds = time.monotonic() - t0
    hvd.shutdown()
    return {"error": error, "seconds": seconds}


@pytest.mark.timeout(120)
def test_a_rank_killed_inside_a_shared_memory_collective_fails_the_others_quickly() -> None:
    before = _dev_shm()
    results = spawn_ranks(_killed_inside_a_collective, 3, timeout=90)
    assert results[1].status == "died" and results[1].returncode == -9
    for r in (results[0], results[2]):
        assert r.ok, f"rank {r.rank}: {r.status}\n{r.value}\n{r.stderr[-3000:]}"
        assert "rank 1" in r.value["error"], r.value
        assert r.value["seconds"] < 10, r.value
    assert _dev_shm() - before == set()


def _staged_then_killed(rank: int) -> str:
    import os
    import signal

    import numpy as np

    from hora.errors import TransportError
    from hora.transport.shm import ShmTransport

    secret = bytes.fromhex(os.environ["HORA_SECRET_KEY"])
    t = ShmTransport(rank, 2, secret, "test/cleanup", connect_timeout=20, single_copy=False)
    pair = t.pair(1 - rank)
    data = np.ones(32 << 20, np.uint8)  # four times the staging area
    if rank == 1:
        pair.send(b"go")
        os.kill(os.getpid(), signal.SIGKILL)
    pair.recv_into(bytearray(2))
    try:
        pair.send(memoryview(data))  # rank 1 is dead: the staging slots never free
        return "sent?!"
    except TransportError as e:
        return str(e)


@pytest.mark.timeout(60)
def test_staging_areas_vanish_with_their_processes() -> None:
    before = _dev_shm()
    results = spawn_ranks(_staged_then_killed, 2, timeout=40)
    assert results[1].status == "died" and results[1].returncode == -9
    assert results[0].ok, results[0].stderr
    assert "rank 1" in results[0].value and "killed" in results[0].value, results[0].value
    assert _dev_shm() - before == set()
