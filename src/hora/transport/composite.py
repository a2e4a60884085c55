"""HostTransport: shared-memory DATA pairs to the ranks of this host, TCP for everything else.

Every rank publishes where it runs under ``{prefix}/host/{rank}`` in the rendezvous store: its
host name (``HORA_HOSTNAME``, else the system's), the machine (kernel boot id and network
namespace, so two containers that share a host name are told apart) and whether it offers
shared memory. Two ranks use a shared-memory pair when both offer it and both records name the
same host on the same machine; both ends read the same two records, so they always agree.
CONTROL pairs stay on TCP (the engine watches them with ``selectors``). :meth:`host_ids`
gives the host table that hierarchical collectives group ranks by.

Thread-safety: ``pair``, ``host_ids`` and ``shares_memory`` may be called from any thread (the
engine thread in practice); records are read from the store lazily, once per rank.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from hora.errors import HoraError, TransportError
from hora.transport.base import DATA, Pair
from hora.transport.endpoint import get_within, gone_check
from hora.transport.shm import ShmTransport
from hora.transport.shm import available as shm_available
from hora.transport.tcp import TcpTransport

log = logging.getLogger(__name__)


class Store(Protocol):
    """What the transport needs from the rendezvous store (StoreClient provides it)."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout: float | None = None) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


def machine_id() -> str:
    """This machine and network namespace: processes that can reach each other's sockets."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{boot}/{netns}"


class HostTransport:
    """The Pairs of rank ``tcp.rank``: shared memory where possible, TCP elsewhere."""

    def __init__(
        self,
        tcp: TcpTransport,
        store: Store,
        prefix: str,
        hostname: str,
        shm: ShmTransport | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.rank = tcp.rank
        self.size = tcp.size
        self._tcp = tcp
        self._shm = shm
        self._store = store
        self._prefix = prefix
        self._timeout = timeout
        self._lock = threading.Lock()
        self._records: dict[int, tuple[str, bool]] = {}
        mine = {"host": hostname, "machine": machine_id(), "shm": shm is not None}
        self._records[self.rank] = self._parse(mine)
        self._gone = gone_check(store, prefix)
        for endpoint in (tcp, shm):
            if endpoint is not None:
                endpoint.give_up_when(self._gone)
        try:
            store.set(self._key(self.rank), json.dumps(mine).encode())
        except BaseException:
            self.close()
            raise

    @property
    def listen_address(self) -> tuple[str, int]:
        """Where the TCP transport listens (host, port)."""
        return self._tcp.listen_address

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/host/{rank}"

    @staticmethod
    def _parse(record: dict[str, Any]) -> tuple[str, bool]:
        return f"{record['host']}\0{record['machine']}", bool(record["shm"])

    def _record(self, rank: int) -> tuple[str, bool]:
        with self._lock:
            found = self._records.get(rank)
        if found is not None:
            return found
        try:
            raw = get_within(self._store, self._key(rank), self._timeout, self._give_up)
            record = self._parse(json.loads(raw))
        except HoraError as e:
            raise TransportError(f"rank {rank} did not publish its host in time: {e}") from e
        except (ValueError, KeyError, TypeError) as e:
            raise TransportError(f"rank {rank} published a malformed host record: {e}") from e
        with self._lock:
            self._records[rank] = record
        return record

    def _give_up(self) -> None:
        why = self._gone()
        if why:
            raise TransportError(f"rank {self.rank} stopped waiting for its peers' hosts: {why}")

    def shares_memory(self, peer: int) -> bool:
        """Whether DATA pairs to ``peer`` use shared memory (same host, both offer it)."""
        if self._shm is None or peer == self.rank:
            return False
        host, offered = self._record(peer)
        return offered and host == self._record(self.rank)[0]

    def host_ids(self, ranks: Sequence[int]) -> list[int]:
        """For each of ``ranks``, the index of its host, hosts numbered by first appearance."""
        numbers: dict[str, int] = {}
        return [numbers.setdefault(self._record(r)[0], len(numbers)) for r in ranks]

    def pair(self, peer: int, channel: int = DATA) -> Pair:
        if channel == DATA and self._shm is not None and self.shares_memory(peer):
            return self._shm.pair(peer)
        return self._tcp.pair(peer, channel)

    def close(self) -> None:
        """Close both transports. Idempotent, any thread."""
        if self._shm is not None:
            self._shm.close()
        self._tcp.close()


def host_transport(
    tcp: TcpTransport,
    store: Store,
    prefix: str,
    secret: bytes,
    hostname: str,
    shm_disable: bool,
    timeout: float = 30.0,
    single_copy: bool = True,
) -> HostTransport:
    """Wrap ``tcp`` so that ranks of this host talk over shared memory (unless disabled);
    ``single_copy=False`` stages every payload, as where the kernel refuses cross-process
    reads."""
    shm = None
    if not shm_disable and shm_available():
        try:
            shm = ShmTransport(tcp.rank, tcp.size, secret, prefix, connect_timeout=timeout,
                               single_copy=single_copy, handshake_timeout=tcp.handshake_timeout)
        except (TransportError, OSError) as e:
            log.warning("rank %d: shared memory unavailable, using TCP only: %s", tcp.rank, e)
    elif not shm_disable:
        log.debug("rank %d: shared memory needs Linux; using TCP only", tcp.rank)
    return HostTransport(tcp, store, prefix, hostname or socket.gethostname(), shm, timeout)
