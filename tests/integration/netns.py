"""Two or more "hosts" on this machine: network namespaces on a bridge, each with a real sshd.

``with Cluster(["hostA", "hostB"], tmp_path) as cluster:`` creates, for each host, a network
namespace with an ``eth0`` on a private /24 (10.77.N.0/24, N derived from the process id so
that concurrent runs do not collide), joined by a bridge that also gives the root namespace the
address .1, so the launcher (in the root namespace) reaches every host and every host reaches
the launcher's rendezvous store. Each namespace runs ``/usr/sbin/sshd -D`` with a host key and
an authorized key generated for the test; ``cluster.ssh_config`` is an ssh client config with a
``Host`` entry per name (and ``unreachable_host`` pointing at an address nobody has).
Everything is removed on exit, including any process left in the namespaces.

:func:`unavailable_reason` says why this cannot run here (not root, no ``ip netns``, no sshd),
or returns None. Used by the test process's main thread only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

SSHD = "/usr/sbin/sshd"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def unavailable_reason() -> str | None:
    """Why namespaces with sshd cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} is missing (install openssh-server)"
    probe = f"hora-probe-{os.getpid()}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Cluster:
    unreachable_host = "hostUnreachable"
    _made = 0  # clusters made by this process: each gets names and a subnet of its own

    def __init__(self, names: list[str], workdir: Path):
        Cluster._made += 1
        serial = Cluster._made % 10
        pid = os.getpid()
        tag = (pid + 17 * serial) % 200 + 20
        self.names = names
        self.workdir = workdir
        self.subnet = f"10.77.{tag}"
        self.launcher_address = f"{self.subnet}.1"
        # a namespace whose last process is still exiting outlives `ip netns del` with its
        # veth, so a later cluster of the same process must not reuse the names
        self.bridge = f"hbr{pid % 100000}{serial}"
        self.namespaces = {n: f"hora-{pid}-{serial}-{i}" for i, n in enumerate(names)}
        self.addresses = {n: f"{self.subnet}.{i + 2}" for i, n in enumerate(names)}
        self.ssh_config = workdir / "ssh_config"
        self._sshd: list[subprocess.Popen[bytes]] = []
        self._logs: list[BinaryIO] = []

    def __enter__(self) -> Cluster:
        try:
            self._setup()
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._teardown()

    def _setup(self) -> None:
        keys = self.workdir / "keys"
        keys.mkdir()
        for name in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                            str(keys / name)], check=True, timeout=30)  # fmt: skip
        (keys / "authorized_keys").write_text((keys / "client_key.pub").read_text())
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.launcher_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        entries = []
        for index, (name, ns) in enumerate(self.namespaces.items()):
            addr = self.addresses[name]
            veth = f"{self.bridge}v{index}"
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            config = self.workdir / f"sshd_{name}.conf"
            options = [
                f"ListenAddress {addr}", "Port 22", f"HostKey {keys / 'host_key'}",
                f"AuthorizedKeysFile {keys / 'authorized_keys'}",
                "PermitRootLogin prohibit-password", "PubkeyAuthentication yes",
                "PasswordAuthentication no", "StrictModes no", "UsePAM no", "LogLevel ERROR",
                f"PidFile {self.workdir / f'sshd_{name}.pid'}",
            ]  # fmt: skip
            config.write_text("\n".join(options) + "\n")
            log = (self.workdir / f"sshd_{name}.log").open("wb")
            self._logs.append(log)
            argv = ["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(config)]
            self._sshd.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log))
            entries.append((name, addr))
        entries.append((self.unreachable_host, f"{self.subnet}.250"))
        self.ssh_config.write_text("".join(
            f"Host {name}\n  HostName {addr}\n  User root\n  IdentityFile {keys / 'client_key'}\n"
            "  UserKnownHostsFile /dev/null\n  StrictHostKeyChecking no\n  LogLevel ERROR\n"
            for name, addr in entries
        ))  # fmt: skip
        for name in self.names:
            self._wait_for_sshd(name)

    def _wait_for_sshd(self, name: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection((self.addresses[name], 22), timeout=1.0),
            ):
                return
            time.sleep(0.1)
        log = (self.workdir / f"sshd_{name}.log").read_text(errors="replace")
        raise RuntimeError(f"sshd for {name} did not start: {log}")

    @property
    def sshd_pids(self) -> set[int]:
        """The listening sshd of every host (their sessions are not counted)."""
        return {proc.pid for proc in self._sshd}

    def processes(self, name: str) -> list[int]:
        """Pids of every process in ``name``'s namespace (sshd, sessions, workers)."""
        done = _ip("netns", "pids", self.namespaces[name], check=False)
        return [int(p) for p in done.stdout.split()]

    def take_down(self, name: str) -> None:
        """The host ``name`` vanishes: its link goes down (nothing it sends arrives any more,
        not even the closing of its connections), then every process in its namespace (sshd,
        sessions, workers) is killed."""
        _ip("-n", self.namespaces[name], "link", "set", "eth0", "down", check=False)
        for pid in self.processes(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _teardown(self) -> None:
        for name in self.names:
            for pid in self.processes(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self._sshd:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        deadline = time.monotonic() + 10  # let killed processes leave their namespaces
        while time.monotonic() < deadline and any(self.processes(n) for n in self.names):
            time.sleep(0.1)
        for ns in self.namespaces.values():
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        for log in self._logs:
            log.close()
