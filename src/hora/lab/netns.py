"""``hora bench allreduce --netns N --link-rate RATE``: the allreduce comparison across hosts.

On one Linux machine, as root, this module makes N "hosts": network namespaces ``hbench-<pid>-<i>``
whose ``eth0`` (address ``10.78.X.<i+2>``) is one end of a veth pair; the other ends hang on a
bridge ``hbb<pid>`` that also gives the root namespace the address ``.1``. A ``tbf`` qdisc on both
ends of every host's veth caps what the host sends and what it receives at ``RATE``, like a
full-duplex NIC. ``--np`` ranks are split evenly, in rank order, over the hosts; each rank runs
inside its host's namespace and UTS namespace (host name ``host<i>``), started with
``ip netns exec NS unshare --uts ...``:

* hora: ``HORA_HOSTNAME``/``HORA_LOCAL_RANK``/``HORA_CROSS_RANK``... as ``hora run`` gives them
  on real hosts, the rendezvous store in this process on the bridge address, so hora uses shared
  memory inside a host and TCP between hosts. Each rank records the links it used
  (:func:`hora.lab.workers.hora_layout`);
* torch Gloo: ``MASTER_ADDR`` is host 0's address, ``GLOO_SOCKET_IFNAME=eth0``;
* Open MPI: ``mpirun`` stays here with a hostfile of the hosts' addresses and a launch agent
  (``--mca plm_rsh_agent``, a script written per run) that starts each host's ``orted`` in the
  host's namespaces, as ssh would on a cluster.

The bytes each host's link sent during each backend's run are read from the qdiscs. Everything
(processes in the namespaces, the namespaces with their veths and qdiscs, the bridge) is removed
when the :class:`Hosts` context exits, on errors, Ctrl-C and SIGTERM too; namespaces left by a
process that was killed outright are removed by the next run. Runs in the caller's thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, Protocol

from hora.lab import report
from hora.lab.procs import (
    HORA_VARIANTS,
    BackendFailed,
    base_env,
    follow,
    stop,
    tail,
    warmup_iters,
    worker_cmd,
)


class BenchConfig(Protocol):
    """What this module reads of :class:`hora.lab.allreduce.AllreduceBenchConfig` (which
    imports this module, so it is not imported here)."""

    np: int
    sizes: list[int]
    iters: int | None
    timeout: float
    device: str
    netns: int
    link_rate: str

    def plan(self, out: str, label: str) -> dict[str, Any]: ...

NS_PREFIX = "hbench-"
BRIDGE_PREFIX = "hbb"
DEFAULT_SIZES = "1M,4M,16M,64M,256M"
DEFAULT_RANKS_PER_HOST = 2
_RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmg]?)bit$")
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
BACKENDS = ("hora", "hora-tcp", "gloo", "mpi")


def parse_rate(text: str) -> int:
    """Bits per second in ``tc``'s notation: ``10gbit``, ``1gbit``, ``500mbit``."""
    m = _RATE.match(text.strip().lower())
    if m is None:
        raise ValueError(f"--link-rate {text!r}: give bits per second like 10gbit, 1gbit, 500mbit")
    bps = int(float(m.group(1)) * _SCALE[m.group(2)])
    if bps < 1_000_000:
        raise ValueError(f"--link-rate {text!r}: below 1mbit the benchmark would never end")
    return bps


def default_iters(size_bytes: int) -> int:
    """Timed calls for one size across hosts: about 512 MiB of data, between 5 and 200 calls
    (a 256 MiB allreduce takes seconds on a 1 Gbit/s link)."""
    return max(5, min(200, (512 << 20) // size_bytes))


def check(config: BenchConfig) -> None:
    """ValueError when ``config`` cannot run across ``config.netns`` hosts."""
    if config.netns < 2:
        raise ValueError(f"--netns {config.netns}: give at least 2 hosts")
    if config.device != "cpu":
        raise ValueError("--netns runs host buffers: not with --device cuda")
    if config.np % config.netns:
        raise ValueError(
            f"--np {config.np} does not split evenly over --netns {config.netns} hosts; "
            f"give a multiple, e.g. --np {DEFAULT_RANKS_PER_HOST * config.netns}"
        )
    parse_rate(config.link_rate)
    reason = unavailable_reason()
    if reason is not None:
        raise ValueError(f"--netns cannot make hosts here: {reason}")


def unavailable_reason() -> str | None:
    """Why hosts cannot be made here (not root, a tool missing), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or in a container with CAP_NET_ADMIN)"
    for tool in ("ip", "tc", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 and util-linux provide ip, tc, unshare)"
    probe = f"{NS_PREFIX}probe-{os.getpid()}"
    done = _run("ip", "netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"`ip netns add` failed here: {done.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_in(ns: str) -> None:
    """SIGKILL every process in namespace ``ns`` (all started by this bench), and wait a while
    for them to leave it."""
    deadline = time.monotonic() + 10
    while True:
        pids = [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split()]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def remove_stale() -> list[str]:
    """Remove the namespaces and bridges of bench runs whose process is gone; return them."""
    gone = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(rf"^{NS_PREFIX}(\d+)-\d+$", name)
        if m and not _alive(int(m.group(1))):
            _kill_in(name)
            _run("ip", "netns", "del", name, check=False)
            gone.append(name)
    for line in _run("ip", "-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        m = re.match(rf"^\d+:\s+({BRIDGE_PREFIX}(\d+)):", line)
        if m and not _alive(int(m.group(2))):
            _run("ip", "link", "del", m.group(1), check=False)
            gone.append(m.group(1))
    return gone


def _burst(bps: int) -> int:
    """tbf's bucket: a timer tick's worth of bytes at the rate (4 ms), at least 64 KiB."""
    return max(bps // 8 // 250, 64 << 10)


class Hosts:
    """``count`` hosts of ``ranks_per_host`` ranks each on a bridge limited to ``rate`` per host
    and direction; a context manager that builds them on entry and removes them on exit."""

    def __init__(self, count: int, ranks_per_host: int, rate: str) -> None:
        self.count, self.ranks_per_host, self.rate = count, ranks_per_host, rate
        self.bps = parse_rate(rate)
        pid = os.getpid()
        self.bridge = f"{BRIDGE_PREFIX}{pid}"
        self.namespaces = [f"{NS_PREFIX}{pid}-{i}" for i in range(count)]
        self.names = [f"host{i}" for i in range(count)]
        self.subnet = self._free_subnet(pid)
        self.gateway = f"{self.subnet}.1"
        self.addresses = [f"{self.subnet}.{i + 2}" for i in range(count)]
        self.link_bytes: dict[str, int] = {}  # backend -> bytes the hosts' links sent
        self.layouts: dict[str, list[dict[str, Any]]] = {}  # hora backend -> each rank's links
        self._signals: dict[int, Any] = {}

    @staticmethod
    def _free_subnet(pid: int) -> str:
        used = _run("ip", "-4", "-o", "addr", "show", check=False).stdout
        for step in range(200):
            subnet = f"10.78.{(pid + step) % 200 + 20}"
            if f" {subnet}." not in used:
                return subnet
        raise RuntimeError("no free 10.78.X.0/24 subnet for the bench's bridge")

    def describe(self) -> dict[str, Any]:
        return {
            "hosts": self.count,
            "ranks_per_host": self.ranks_per_host,
            "link_rate": self.rate,
            "link_bps": self.bps,
            "qdisc": f"tbf rate {self.rate} burst {_burst(self.bps)}b latency 50ms, both ends",
            "subnet": f"{self.subnet}.0/24",
            "across": f"{self.count} hosts x {self.ranks_per_host} ranks (network namespaces), "
            f"{self.rate} links",
        }

    # -- building and removing ----------------------------------------------------------------
    def __enter__(self) -> Hosts:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind through __exit__
                self._signals[sig] = signal.signal(sig, self._on_signal)
        try:
            remove_stale()
            self._build()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    @staticmethod
    def _on_signal(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    def _build(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        tbf = ["tbf", "rate", self.rate, "burst", str(_burst(self.bps)), "latency", "50ms"]
        for i, ns in enumerate(self.namespaces):
            veth = f"{self.bridge}v{i}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", veth, "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *tbf)
            _run("tc", "qdisc", "add", "dev", veth, "root", *tbf)  # what the host receives

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            for i, ns in enumerate(self.namespaces):
                if os.path.exists(f"/run/netns/{ns}"):
                    _kill_in(ns)
                    # the veth pair (and its qdiscs) explicitly: a namespace's deletion frees
                    # its devices only later, and the root-side end outlived the run for a moment
                    _run("ip", "link", "del", f"{self.bridge}v{i}", check=False)
                    _run("ip", "netns", "del", ns, check=False)
            _run("ip", "link", "del", self.bridge, check=False)
        finally:
            for sig, handler in self._signals.items():
                signal.signal(sig, handler)
            self._signals.clear()

    # -- running ranks ------------------------------------------------------------------------
    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def in_host(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``host``'s network namespace, under its own host name."""
        ns, name = self.namespaces[host], self.names[host]
        script = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", script, name, *argv]

    def sent_bytes(self) -> int:
        """Bytes all hosts' links have sent so far (the tbf counters inside the namespaces)."""
        total = 0
        for ns in self.namespaces:
            out = _run("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", "eth0",
                       check=False).stdout  # fmt: skip
            m = re.search(r"Sent (\d+) bytes", out)
            total += int(m.group(1)) if m else 0
        return total

    def unavailable(self, backend: str) -> str | None:
        if backend not in BACKENDS:
            return f"not offered across hosts (choose from {', '.join(BACKENDS)})"
        return None

    def _agent(self, tmp: str) -> str:
        """The launch agent ``mpirun`` calls as it would call ssh: ``agent HOST COMMAND...``."""
        cases = "".join(
            f"  {addr}) ns={ns}; name={name};;\n"
            for addr, ns, name in zip(self.addresses, self.namespaces, self.names)
        )
        path = os.path.join(tmp, "mpi-agent.sh")
        with open(path, "w") as f:
            f.write(
                "#!/bin/sh\n# mpirun's launch agent: run the command on a bench host\n"
                'host="$1"; shift\ncase "$host" in\n' + cases + '  *) echo "no bench host '
                '$host" >&2; exit 1;;\nesac\nexec ip netns exec "$ns" unshare --uts '
                '/bin/sh -c "hostname $name && $*"\n'
            )
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
        return path

    def _launch(self, host: int, argv: list[str], env: dict[str, str], log: str) -> Any:
        with open(log, "wb") as out:
            return subprocess.Popen(
                self.in_host(host, argv), env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def hora_identity(self, rank: int) -> dict[str, str]:
        """Rank ``rank``'s identity, as ``hora run -H host0:k,host1:k,...`` gives it."""
        np_, host = self.count * self.ranks_per_host, self.host_of(rank)
        return {"HORA_RANK": str(rank), "HORA_SIZE": str(np_), "HORA_HOSTNAME": self.names[host],
                "HORA_LOCAL_RANK": str(rank % self.ranks_per_host),
                "HORA_LOCAL_SIZE": str(self.ranks_per_host), "HORA_CROSS_RANK": str(host),
                "HORA_CROSS_SIZE": str(self.count)}  # fmt: skip

    def spawn(
        self, backend: str, plan_path: str, tmp: str, extra: dict[str, str], port: int
    ) -> list[Any]:
        """Start ``backend``'s ranks on the hosts (for ``mpi``: ``mpirun`` here)."""
        env = {**base_env(), **extra}
        np_ = self.count * self.ranks_per_host
        cmd = worker_cmd(backend, plan_path)
        if backend == "mpi":
            hostfile = os.path.join(tmp, "mpi-hosts")
            with open(hostfile, "w") as f:
                f.writelines(f"{a} slots={self.ranks_per_host}\n" for a in self.addresses)
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            net = f"{self.subnet}.0/24"
            argv = ["mpirun", "--allow-run-as-root", "-np", str(np_), "--hostfile", hostfile,
                    "--map-by", "slot", "--bind-to", "none",
                    "--mca", "plm_rsh_agent", self._agent(tmp), "--mca", "plm_rsh_no_tree_spawn",
                    "1", "--mca", "oob_tcp_if_include", net, "--mca", "btl_tcp_if_include", net,
                    "--mca", "btl", "self,vader,tcp", *cmd]  # fmt: skip
            log = os.path.join(tmp, "mpi.log")
            with open(log, "wb") as out:
                return [subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)]
        procs = []
        for rank in range(np_):
            host, local = self.host_of(rank), rank % self.ranks_per_host
            renv = dict(env)
            if backend == "gloo":
                renv.update(MASTER_ADDR=self.addresses[0], MASTER_PORT=str(port),
                            WORLD_SIZE=str(np_), RANK=str(rank), LOCAL_RANK=str(local),
                            GLOO_SOCKET_IFNAME="eth0")  # fmt: skip
            else:
                renv.update(self.hora_identity(rank))
            log = os.path.join(tmp, f"{backend}.{rank}.log")
            procs.append(self._launch(host, cmd, renv, log))
        return procs

    def run_backend(
        self,
        backend: str,
        config: BenchConfig,
        tmp: str,
        on_row: Callable[[report.Row], None],
        tag: str = "",
    ) -> list[report.Row]:
        """Like :func:`hora.lab.allreduce.run_backend`, with the ranks on the hosts."""
        out = os.path.join(tmp, f"{backend}{tag}.jsonl")
        plan_path = os.path.join(tmp, f"{backend}{tag}.plan.json")
        plan = config.plan(out, backend)
        if config.iters is None:
            plan["iters"] = [default_iters(s) for s in config.sizes]
            plan["warmup"] = [warmup_iters(i) for i in plan["iters"]]
        if backend in HORA_VARIANTS:
            plan["layout"] = os.path.join(tmp, f"{backend}{tag}.layout")
        with open(plan_path, "w") as f:
            json.dump(plan, f)
        server, extra = None, {}
        if backend in HORA_VARIANTS:
            from hora.rendezvous.server import RendezvousServer

            secret = secrets.token_bytes(32)
            server = RendezvousServer(secret, host=self.gateway)
            extra = {**HORA_VARIANTS[backend], "HORA_RENDEZVOUS_ADDR": self.gateway,
                     "HORA_RENDEZVOUS_PORT": str(server.start()), "HORA_SECRET_KEY": secret.hex()}
        procs: list[Any] = []
        before = self.sent_bytes()
        try:
            procs = self.spawn(backend, plan_path, tmp, extra, 20000 + secrets.randbelow(20000))
            try:
                rows = follow(procs, out, config.timeout, on_row)
            except BackendFailed as e:
                logs = sorted(n for n in os.listdir(tmp)
                              if n.startswith(backend + ".") and n.endswith(".log"))
                tails = "\n".join(f"--- {n}\n{tail(os.path.join(tmp, n))}" for n in logs)
                raise BackendFailed(f"{e}\n{tails}") from e
        finally:
            stop(procs)
            for ns in self.namespaces:  # orted and anything else left on the hosts
                _kill_in(ns)
            if server is not None:
                server.stop()
        self.link_bytes[backend] = self.link_bytes.get(backend, 0) + self.sent_bytes() - before
        if backend in HORA_VARIANTS:
            self.layouts[backend] = read_layouts(plan["layout"], len(procs))
        return rows


def read_layouts(prefix: str, count: int) -> list[dict[str, Any]]:
    found = []
    for rank in range(count):
        with contextlib.suppress(OSError, ValueError), open(f"{prefix}.{rank}") as f:
            found.append(json.load(f))
    return found


# -- the report ---------------------------------------------------------------------------------
def bounds(meta: dict[str, Any]) -> tuple[float, float]:
    """Bus bandwidth bounds in GB/s set by the hosts' links: (flat ring, any algorithm).

    A ring over all n ranks sends ``2 (n-1)/n`` of the buffer out of every rank; where the ring
    leaves a host, that is the host's link, so ``busbw = size/t * 2(n-1)/n`` is at most the link
    rate. An algorithm that moves data between hosts only (hierarchical: reduce inside each
    host, allreduce between the H hosts) must still send ``2 (H-1)/H`` of the buffer out of each
    host, so its busbw is at most ``rate * (n-1)/n * H/(H-1)``."""
    rate = meta["link_bps"] / 8 / 1e9
    n, h = meta["np"], meta["hosts"]
    return rate, rate * (n - 1) / n * h / (h - 1)


def header(meta: dict[str, Any]) -> list[str]:
    ring, best = bounds(meta)
    return [
        f"link: {meta['link_rate']} per host and direction ({meta['qdisc']}) = {ring:.3f} GB/s",
        "busbw = size / p50 * 2(n-1)/n; vs best = this row's busbw over the best other "
        "backend's at that size; of link = busbw over the link rate",
        f"link bound: a flat ring of all {meta['np']} ranks crosses each host's link with "
        f"2(n-1)/n of the buffer, so busbw <= {ring:.3f} GB/s; crossing only between the "
        f"{meta['hosts']} hosts (hierarchical), busbw <= {best:.3f} GB/s",
    ]


def table(rows: list[report.Row], meta: dict[str, Any]) -> str:
    """Per size and backend: latency, bus bandwidth, ratio to the best other backend, and the
    fraction of the link rate."""
    main = [r for r in rows if r["case"] == "allreduce"]
    ring, _ = bounds(meta)
    by_size: dict[int, list[report.Row]] = {}
    for r in main:
        by_size.setdefault(r["size_bytes"], []).append(r)
    headers = ["size", "backend", "iters", "p50 ms", "p90 ms", "busbw GB/s", "vs best", "of link"]
    body = []
    for size in sorted(by_size):
        for i, r in enumerate(by_size[size]):
            others = [o["busbw_gbps"] for o in by_size[size] if o is not r]
            vs = f"{r['busbw_gbps'] / max(others):.2f}x" if others and max(others) > 0 else ""
            body.append([
                report.human_size(size) if i == 0 else "", r["backend"], str(r["iters"]),
                f"{r['median_s'] * 1e3:.3f}", f"{r['p90_s'] * 1e3:.3f}",
                f"{r['busbw_gbps']:.3f}", vs, f"{r['busbw_gbps'] / ring:.2f}",
            ])  # fmt: skip
    return report.format_table(headers, body, left=2)


def footer(meta: dict[str, Any]) -> list[str]:
    """The bytes the links carried per backend, and where hora's ranks sent their data."""
    lines = [
        f"bytes sent over the hosts' links: {backend} {count / 2**20:.1f} MiB"
        for backend, count in meta.get("link_bytes", {}).items()
    ]
    for backend, ranks in meta.get("layouts", {}).items():
        for r in ranks:
            lines.append(
                f"{backend} rank {r['rank']} on {r['host']}: shared memory to "
                f"{r['shm_peers'] or 'none'}, TCP to {r['tcp_peers'] or 'none'}; "
                f"{', '.join(r['choices']) or 'flat algorithms'}"
            )
    return lines
