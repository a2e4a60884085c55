"""Hosts and slots: parsing ``-H`` strings and hostfiles, and assigning ranks to slots.

Ranks are assigned exactly as Horovod does: hosts are filled in the order given; a slot's local
rank is its index within its host; its cross rank is the index of its host among the hosts that
have a slot with that local rank, and the cross size is the number of such hosts.

Pure functions on immutable data, run by the launcher's main thread; thread-safe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_HOST_RE = re.compile(r"^[\w.-]+$")
_HOSTFILE_LINE_RE = re.compile(r"^(?P<host>\S+)(?:\s+slots\s*=\s*(?P<slots>\S+))?\s*$")


@dataclass(frozen=True)
class HostSlots:
    """One host and how many worker processes it may run."""

    name: str
    slots: int


@dataclass(frozen=True)
class SlotInfo:
    """Where one rank runs and its place in the job's topology."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int

    def identity_env(self) -> dict[str, str]:
        """The per-rank variables, under both ``HORA_*`` and ``HOROVOD_*`` names."""
        values = {
            "HOSTNAME": self.hostname,
            "RANK": str(self.rank),
            "SIZE": str(self.size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_SIZE": str(self.local_size),
            "CROSS_RANK": str(self.cross_rank),
            "CROSS_SIZE": str(self.cross_size),
        }
        env = {}
        for key, value in values.items():
            env["HORA_" + key] = value
            env["HOROVOD_" + key] = value
        return env


def _check_name(name: str, where: str) -> str:
    if not _HOST_RE.match(name):
        raise ValueError(
            f"{where}: malformed host name {name!r}; use letters, digits, '.', '-' or '_' "
            "(for example -H server1:2,server2:2)"
        )
    return name


def _check_slots(raw: str, name: str, where: str) -> int:
    try:
        slots = int(raw)
    except ValueError:
        raise ValueError(
            f"{where}: slot count {raw!r} of host {name!r} is not an integer "
            f"(write {name}:4 for four slots)"
        ) from None
    if slots < 1:
        raise ValueError(f"{where}: host {name!r} has {slots} slots; a host needs at least 1")
    return slots


def parse_hosts(text: str) -> list[HostSlots]:
    """Parse ``-H`` syntax: ``host1:2,host2:4``; a host without ``:N`` has one slot."""
    where = f"-H {text!r}"
    if not text.strip():
        raise ValueError(f"{where}: empty host list; give host:slots pairs separated by commas")
    hosts: list[HostSlots] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"{where}: empty entry between commas")
        name, sep, slots = item.rpartition(":")
        if not sep:
            name, slots = item, "1"
        hosts.append(HostSlots(_check_name(name, where), _check_slots(slots, name, where)))
    return _no_duplicates(hosts, where)


def parse_hostfile(path: str | Path) -> list[HostSlots]:
    """Parse a hostfile: one ``host slots=N`` per line (``slots=`` optional, default 1).

    Blank lines and ``#`` comments are skipped.
    """
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--hostfile {str(path)!r}: cannot read it: {e.strerror}") from e
    hosts: list[HostSlots] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{lineno}"
        match = _HOSTFILE_LINE_RE.match(line)
        if not match:
            raise ValueError(f"{where}: expected 'host slots=N', got {line!r}")
        name = _check_name(match["host"], where)
        hosts.append(HostSlots(name, _check_slots(match["slots"] or "1", name, where)))
    if not hosts:
        raise ValueError(f"--hostfile {str(path)!r}: no hosts in it")
    return _no_duplicates(hosts, f"--hostfile {str(path)!r}")


def _no_duplicates(hosts: list[HostSlots], where: str) -> list[HostSlots]:
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise ValueError(
                f"{where}: host {host.name!r} is listed twice; list it once with "
                "the total number of slots"
            )
        seen.add(host.name)
    return hosts


def assign_ranks(hosts: list[HostSlots], np: int) -> list[SlotInfo]:
    """Give ``np`` ranks to the slots of ``hosts``, filling hosts in order.

    Raises ValueError when the hosts have fewer than ``np`` slots in total.
    """
    if np < 1:
        raise ValueError(f"-np {np}: the number of processes must be at least 1")
    total = sum(h.slots for h in hosts)
    if total < np:
        listing = ",".join(f"{h.name}:{h.slots}" for h in hosts)
        raise ValueError(
            f"-np {np} but the hosts {listing} have only {total} slots; add hosts or slots, "
            "or lower -np"
        )
    used: list[tuple[str, int]] = []  # (host, processes placed on it)
    remaining = np
    for host in hosts:
        if remaining == 0:
            break
        take = min(host.slots, remaining)
        used.append((host.name, take))
        remaining -= take
    slots: list[SlotInfo] = []
    rank = 0
    for host_index, (name, count) in enumerate(used):
        for local_rank in range(count):
            peers = [i for i, (_, c) in enumerate(used) if c > local_rank]
            slots.append(
                SlotInfo(
                    hostname=name,
                    rank=rank,
                    local_rank=local_rank,
                    cross_rank=peers.index(host_index),
                    size=np,
                    local_size=count,
                    cross_size=len(peers),
                )
            )
            rank += 1
    return slots
