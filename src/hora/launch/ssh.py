"""Reaching remote hosts over ssh: the ssh command line, the preflight probe, remote workers.

The ssh options are Horovod's (``-o PasswordAuthentication=no -o StrictHostKeyChecking=no``,
``-p``, ``-i``) plus ``BatchMode`` so that nothing ever waits for a password prompt,
``ServerAliveInterval``/``ServerAliveCountMax`` so that a vanished host ends its sessions, and
hora's ``-F`` extension (``--ssh-config-file`` or ``HORA_SSH_CONFIG``) for host aliases. The remote
command is the wrapper of :mod:`hora.launch.process`, run by ``sh -c`` on the remote host; the
secret travels on the ssh process's stdin.

Pure functions plus :func:`probe`, which runs one ssh process and may be called from several
threads at once (thread-safe).
"""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass

from hora.errors import LaunchError

# Printed first by the probe so the reply can be told apart from login banners.
_MARK = "hora-probe"
PROBE_SCRIPT = f'echo "{_MARK} $SSH_CONNECTION"; ip -o -4 addr show 2>/dev/null'


@dataclass(frozen=True)
class SshOptions:
    port: int | None = None
    identity_file: str | None = None
    config_file: str | None = None
    connect_timeout: float | None = None

    def argv(self, host: str) -> list[str]:
        """``ssh ... host`` (the remote command goes after it)."""
        argv = [
            "ssh",
            "-o",
            "PasswordAuthentication=no",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "BatchMode=yes",
            # a host that vanished (powered off, network gone) ends its sessions within about
            # 15 s instead of never, so its ranks count as failed (an elastic job goes on)
            "-o",
            "ServerAliveInterval=5",
            "-o",
            "ServerAliveCountMax=3",
        ]
        if self.connect_timeout is not None:
            argv += ["-o", f"ConnectTimeout={max(1, int(self.connect_timeout))}"]
        if self.config_file:
            argv += ["-F", self.config_file]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        if self.identity_file:
            argv += ["-i", self.identity_file]
        return [*argv, host]

    def rsh_args(self) -> str:
        """The options mpirun's ssh launcher needs (``-mca plm_rsh_args``)."""
        parts: list[str] = []
        if self.config_file:
            parts += ["-F", self.config_file]
        if self.port is not None:
            parts += ["-p", str(self.port)]
        if self.identity_file:
            parts += ["-i", self.identity_file]
        return shlex.join(parts)


def remote_argv(options: SshOptions, host: str, script: str) -> list[str]:
    """The local argv that runs ``script`` with ``sh`` on ``host``."""
    return [*options.argv(host), "sh -c " + shlex.quote(script)]


@dataclass(frozen=True)
class ProbeResult:
    """What the preflight learned about one remote host."""

    host: str
    launcher_address: str  # this host's address as the remote host sees it
    interfaces: dict[str, list[str]]  # remote interface name -> IPv4 addresses


def probe(options: SshOptions, host: str, timeout: float) -> ProbeResult:
    """Ssh to ``host`` once; raise LaunchError with the reason when that fails."""
    argv = remote_argv(options, host, PROBE_SCRIPT)
    try:
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise LaunchError(
            f"host {host!r} did not answer ssh within {timeout:g} s (--start-timeout); "
            "is it up and reachable?"
        ) from None
    except FileNotFoundError as e:
        raise LaunchError("the ssh client is not installed; it is needed for remote hosts") from e
    if done.returncode != 0:
        raise LaunchError(_ssh_failure(host, options, done.stderr))
    return parse_probe(host, done.stdout)


def _ssh_failure(host: str, options: SshOptions, stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if not ln.startswith("Warning:")]
    detail = lines[-1] if lines else "no message"
    if "Could not resolve hostname" in stderr:
        return f"unknown host {host!r}: ssh could not resolve it ({detail})"
    retry = shlex.join([*options.argv(host), "true"])
    return f"cannot ssh to {host!r}: {detail}. Check that passwordless ssh works: {retry}"


def parse_probe(host: str, stdout: str) -> ProbeResult:
    """Read the probe's output: the ``SSH_CONNECTION`` line and ``ip -o -4 addr`` lines."""
    launcher = ""
    found: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        fields = line.split()
        if fields[:1] == [_MARK]:
            if len(fields) >= 2:
                launcher = fields[1]
        elif len(fields) >= 4 and fields[2] == "inet":
            name = fields[1].split("@", 1)[0]
            found.setdefault(name, []).append(fields[3].split("/", 1)[0])
    if not launcher:
        raise LaunchError(
            f"host {host!r}: the ssh probe did not report SSH_CONNECTION; got {stdout!r}"
        )
    return ProbeResult(host, launcher, found)
