"""RendezvousServer: the job's key-value store, run by the launcher (or the elastic driver).

Holds ``str -> bytes`` pairs in memory. Clients set keys, block until keys exist, and count with
atomic ``add``. Blocking reads wait on a condition variable that every write notifies.

Threads: ``start`` runs a :class:`~hora.transport.listener.Listener`: one daemon thread accepting
connections and one daemon thread per client connection (handshake under the listener's
deadline, then requests in order). All state sits behind one lock; the server is thread-safe and
``stop`` may be called from any thread. A client that fails the handshake or sends a malformed
frame is logged (rate-limited) and dropped; the server keeps serving the others.
"""

from __future__ import annotations

import logging
import math
import socket
import threading

from hora.ratelog import RateLimitedLog
from hora.rendezvous.protocol import (
    ADD,
    CHECK,
    DELETE,
    ERROR,
    GET,
    OK,
    SET,
    STORE_CONTEXT,
    TIMEOUT,
    WAIT,
    Request,
    decode_request,
    encode_reply,
    recv_frame,
    send_frame,
)
from hora.transport.listener import HANDSHAKE_DEADLINE_S, MAX_PENDING, Listener, peer_name
from hora.transport.tcp.auth import accept_handshake
from hora.transport.tcp.wire import configure, hard_close

log = logging.getLogger(__name__)


def _check_context(context: bytes) -> None:
    if context != STORE_CONTEXT:
        raise ValueError(f"not a rendezvous client ({context[:40]!r})")


class RendezvousServer:
    """An authenticated key-value store on ``host:port`` (port 0: pick a free one)."""

    def __init__(
        self,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        handshake_timeout: float = HANDSHAKE_DEADLINE_S,
        max_pending: int = MAX_PENDING,
    ) -> None:
        if not secret:
            raise ValueError("the rendezvous secret must be a non-empty bytes value")
        self._secret = bytes(secret)
        self._host = host
        self._port = port
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._clients: set[socket.socket] = set()
        self._listener: Listener | None = None
        self._handshake_timeout = handshake_timeout
        self._max_pending = max_pending
        self._stopped = False
        self._bad = RateLimitedLog(log, "dropped store connections")

    @property
    def port(self) -> int:
        return self._port

    @property
    def host(self) -> str:
        """The address the store listens on."""
        return self._host

    @property
    def listener(self) -> Listener | None:
        return self._listener

    def start(self) -> int:
        """Listen and serve on daemon threads; return the bound port."""
        if self._listener is not None:
            return self._port
        sock = socket.create_server((self._host, self._port), backlog=256)
        self._port = int(sock.getsockname()[1])
        self._listener = Listener(
            sock,
            self._handshake,
            self._serve,
            "rendezvous store",
            log,
            deadline=self._handshake_timeout,
            max_pending=self._max_pending,
            rejection="rendezvous store: rejected a connection from %s: %s",
        )
        self._listener.start("hora-store-accept")
        log.debug("rendezvous store listening on %s:%d", self._host, self._port)
        return self._port

    def put(self, key: str, value: bytes) -> None:
        """Set ``key`` from the process that runs the store (no connection); thread-safe."""
        with self._changed:
            self._data[key] = value
            self._changed.notify_all()

    def stop(self) -> None:
        """Stop serving: close the listener and every client connection. Idempotent."""
        with self._changed:
            if self._stopped:
                return
            self._stopped = True
            socks = list(self._clients)
            self._changed.notify_all()
        if self._listener is not None:
            self._listener.close()
        for sock in socks:
            hard_close(sock)
        self._bad.flush(final=True)

    def __enter__(self) -> RendezvousServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _handshake(self, conn: socket.socket, addr: tuple[str, int]) -> None:
        accept_handshake(conn, self._secret, _check_context, self._handshake_timeout)
        configure(conn)

    def _serve(self, conn: socket.socket, addr: tuple[str, int], _: None) -> None:
        """Answer an admitted client's requests in order until it leaves (its own thread)."""
        with self._lock:
            if self._stopped:
                hard_close(conn)
                return
            self._clients.add(conn)
        peer = peer_name(addr)
        try:
            while not self._stopped:
                try:
                    body = recv_frame(conn)
                except EOFError:
                    return
                try:
                    reply = self._execute(decode_request(body))
                except ValueError as e:
                    self._bad.warning("rendezvous store: bad request from %s: %s", peer, e)
                    reply = encode_reply(ERROR, 0, str(e).encode())
                send_frame(conn, reply)
        except (OSError, ValueError) as e:
            if not self._stopped:
                self._bad.warning("rendezvous store: dropped the connection from %s: %s", peer, e)
        finally:
            with self._lock:
                self._clients.discard(conn)
            conn.close()

    def _execute(self, req: Request) -> bytes:
        """Run one request under the store lock and return the encoded reply."""
        keys = req.keys
        if req.op in (SET, GET, ADD, DELETE) and len(keys) != 1:
            raise ValueError(f"operation {req.op} takes exactly one key, got {len(keys)}")
        timeout = req.timeout if math.isfinite(req.timeout) and req.timeout >= 0 else None
        with self._changed:
            if req.op == SET:
                self._data[keys[0]] = req.value
                self._changed.notify_all()
                return encode_reply(OK)
            if req.op == ADD:
                old = self._data.get(keys[0], b"0")
                try:
                    total = int(old) + req.number
                except ValueError:
                    raise ValueError(f"key {keys[0]!r} does not hold an integer") from None
                self._data[keys[0]] = str(total).encode()
                self._changed.notify_all()
                return encode_reply(OK, total)
            if req.op == DELETE:
                return encode_reply(OK, int(self._data.pop(keys[0], None) is not None))
            if req.op == CHECK:
                return encode_reply(OK, int(all(k in self._data for k in keys)))
            present = self._changed.wait_for(
                lambda: self._stopped or all(k in self._data for k in keys), timeout
            )
            if self._stopped:
                raise OSError("store stopped")
            if not present:
                missing = [k for k in keys if k not in self._data]
                return encode_reply(TIMEOUT, 0, "\n".join(missing).encode())
            if req.op == WAIT:
                return encode_reply(OK)
            assert req.op == GET
            return encode_reply(OK, 0, self._data[keys[0]])
