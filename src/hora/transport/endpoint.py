"""What the TCP and shared-memory transports share: a listener and a table of lazy pairs.

An :class:`Endpoint` listens on one socket through a :class:`~hora.transport.listener.Listener`,
whose admission threads run hora's mutual HMAC handshake (:mod:`hora.transport.tcp.auth`) and
the transport's own set-up under one deadline, so a slow or hostile client never holds up the
others and the connecting rank never waits for the accepting rank to ask for the pair. The
handshake's context names the connecting rank, the accepting rank, a *kind* (the TCP channel, or
the shared-memory direction) and the job's store prefix; only the higher rank connects to the
lower one.

``_lazy`` is the body of every transport's ``pair``: one connection attempt per key at a time,
the finished pair kept, and a close during the attempt honoured. ``close`` is idempotent and
safe from any thread.

Every wait for a peer (its address in the store, its listener, its connection) runs in slices
of :data:`POLL_S` and asks the check given to :meth:`Endpoint.give_up_when` between them, so a
launcher that knows a member of the job is gone (an elastic round whose worker died while the
connections were being made) ends the wait in well under a second instead of at the connect
timeout.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from hora.errors import HoraError, TransportError
from hora.transport.listener import HANDSHAKE_DEADLINE_S, Listener
from hora.transport.tcp.auth import accept_handshake
from hora.transport.tcp.wire import hard_close

log = logging.getLogger(__name__)

_CONTEXT = struct.Struct("!iiB")  # connecting rank, accepting rank, kind; then the prefix

POLL_S = 0.25  # seconds between two looks at the give-up check while waiting for a peer


def gone_key(prefix: str) -> str:
    """The store key under which a launcher says, in words, that a member of the job whose
    connections are under ``prefix`` is gone: every wait for a peer under it then gives up."""
    return f"{prefix}/gone"


class KeyStore(Protocol):
    def get(self, key: str, timeout: float | None = None) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


def gone_check(store: KeyStore, prefix: str) -> Callable[[], str | None]:
    """A give-up check for :meth:`Endpoint.give_up_when`: what the launcher wrote under
    :func:`gone_key`, or None while nothing is written (or the store cannot say)."""
    key = gone_key(prefix)

    def check() -> str | None:
        try:
            if store.check([key]):
                return store.get(key, timeout=1.0).decode(errors="replace")
        except HoraError:
            pass
        return None

    return check


def get_within(
    store: KeyStore, key: str, timeout: float, give_up: Callable[[], None] | None = None
) -> bytes:
    """``store.get(key)`` waiting up to ``timeout`` seconds in slices, calling ``give_up``
    (which raises to end the wait) between them. Raises the store's error on timeout."""
    if give_up is None:
        return store.get(key, timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            return store.get(key, timeout=max(min(left, POLL_S), 0.05))
        except HoraError:
            if left <= POLL_S:
                raise
        give_up()


class Endpoint:
    """The listener and pair table of rank ``rank``; subclasses set the class attributes and
    :meth:`_adopt` (what an admitted connection becomes) and :meth:`_socket_of`."""

    TAG = b""  # first bytes of every handshake context, naming the transport and its version
    KINDS: tuple[int, ...] = ()  # the kinds a connection may announce
    WHAT = ""  # the transport in log and error messages ("TCP", "shared-memory")

    def __init__(
        self,
        rank: int,
        size: int,
        secret: bytes,
        prefix: str,
        timeout: float,
        handshake_timeout: float = HANDSHAKE_DEADLINE_S,
    ) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside [0, size={size})")
        if not secret:
            raise ValueError("the job secret must be a non-empty bytes value")
        self.rank = rank
        self.size = size
        self._secret = bytes(secret)
        self._prefix = prefix
        self._timeout = timeout
        self._gone: Callable[[], str | None] | None = None
        self._lock = threading.Condition()
        self._pairs: dict[Any, Any] = {}
        self._arrived: dict[tuple[int, int], Any] = {}  # (peer, kind) -> what _adopt made
        self._connecting: dict[Any, threading.Lock] = {}
        self._closed = False
        self._handshake_timeout = handshake_timeout
        self._listener: Listener | None = None
        self._log = logging.getLogger(type(self).__module__)  # the concrete transport's logger

    def _listen(self, sock: socket.socket, thread_name: str) -> None:
        self._listener = Listener(
            sock,
            self._handshake,
            self._arrive,
            f"rank {self.rank}: {self.WHAT} listener",
            self._log,
            deadline=self._handshake_timeout,
            rejection=f"rank {self.rank}: dropped a {self.WHAT} connection from %s: %s",
        )
        self._listener.start(thread_name)

    @property
    def handshake_timeout(self) -> float:
        """Seconds an incoming connection has for its whole handshake."""
        return self._handshake_timeout

    @property
    def listener(self) -> Listener | None:
        return self._listener

    def _context(self, src: int, dst: int, kind: int) -> bytes:
        return self.TAG + _CONTEXT.pack(src, dst, kind) + self._prefix.encode()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"the {self.WHAT} transport of rank {self.rank} is closed")

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"peer must be another rank in [0, {self.size}), got {peer}")

    def give_up_when(self, gone: Callable[[], str | None]) -> None:
        """Have every wait for a peer end with a :class:`TransportError` as soon as ``gone()``
        returns a reason (it is asked every :data:`POLL_S` seconds while waiting)."""
        self._gone = gone

    def _give_up(self) -> None:
        """Raise if the check given to :meth:`give_up_when` says a member of the job is gone."""
        why = self._gone() if self._gone is not None else None
        if why:
            raise TransportError(
                f"rank {self.rank} stopped waiting for its {self.WHAT} connections: {why}"
            )

    # -- the pair table ---------------------------------------------------------------------
    def _lazy(self, key: Any, make: Callable[[], Any]) -> Any:
        """The pair under ``key``, made by ``make()`` on the first call (one attempt at once)."""
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
            made = make()
            with self._lock:
                closed = self._closed
                if not closed:
                    self._pairs[key] = made
            if closed:
                made.close()
                self._check_open()
            return made

    def _pair_key(self, arrived: tuple[int, int]) -> Any:
        """The pair-table key a connection of ``(peer, kind)`` belongs to."""
        return arrived

    def _take(self, keys: list[tuple[int, int]]) -> list[Any] | None:
        """The admitted connections under ``keys`` once all have arrived (removed from the
        table), or None after the connect timeout. Raises if the transport closes meanwhile."""
        deadline = time.monotonic() + self._timeout
        while True:
            left = deadline - time.monotonic()
            with self._lock:
                ready = self._lock.wait_for(
                    lambda: all(k in self._arrived for k in keys) or self._closed,
                    max(min(left, POLL_S), 0.0),
                )
                self._check_open()
                if ready:
                    return [self._arrived.pop(k) for k in keys]
            if left <= POLL_S:
                return None
            self._give_up()

    # -- admission (on the listener's threads) ---------------------------------------------
    def _parse_context(self, context: bytes) -> tuple[int, int]:
        head = len(self.TAG) + _CONTEXT.size
        if not context.startswith(self.TAG) or len(context) < head:
            raise ValueError(f"not a hora {self.WHAT} connection")
        src, dst, kind = _CONTEXT.unpack(context[len(self.TAG) : head])
        if context[head:] != self._prefix.encode():
            raise ValueError(f"connection for another job generation {context[head:]!r}")
        if dst != self.rank or not self.rank < src < self.size or kind not in self.KINDS:
            raise ValueError(f"rank {src} -> rank {dst} kind {kind} is not expected here")
        return src, kind

    def _adopt(self, conn: socket.socket, kind: int) -> Any:
        """What an authenticated connection of ``kind`` becomes (kept until a pair takes it)."""
        raise NotImplementedError

    def _socket_of(self, adopted: Any) -> socket.socket:
        return adopted  # type: ignore[no-any-return]

    def _handshake(self, conn: socket.socket, addr: Any) -> tuple[tuple[int, int], Any]:
        """Authenticate ``conn`` and set it up: its ``(peer, kind)`` and what it became."""
        key = accept_handshake(conn, self._secret, self._parse_context, self._handshake_timeout)
        return key, self._adopt(conn, key[1])

    def _arrive(
        self, conn: socket.socket, addr: Any, admitted: tuple[tuple[int, int], Any]
    ) -> None:
        """Keep an admitted connection until its pair takes it (a duplicate is dropped)."""
        key, adopted = admitted
        with self._lock:
            duplicate = key in self._arrived or self._pair_key(key) in self._pairs
            if not self._closed and not duplicate:
                self._arrived[key] = adopted
                self._lock.notify_all()
                return
        if duplicate:
            self._log.warning(
                "rank %d: dropped a second connection from rank %d", self.rank, key[0]
            )
        hard_close(self._socket_of(adopted))

    def close(self) -> None:
        """Close every pair, pending connection and the listener. Idempotent, any thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pairs = list(self._pairs.values())
            socks = [self._socket_of(a) for a in self._arrived.values()]
            self._arrived.clear()
            self._lock.notify_all()
        if self._listener is not None:
            self._listener.close()
        for sock in socks:
            hard_close(sock)
        for pair in pairs:
            pair.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
