"""TcpTransport: all the TCP connections of one rank, made lazily through the rendezvous store.

At construction the transport listens on an ephemeral port of the address it publishes (the
interface ``iface``'s, else the one that routes toward the rendezvous store: loopback for a local
job; every interface only with ``listen_any``) and publishes ``"host:port"`` under
``{prefix}/addr/{rank}``. ``pair(peer, channel)`` connects on first use: the higher rank
connects to the lower one (reading the address from the store) and the lower one waits for
that connection to arrive on its listener. Every connection runs the mutual HMAC handshake of
:mod:`hora.transport.tcp.auth`, binding both ranks, the channel and the prefix.

The listener, its handshake threads and the lazy pair table come from
:class:`~hora.transport.endpoint.Endpoint`. ``pair`` may be called from any thread (the engine
thread in practice); ``close`` is idempotent and safe from any thread.
"""

from __future__ import annotations

import fcntl
import logging
import socket
import struct
import time
from typing import Protocol

from hora.errors import AuthenticationError, HoraError, TransportError
from hora.transport.base import CONTROL, DATA
from hora.transport.endpoint import Endpoint, get_within
from hora.transport.listener import HANDSHAKE_DEADLINE_S
from hora.transport.tcp.auth import connect_handshake
from hora.transport.tcp.liveness import AckWatch
from hora.transport.tcp.pair import TcpPair
from hora.transport.tcp.wire import configure

log = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915


class AddressBook(Protocol):
    """What the transport needs from the rendezvous store (StoreClient provides it)."""

    host: str

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout: float | None = None) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


def interface_address(iface: str) -> str:
    """The IPv4 address of network interface ``iface`` (an IPv4 literal is returned as is)."""
    try:
        socket.inet_aton(iface)
        return iface
    except OSError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", iface.encode()[:15]))
        except OSError as e:
            names = ", ".join(name for _, name in socket.if_nameindex())
            raise ValueError(
                f"network interface {iface!r} has no IPv4 address ({e}); available: {names}"
            ) from e
    return socket.inet_ntoa(packed[20:24])


def advertise_address(iface: str, toward: str) -> str:
    """The address peers should use: ``iface``'s, else the one that routes toward ``toward``."""
    if iface:
        return interface_address(iface)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((toward, 9))  # UDP: no packet is sent, only a route is chosen
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class TcpTransport(Endpoint):
    """The TCP Pairs of rank ``rank`` in a world of ``size`` ranks (see transport/base.py)."""

    TAG = b"hora-tcp/1\0"
    KINDS = (DATA, CONTROL)
    WHAT = "TCP"

    def __init__(
        self,
        rank: int,
        size: int,
        secret: bytes,
        store: AddressBook,
        prefix: str,
        iface: str = "",
        connect_timeout: float = 30.0,
        handshake_timeout: float = HANDSHAKE_DEADLINE_S,
        listen_any: bool = False,
    ) -> None:
        super().__init__(rank, size, secret, prefix, connect_timeout, handshake_timeout)
        self._store = store
        host = advertise_address(iface, store.host)
        listener = socket.create_server(("0.0.0.0" if listen_any else host, 0), backlog=128)
        self._address = (host, int(listener.getsockname()[1]))
        self._listen(listener, f"hora-tcp-accept-{rank}")
        # fails a connection whose peer's host vanished with data in flight (tcp.liveness)
        self._watch = AckWatch(self._open_pairs, f"hora-tcp-watch-{rank}")
        self._watch.start()
        try:
            store.set(self._addr_key(rank), f"{host}:{self._address[1]}".encode())
        except BaseException:
            self.close()
            raise

    @property
    def listen_address(self) -> tuple[str, int]:
        return self._address

    def _open_pairs(self) -> list[TcpPair]:
        with self._lock:
            return list(self._pairs.values())

    def close(self) -> None:
        self._watch.stop()
        super().close()

    def _addr_key(self, rank: int) -> str:
        return f"{self._prefix}/addr/{rank}"

    def pair(self, peer: int, channel: int = DATA) -> TcpPair:
        """The Pair to ``peer`` on ``channel``, connecting on the first call."""
        self._check_peer(peer)
        if channel not in self.KINDS:
            raise ValueError(f"channel must be DATA ({DATA}) or CONTROL ({CONTROL}), got {channel}")

        def make() -> TcpPair:
            if self.rank > peer:
                sock = self._connect(peer, channel)
            else:
                sock = self._wait_for(peer, channel)
            return TcpPair(sock, peer, channel)

        return self._lazy((peer, channel), make)  # type: ignore[no-any-return]

    def _connect(self, peer: int, channel: int) -> socket.socket:
        deadline = time.monotonic() + self._timeout
        key = self._addr_key(peer)
        try:
            raw = get_within(self._store, key, self._timeout, self._give_up)
        except HoraError as e:
            raise TransportError(
                f"rank {peer} did not publish its address ({key}) in time: {e}"
            ) from e
        host, _, port = raw.decode().rpartition(":")
        delay = 0.02
        while True:
            self._check_open()
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection((host, int(port)), timeout=max(remaining, 0.1))
                break
            except OSError as e:
                if remaining <= 0:
                    raise TransportError(
                        f"could not connect to rank {peer} at {host}:{port} within "
                        f"{self._timeout:g}s: {e}"
                    ) from e
                self._give_up()
                time.sleep(min(delay, max(remaining, 0.0)))
                delay = min(delay * 2, 0.5)
        try:
            connect_handshake(sock, self._secret, self._context(self.rank, peer, channel))
        except AuthenticationError as e:
            sock.close()
            raise AuthenticationError(
                f"rank {peer} at {host}:{port} refused rank {self.rank}: {e}"
            ) from e
        configure(sock)
        return sock

    def _wait_for(self, peer: int, channel: int) -> socket.socket:
        arrived = self._take([(peer, channel)])
        if arrived is not None:
            return arrived[0]  # type: ignore[no-any-return]
        where = "not published yet"
        try:
            if self._store.check([self._addr_key(peer)]):
                where = self._store.get(self._addr_key(peer), timeout=1.0).decode()
        except HoraError:
            pass
        raise TransportError(
            f"rank {peer} (address {where}) did not connect to rank {self.rank} "
            f"({self._address[0]}:{self._address[1]}) on channel {channel} within "
            f"{self._timeout:g}s; check that rank {peer} is running and can reach this host"
        )

    def _adopt(self, conn: socket.socket, kind: int) -> socket.socket:
        configure(conn)
        return conn
