"""This host: which host names mean "here", its network interfaces, and how a local worker starts.

A local worker is the wrapper script of :mod:`hora.launch.process` run by ``/bin/sh -c`` with
the worker's environment, in the launcher's working directory. Linux only (``setsid``, the
``SIOCGIFADDR`` ioctl). Pure functions; thread-safe.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915


def interfaces() -> dict[str, list[str]]:
    """IPv4 addresses of this host's interfaces that have one, by interface name."""
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # down, or no IPv4 address
            found[name] = [socket.inet_ntoa(reply[20:24])]
    return found


@functools.lru_cache(maxsize=1)
def _local_names() -> frozenset[str]:
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    for addrs in interfaces().values():
        names.update(addrs)
    return frozenset(n.lower() for n in names)


def is_local_host(name: str) -> bool:
    """Whether ``name`` (from ``-H`` or a hostfile) is this host, so no ssh is needed."""
    low = name.lower()
    if low in _local_names():
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(low).is_loopback
    return low.startswith("localhost.")


def worker_argv(script: str) -> list[str]:
    """The argv that runs the wrapper ``script`` on this host."""
    return ["/bin/sh", "-c", script]
