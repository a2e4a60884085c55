"""``hora bench scaling --netns HOSTS --link-rate RATE``: the training benchmark across hosts
made on this machine, with links of a chosen rate.

Each configuration builds :class:`hora.lab.netns.Hosts` (network namespaces on a bridge, every
host's link shaped to ``RATE`` per direction, as ``hora bench allreduce --netns`` builds them),
starts its ranks inside them (ranks split evenly, in rank order, over the hosts) with the
identity ``hora run -H`` would give them and a rendezvous store on the bridge, so hora uses
shared memory inside a host and TCP between hosts, and DDP's Gloo the hosts' ``eth0``. Each rank
runs :func:`hora.lab.train_worker.train` and writes its result to a file. The bytes the hosts'
links sent during the run (read from their qdiscs) come back with the results. Needs root
(``ip netns``, ``tc``). Runs in the caller's thread.
"""

from __future__ import annotations

import os
import pickle
import secrets
import subprocess
import sys
import tempfile
import time
from typing import Any

from hora.lab import netns
from hora.lab.procs import base_env, stop, tail
from hora.lab.train_worker import TrainSpec

BACKENDS = ("native", "ddp")  # what runs across the namespace hosts
_RUNNER = (
    "import pickle, sys\n"
    "from hora.lab.train_worker import train\n"
    "with open(sys.argv[1], 'rb') as f:\n"
    "    spec = pickle.load(f)\n"
    "out = train(spec)\n"
    "with open(sys.argv[2] + '.tmp', 'wb') as f:\n"
    "    pickle.dump(out, f)\n"
    "import os\n"
    "os.replace(sys.argv[2] + '.tmp', sys.argv[2])\n"
)


def unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot train across the namespace hosts, or None."""
    if backend not in BACKENDS:
        return f"not offered across --netns hosts (choose from {', '.join(BACKENDS)})"
    return netns.unavailable_reason()


def launch(spec: TrainSpec, np_: int, hosts_count: int, rate: str,
           env: dict[str, str]) -> tuple[list[dict[str, Any]], int]:  # fmt: skip
    """Train ``spec`` on ``np_`` ranks over ``hosts_count`` namespace hosts with ``rate``
    links; (every rank's result, bytes the hosts' links sent). RuntimeError with the ranks'
    last lines when a rank fails or the run outlives ``spec.timeout``."""
    from hora.rendezvous.server import RendezvousServer

    if np_ % hosts_count:
        raise RuntimeError(f"{np_} processes do not split evenly over {hosts_count} hosts")
    with netns.Hosts(hosts_count, np_ // hosts_count, rate) as hosts, \
            tempfile.TemporaryDirectory(prefix="hora-scaling-netns-") as tmp:  # fmt: skip
        spec_path = os.path.join(tmp, "spec.pickle")
        with open(spec_path, "wb") as f:
            pickle.dump(spec, f)
        secret = secrets.token_bytes(32)
        server = RendezvousServer(secret, host=hosts.gateway)
        common = {**base_env(), **env, "HORA_RENDEZVOUS_ADDR": hosts.gateway,
                  "HORA_RENDEZVOUS_PORT": str(server.start()), "HORA_SECRET_KEY": secret.hex()}
        procs: list[subprocess.Popen[bytes]] = []
        before = hosts.sent_bytes()
        try:
            for rank in range(np_):
                argv = [sys.executable, "-c", _RUNNER, spec_path, os.path.join(tmp, f"{rank}.out")]
                log = os.path.join(tmp, f"{rank}.log")
                procs.append(hosts._launch(hosts.host_of(rank), argv,
                                           {**common, **hosts.hora_identity(rank)}, log))
            _wait(procs, spec.timeout + 60, tmp)
        finally:
            stop(procs)
            server.stop()
        sent = hosts.sent_bytes() - before
        results = []
        for rank in range(np_):
            with open(os.path.join(tmp, f"{rank}.out"), "rb") as f:
                results.append(pickle.load(f))
        return results, sent


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float, tmp: str) -> None:
    """Until every rank exits 0; RuntimeError with a failed rank's last lines (or rank 0's on
    a timeout) otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            raise RuntimeError(f"rank {failed[0]} failed:\n{_log(tmp, failed[0])}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"no result within {timeout:g} s:\n{_log(tmp, 0)}")
        time.sleep(0.2)


def _log(tmp: str, rank: int) -> str:
    return tail(os.path.join(tmp, f"{rank}.log"))
