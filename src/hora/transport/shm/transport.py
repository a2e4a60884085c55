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

The listener, its admission threads (the handshake, then the probe) and the lazy pair table
come from :class:`~hora.transport.endpoint.Endpoint`. ``pair`` and ``close`` are thread-safe.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import struct
import sys
import time

from hora.errors import AuthenticationError, TransportError
from hora.transport.base import DATA
from hora.transport.endpoint import Endpoint
from hora.transport.listener import HANDSHAKE_DEADLINE_S
from hora.transport.shm import cma
from hora.transport.shm.pair import Link, ShmPair
from hora.transport.shm.staging import Staging
from hora.transport.shm.staging import available as staging_available
from hora.transport.tcp.auth import connect_handshake
from hora.transport.tcp.wire import recv_exact

log = logging.getLogger(__name__)

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


class ShmTransport(Endpoint):
    """The shared-memory Pairs of rank ``rank``; peers must be on the same host."""

    TAG = b"hora-shm/1\0"
    KINDS = (_TOWARD_ACCEPTOR, _TOWARD_CONNECTOR)
    WHAT = "shared-memory"

    def __init__(
        self,
        rank: int,
        size: int,
        secret: bytes,
        prefix: str,
        connect_timeout: float = 30.0,
        single_copy: bool = True,
        handshake_timeout: float = HANDSHAKE_DEADLINE_S,
    ) -> None:
        super().__init__(rank, size, secret, prefix, connect_timeout, handshake_timeout)
        if not available():
            raise RuntimeError("the shared-memory transport needs Linux (memfd, abstract sockets)")
        self._single_copy = single_copy and cma.supported()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(socket_name(secret, prefix, rank))
            listener.listen(128)
        except OSError as e:
            listener.close()
            raise TransportError(f"rank {rank} could not listen for shared memory: {e}") from e
        self._listen(listener, f"hora-shm-accept-{rank}")

    # -- pairs -------------------------------------------------------------------------------

    def pair(self, peer: int, channel: int = DATA) -> ShmPair:
        """The shared-memory DATA Pair to ``peer``, connecting on the first call."""
        self._check_peer(peer)
        if channel != DATA:
            raise ValueError(f"shared memory carries the DATA channel ({DATA}) only, not {channel}")

        def make() -> ShmPair:
            made = self._connect(peer) if self.rank > peer else self._wait_for(peer)
            log.debug("rank %d: %r", self.rank, made)
            return made

        return self._lazy(peer, make)  # type: ignore[no-any-return]

    def _pair_key(self, arrived: tuple[int, int]) -> int:
        return arrived[0]

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
                self._give_up()
                time.sleep(delay)
                delay = min(delay * 2, 0.25)

    def _wait_for(self, peer: int) -> ShmPair:
        arrived = self._take([(peer, _TOWARD_ACCEPTOR), (peer, _TOWARD_CONNECTOR)])
        if arrived is None:
            raise TransportError(
                f"rank {peer} did not connect to rank {self.rank} over shared memory within "
                f"{self._timeout:g}s; check that rank {peer} is running"
            )
        inn, out = arrived
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

    def _adopt(self, conn: socket.socket, kind: int) -> Link:
        return self._setup(conn, sending=kind == _TOWARD_CONNECTOR)

    def _socket_of(self, adopted: Link) -> socket.socket:
        return adopted.sock
