"""TcpTransport: all the TCP connections of one rank, made lazily through the rendezvous store.

At construction the transport listens on an ephemeral port and publishes ``"host:port"`` under
``{prefix}/addr/{rank}``. ``pair(peer, channel)`` connects on first use: the higher rank
connects to the lower one (reading the address from the store) and the lower one waits for
that connection to arrive on its listener. Every connection runs the mutual HMAC handshake of
:mod:`hora.transport.tcp.auth`, binding both ranks, the channel and the prefix.

Threads: one daemon thread accepts connections and hands each to a short-lived daemon thread
that runs the handshake, so a slow or hostile client never holds up the others. ``pair`` may be
called from any thread (the engine thread in practice); ``close`` is idempotent and safe from any
thread.
"""

from __future__ import annotations

import fcntl
import logging
import socket
import struct
import threading
import time
from typing import Protocol

from hora.errors import AuthenticationError, HoraError, TransportError
from hora.transport.base import CONTROL, DATA
from hora.transport.tcp.auth import accept_handshake, connect_handshake
from hora.transport.tcp.pair import TcpPair
from hora.transport.tcp.wire import configure, hard_close

log = logging.getLogger(__name__)

_CONTEXT_TAG = b"hora-tcp/1\0"
_CONTEXT = struct.Struct("!iiB")  # connecting rank, accepting rank, channel; then the prefix
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


class TcpTransport:
    """The TCP Pairs of rank ``rank`` in a world of ``size`` ranks (see transport/base.py)."""

    def __init__(
        self,
        rank: int,
        size: int,
        secret: bytes,
        store: AddressBook,
        prefix: str,
        iface: str = "",
        connect_timeout: float = 30.0,
    ) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside [0, size={size})")
        if not secret:
            raise ValueError("the job secret must be a non-empty bytes value")
        self.rank = rank
        self.size = size
        self._secret = bytes(secret)
        self._store = store
        self._prefix = prefix
        self._timeout = connect_timeout
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._pairs: dict[tuple[int, int], TcpPair] = {}
        self._accepted: dict[tuple[int, int], socket.socket] = {}
        self._handshaking: set[socket.socket] = set()
        self._connecting: dict[tuple[int, int], threading.Lock] = {}
        self._closed = False
        host = advertise_address(iface, store.host)
        self._listener = socket.create_server((host if iface else "0.0.0.0", 0), backlog=128)
        self._address = (host, int(self._listener.getsockname()[1]))
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"hora-tcp-accept-{rank}", daemon=True
        )
        self._acceptor.start()
        try:
            store.set(self._addr_key(rank), f"{host}:{self._address[1]}".encode())
        except BaseException:
            self.close()
            raise

    @property
    def listen_address(self) -> tuple[str, int]:
        return self._address

    def _addr_key(self, rank: int) -> str:
        return f"{self._prefix}/addr/{rank}"

    def _context(self, src: int, dst: int, channel: int) -> bytes:
        return _CONTEXT_TAG + _CONTEXT.pack(src, dst, channel) + self._prefix.encode()

    # -- pairs -------------------------------------------------------------------------------

    def pair(self, peer: int, channel: int = DATA) -> TcpPair:
        """The Pair to ``peer`` on ``channel``, connecting on the first call."""
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"peer must be another rank in [0, {self.size}), got {peer}")
        if channel not in (DATA, CONTROL):
            raise ValueError(f"channel must be DATA ({DATA}) or CONTROL ({CONTROL}), got {channel}")
        key = (peer, channel)
        with self._lock:
            self._check_open()
            found = self._pairs.get(key)
            if found is not None:
                return found
            connecting = self._connecting.setdefault(key, threading.Lock())
        with connecting:
            with self._lock:
                found = self._pairs.get(key)
                if found is not None:
                    return found
            if self.rank > peer:
                sock = self._connect(peer, channel)
            else:
                sock = self._wait_for(peer, channel)
            made = TcpPair(sock, peer, channel)
            with self._lock:
                closed = self._closed
                if not closed:
                    self._pairs[key] = made
            if closed:
                made.close()
                self._check_open()
            return made

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"the TCP transport of rank {self.rank} is closed")

    def _connect(self, peer: int, channel: int) -> socket.socket:
        deadline = time.monotonic() + self._timeout
        key = self._addr_key(peer)
        try:
            raw = self._store.get(key, timeout=self._timeout)
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
        key = (peer, channel)
        with self._arrived:
            ready = self._arrived.wait_for(
                lambda: key in self._accepted or self._closed, self._timeout
            )
            self._check_open()
            if ready:
                return self._accepted.pop(key)
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

    # -- listener (accept thread and handshake threads) ------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except OSError as e:
                if self._closed:
                    return
                log.warning("rank %d: accept failed: %s", self.rank, e)
                time.sleep(0.1)
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._handshaking.add(conn)
            threading.Thread(
                target=self._admit, args=(conn, addr), name="hora-tcp-handshake", daemon=True
            ).start()

    def _parse_context(self, context: bytes) -> tuple[int, int]:
        head = len(_CONTEXT_TAG) + _CONTEXT.size
        if not context.startswith(_CONTEXT_TAG) or len(context) < head:
            raise ValueError("not a hora transport connection")
        src, dst, channel = _CONTEXT.unpack(context[len(_CONTEXT_TAG) : head])
        if context[head:] != self._prefix.encode():
            raise ValueError(f"connection for another job generation {context[head:]!r}")
        if dst != self.rank or not self.rank < src < self.size or channel not in (DATA, CONTROL):
            raise ValueError(f"rank {src} -> rank {dst} channel {channel} is not expected here")
        return src, channel

    def _admit(self, conn: socket.socket, addr: tuple[str, int]) -> None:
        try:
            key = accept_handshake(conn, self._secret, self._parse_context)
            configure(conn)
        except (AuthenticationError, OSError) as e:
            if not self._closed:
                log.warning(
                    "rank %d: dropped a connection from %s:%d: %s", self.rank, addr[0], addr[1], e
                )
            with self._lock:
                self._handshaking.discard(conn)
            conn.close()
            return
        with self._arrived:
            self._handshaking.discard(conn)
            duplicate = key in self._accepted or key in self._pairs
            if not self._closed and not duplicate:
                self._accepted[key] = conn
                self._arrived.notify_all()
                return
        if duplicate:
            log.warning("rank %d: dropped a second connection from rank %d", self.rank, key[0])
        conn.close()

    def close(self) -> None:
        """Close every pair, pending connection and the listener. Idempotent, any thread."""
        with self._arrived:
            if self._closed:
                return
            self._closed = True
            pairs = list(self._pairs.values())
            socks = list(self._accepted.values()) + list(self._handshaking)
            self._accepted.clear()
            self._arrived.notify_all()
        for sock in [self._listener, *socks]:
            hard_close(sock)
        for pair in pairs:
            pair.close()

    def __enter__(self) -> TcpTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
