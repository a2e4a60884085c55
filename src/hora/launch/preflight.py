"""Checks made before any worker starts: every remote host answers ssh, and which network
interfaces the job's hosts have in common.

The ssh probes run in parallel (one thread each) under ``--start-timeout``; every failure is
collected and reported together in one LaunchError. Called by the launcher's main thread.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from hora.errors import LaunchError
from hora.launch import local, ssh

log = logging.getLogger("hora.launch")

LOOPBACK_ADDRESS = "127.0.0.1"


@dataclass(frozen=True)
class Preflight:
    """The launcher's address as each host sees it, and the interfaces workers should use."""

    launcher_address: dict[str, str]  # host name -> address of the rendezvous store
    interfaces: list[str]  # chosen interfaces, first preferred; empty: let workers choose
    reason: str  # why those interfaces

    def store_bind_address(self, listen_any: bool = False, open_ended: bool = False) -> str:
        """Where the rendezvous store listens: loopback when every host is this one, else the
        one address every remote host reaches this host at (local ranks then use it too); the
        wildcard only when asked for (``listen_any``), for a job whose hosts are not known yet
        (``open_ended``: elastic) or whose hosts reach this one at different addresses."""
        if listen_any or open_ended:
            return "0.0.0.0"
        remote = {a for a in self.launcher_address.values() if a != LOOPBACK_ADDRESS}
        if not remote:
            return LOOPBACK_ADDRESS
        if len(remote) == 1:
            (address,) = remote
            for host in self.launcher_address:  # a local rank reaches the same address
                self.launcher_address[host] = address
            return address
        log.warning(
            "the remote hosts reach this host at different addresses (%s): the rendezvous store "
            "listens on every interface",
            ", ".join(sorted(remote)),
        )
        return "0.0.0.0"

    @property
    def remote_address(self) -> str:
        """One address every host can reach the launcher at (for mpirun's single -x value)."""
        remote = [a for a in self.launcher_address.values() if a != LOOPBACK_ADDRESS]
        return remote[0] if remote else LOOPBACK_ADDRESS


def run_preflight(
    hosts: list[str],
    options: ssh.SshOptions,
    timeout: float,
    wanted_interfaces: list[str],
) -> Preflight:
    """Probe ``hosts`` (the hosts that get ranks) and choose the interfaces."""
    remote = [h for h in hosts if not local.is_local_host(h)]
    addresses = {h: LOOPBACK_ADDRESS for h in hosts if h not in remote}
    host_interfaces: dict[str, dict[str, list[str]]] = {}
    if len(remote) < len(hosts):
        host_interfaces["localhost"] = local.interfaces()
    if remote:
        log.debug("preflight: checking ssh to %s", ", ".join(remote))
        errors: list[str] = []
        with ThreadPoolExecutor(max_workers=min(32, len(remote))) as pool:
            futures = {h: pool.submit(ssh.probe, options, h, timeout) for h in remote}
            for host, future in futures.items():
                try:
                    result = future.result()
                except LaunchError as e:
                    errors.append(str(e))
                    continue
                addresses[host] = result.launcher_address
                host_interfaces[host] = result.interfaces
        if errors:
            raise LaunchError("preflight failed:\n  " + "\n  ".join(errors))
    chosen, reason = choose_interfaces(host_interfaces, wanted_interfaces, bool(remote))
    return Preflight(addresses, chosen, reason)


def choose_interfaces(
    host_interfaces: dict[str, dict[str, list[str]]], wanted: list[str], multi_host: bool
) -> tuple[list[str], str]:
    """The interfaces to use and why. Raises LaunchError when a wanted one is missing."""
    names = [set(ifaces) for ifaces in host_interfaces.values()]
    common = set.intersection(*names) if names else set()
    if multi_host:  # loopback cannot carry traffic between hosts
        common = {
            n
            for n in common
            if not any(
                a.startswith("127.") for ifs in host_interfaces.values() for a in ifs.get(n, [])
            )
        }
    if wanted:
        missing = {
            name: sorted(h for h, ifs in host_interfaces.items() if name not in ifs)
            for name in wanted
        }
        problems = [f"{n} (missing on {', '.join(hs)})" for n, hs in missing.items() if hs]
        if problems:
            raise LaunchError(
                "--network-interfaces: not on every host: "
                + "; ".join(problems)
                + f". Interfaces common to all hosts: {', '.join(sorted(common)) or 'none'}"
            )
        return list(wanted), "given by --network-interfaces"
    if not common:
        if multi_host:
            log.warning(
                "no network interface name is common to all hosts (%s); workers will choose "
                "their own addresses. Use --network-interfaces to pick one.",
                "; ".join(
                    f"{h}: {','.join(sorted(i)) or 'none'}" for h, i in host_interfaces.items()
                ),
            )
        return [], "no interface common to all hosts"
    ordered = sorted(common)
    if not multi_host:
        loop = [n for n in ordered if n == "lo"]
        if loop:
            return loop, "all ranks run on this host, so they talk over the loopback interface"
    if len(ordered) == 1:
        return ordered, f"the only interface present on every host ({len(names)} hosts)"
    return ordered, (
        f"present on every host; {ordered[0]} is used first (alphabetical order among "
        f"{', '.join(ordered)}); pick another with --network-interfaces"
    )
