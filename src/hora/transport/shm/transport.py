"""ShmTransport: the shared-memory DATA pairs of one rank toward the ranks of its own host.

The transport listens on an abstract Unix socket named after the job (a hash of its secret and
store prefix) and its rank; abstract sockets have no file, so nothing is left behind on any
exit path. ``pair(peer)`` connects on first use: the higher rank connects twice to the lower
one, one socket per direction, and each connection runs hora's mutual HMAC handshake
(:mod:`hora.transport.tcp.auth`) binding both ranks, the direction and the prefix. Then, per
direction, the sender shows the receiver a probe buffer: if the receiver can read it with
``process_vm_readv`` (the kernel names the sender's pid through ``SO_PEERCRED``), payloads of
that direction are copied once, straight from the sender's memory; otherwise the sender makes
a staging area and passes its descriptor over the socket. The decision is logged at debug level.

Threads: one daemon thread accepts connections and hands each to a short-lived daemon thread
that runs the handshake and the probe, so the connecting rank never waits for the accepting
rank to ask for the pair. ``pair`` and ``close`` are thread-safe.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import struct
import sys
import threading
import time

from hora.errors import AuthenticationError, TransportError
from hora.transport.base import DATA
from hora.transport.shm import cma
from hora.transport.shm.pair import Link, ShmPair
from hora.transport.shm.staging import Staging
from hora.transport.shm.staging import available as staging_available
from hora.transport.tcp.auth import accept_handshake, connect_handshake
from hora.transport.tcp.wire import hard_close, recv_exact

log = logging.getLogger(__name__)

_CONTEXT_TAG = b"hora-shm/1\0"
_CONTEXT = struct.Struct("!iiB")  # connecting rank, accepting rank, direction; then the prefix
_PROBE = struct.Struct("=Q16s")  # address of the probe bytes, and the bytes themselves
_SINGLE_COPY, _STAGED = b"C", b"S"
_TOWARD_ACCEPTOR, _TOWARD_CONNECTOR = 0, 1
_SOCKET_BUFFER = 1 << 20


def available() -> bool:
    """Whether this platform can run the transport (Linux: abstract sockets, memfd)."""
    return sys.platform.startswith("linux") and staging_available()


def socket_name(secret: bytes, prefix: str, rank: int) -> str:
    """The abstract Unix socket on which ``rank`` of the job listens."""
    tag = hashlib.sha256(secret + b"\0" + prefix.encode()).hexdigest()[:16]
    return f"\0hora-shm-{tag}-{rank}"


class ShmTransport:
    """The shared-memory Pairs of rank ``rank``; peers must be on the same host."""

    def __init__(
        self,
        rank: int,
        size: int,
        secret: bytes,
        prefix: str,
        connect_timeout: float = 30.0,
        single_copy: bool = True,
    ) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside [0, size={size})")
        if not secret:
            raise ValueError("the job secret must be a non-empty bytes value")
        if not available():
            raise RuntimeError("the shared-memory transport needs Linux (memfd, abstract sockets)")
        self.rank = rank
        self.size = size
        self._secret = bytes(secret)
        self._prefix = prefix
        self._timeout = connect_timeout
        self._single_copy = single_copy and cma.supported()
        self._lock = threading.Condition()
        self._pairs: dict[int, ShmPair] = {}
        self._arrived: dict[tuple[int, int], Link] = {}
        self._pending: set[socket.socket] = set()
        self._connecting: dict[int, threading.Lock] = {}
        self._closed = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(socket_name(secret, prefix, rank))
            self._listener.listen(128)
        except OSError as e:
            self._listener.close()
            raise TransportError(f"rank {rank} could not listen for shared memory: {e}") from e
        name = f"hora-shm-accept-{rank}"
        threading.Thread(target=self._accept_loop, name=name, daemon=True).start()

    def _context(self, src: int, dst: int, direction: int) -> bytes:
        return _CONTEXT_TAG + _CONTEXT.pack(src, dst, direction) + self._prefix.encode()

    # -- pairs -------------------------------------------------------------------------------

    def pair(self, peer: int, channel: int = DATA) -> ShmPair:
        """The shared-memory DATA Pair to ``peer``, connecting on the first call."""
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"peer must be another rank in [0, {self.size}), got {peer}")
        if channel != DATA:
            raise ValueError(f"shared memory carries the DATA channel ({DATA}) only, not {channel}")
        with self._lock:
            self._check_open()
            found = self._pairs.get(peer)
            if found is not None:
                return found
            connecting = self._connecting.setdefault(peer, threading.Lock())
        with connecting:
            with self._lock:
                found = self._pairs.get(peer)
                if found is not None:
                    return found
            made = self._connect(peer) if self.rank > peer else self._wait_for(peer)
            with self._lock:
                closed = self._closed
                if not closed:
                    self._pairs[peer] = made
            if closed:
                made.close()
                self._check_open()
            log.debug("rank %d: %r", self.rank, made)
            return made

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"the shared-memory transport of rank {self.rank} is closed")

    def _connect(self, peer: int) -> ShmPair:
        deadline = time.monotonic() + self._timeout
        links = []
        for direction in (_TOWARD_ACCEPTOR, _TOWARD_CONNECTOR):
            sock = self._dial(peer, deadline)
            try:
                connect_handshake(sock, self._secret, self._context(self.rank, peer, direction))
                links.append(self._setup(sock, sending=direction == _TOWARD_ACCEPTOR))
            except (AuthenticationError, OSError, EOFError) as e:
                sock.close()
                for link in links:
                    link.sock.close()
                raise TransportError(
                    f"shared-memory connection from rank {self.rank} to rank {peer} failed: {e}"
                ) from e
        return ShmPair(peer, links[0], links[1])

    def _dial(self, peer: int, deadline: float) -> socket.socket:
        name = socket_name(self._secret, self._prefix, peer)
        delay = 0.01
        while True:
            self._check_open()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(name)
                return sock
            except OSError as e:
                sock.close()
                if time.monotonic() >= deadline:
                    raise TransportError(
                        f"rank {peer} is not listening for shared memory on this host after "
                        f"{self._timeout:g}s ({e}); set HORA_SHM_DISABLE=1 to use TCP"
                    ) from e
                time.sleep(delay)
                delay = min(delay * 2, 0.25)

    def _wait_for(self, peer: int) -> ShmPair:
        keys = [(peer, _TOWARD_ACCEPTOR), (peer, _TOWARD_CONNECTOR)]
        with self._lock:
            ready = self._lock.wait_for(
                lambda: all(k in self._arrived for k in keys) or self._closed, self._timeout
            )
            self._check_open()
            if not ready:
                raise TransportError(
                    f"rank {peer} did not connect to rank {self.rank} over shared memory within "
                    f"{self._timeout:g}s; check that rank {peer} is running"
                )
            inn, out = (self._arrived.pop(k) for k in keys)
        return ShmPair(peer, out, inn)

    def _setup(self, sock: socket.socket, sending: bool) -> Link:
        """Agree how payloads of this direction travel: single copy, or a staging area."""
        sock.settimeout(self._timeout)
        with contextlib.suppress(OSError):  # room for whole inline frames (the kernel caps it)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
        if sending:
            probe = bytearray(os.urandom(16))
            sock.sendall(_PROBE.pack(cma.address(memoryview(probe)), bytes(probe)))
            answer = recv_exact(sock, 1)
            if answer not in (_SINGLE_COPY, _STAGED):
                raise OSError(f"unexpected probe answer {answer!r}")
            link = Link(sock, answer == _SINGLE_COPY)
            if not link.single_copy:
                link.staging = Staging.create(sock)
        else:
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid = struct.unpack("3i", raw)[0]
            addr, expected = _PROBE.unpack(recv_exact(sock, _PROBE.size))
            single = self._single_copy and pid > 0 and cma.readable(pid, addr, expected)
            sock.sendall(_SINGLE_COPY if single else _STAGED)
            link = Link(sock, single, None if single else Staging.receive(sock), pid)
        sock.settimeout(None)
        return link

    # -- listener (accept thread and admission threads) -------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError as e:
                if self._closed:
                    return
                log.warning("rank %d: shared-memory accept failed: %s", self.rank, e)
                time.sleep(0.1)
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._pending.add(conn)
            threading.Thread(target=self._admit, args=(conn,), daemon=True).start()

    def _parse_context(self, context: bytes) -> tuple[int, int]:
        head = len(_CONTEXT_TAG) + _CONTEXT.size
        if not context.startswith(_CONTEXT_TAG) or len(context) < head:
            raise ValueError("not a hora shared-memory connection")
        src, dst, direction = _CONTEXT.unpack(context[len(_CONTEXT_TAG) : head])
        if context[head:] != self._prefix.encode():
            raise ValueError(f"connection for another job generation {context[head:]!r}")
        valid = direction in (_TOWARD_ACCEPTOR, _TOWARD_CONNECTOR)
        if dst != self.rank or not self.rank < src < self.size or not valid:
            raise ValueError(f"rank {src} -> rank {dst} direction {direction} is not expected")
        return src, direction

    def _admit(self, conn: socket.socket) -> None:
        try:
            key = accept_handshake(conn, self._secret, self._parse_context)
            link = self._setup(conn, sending=key[1] == _TOWARD_CONNECTOR)
        except (AuthenticationError, OSError, EOFError) as e:
            if not self._closed:
                log.warning("rank %d: dropped a shared-memory connection: %s", self.rank, e)
            with self._lock:
                self._pending.discard(conn)
            conn.close()
            return
        with self._lock:
            self._pending.discard(conn)
            duplicate = key in self._arrived or key[0] in self._pairs
            if not self._closed and not duplicate:
                self._arrived[key] = link
                self._lock.notify_all()
                return
        if duplicate:
            log.warning("rank %d: dropped a second connection from rank %d", self.rank, key[0])
        conn.close()

    def close(self) -> None:
        """Close every pair, pending connection and the listener. Idempotent, any thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pairs = list(self._pairs.values())
            socks = [link.sock for link in self._arrived.values()] + list(self._pending)
            self._arrived.clear()
            self._lock.notify_all()
        for sock in [self._listener, *socks]:
            hard_close(sock)
        for pair in pairs:
            pair.close()

    def __enter__(self) -> ShmTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
