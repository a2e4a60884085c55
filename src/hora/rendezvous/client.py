"""StoreClient: a rank's (or the launcher's) handle on the rendezvous store.

Each call borrows an authenticated connection from a small pool (opening one when none is
idle), sends one request and reads its reply, so threads never wait for each other's blocking
``get``. Opening a connection retries for up to ``timeout`` seconds, because workers may start
before the store. Thread-safe; ``close`` from any thread also interrupts calls in progress.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable

from hora.errors import AuthenticationError, RendezvousError
from hora.rendezvous.protocol import (
    ADD,
    CHECK,
    DELETE,
    ERROR,
    GET,
    OK,
    OP_NAMES,
    SET,
    STORE_CONTEXT,
    WAIT,
    Request,
    decode_reply,
    encode_request,
    recv_frame,
    send_frame,
)
from hora.transport.tcp.auth import connect_handshake
from hora.transport.tcp.wire import configure, hard_close


class StoreClient:
    """Client of the store at ``host:port`` that authenticates with ``secret``."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: float = 30.0) -> None:
        if not secret:
            raise ValueError("the rendezvous secret must be a non-empty bytes value")
        if not 0 < port < 65536:
            raise ValueError(f"rendezvous port must be in 1..65535, got {port}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.host = host
        self.port = port
        self.timeout = timeout
        self._secret = bytes(secret)
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._open: set[socket.socket] = set()
        self._closed = False
        self._release(self._connect())

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # -- operations --------------------------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"store values are bytes, got {type(value).__name__} for {key!r}")
        self._call(Request(SET, [_key(key)], bytes(value)))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` (default: the client's) for it."""
        wait = self._wait_time(timeout)
        status, _, value = self._call(Request(GET, [_key(key)], timeout=wait), wait)
        if status != OK:
            raise RendezvousError(
                f"key {key!r} was not set within {wait:g}s in the rendezvous store at "
                f"{self.address}; check that every rank of the job started and reached this point"
            )
        return value

    def add(self, key: str, delta: int) -> int:
        """Atomically add ``delta`` to the integer at ``key`` (0 if absent); return the sum."""
        if not isinstance(delta, int):
            raise TypeError(f"delta must be an int, got {type(delta).__name__}")
        return self._call(Request(ADD, [_key(key)], number=delta))[1]

    def check(self, keys: list[str]) -> bool:
        """True when every key in ``keys`` exists (no waiting)."""
        return bool(self._call(Request(CHECK, _keys(keys)))[1])

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it existed."""
        return bool(self._call(Request(DELETE, [_key(key)]))[1])

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """Block until every key in ``keys`` exists, at most ``timeout`` seconds."""
        wait = self._wait_time(timeout)
        status, _, missing = self._call(Request(WAIT, _keys(keys), timeout=wait), wait)
        if status != OK:
            raise RendezvousError(
                f"keys {missing.decode().splitlines()} were not set within {wait:g}s in the "
                f"rendezvous store at {self.address}"
            )

    def close(self) -> None:
        """Close every connection, interrupting calls in progress. Idempotent."""
        with self._lock:
            self._closed = True
            socks = list(self._open)
            self._open.clear()
            self._idle.clear()
        for sock in socks:
            hard_close(sock)

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- connections -------------------------------------------------------------------------

    def _wait_time(self, timeout: float | None) -> float:
        wait = self.timeout if timeout is None else float(timeout)
        if not wait >= 0:
            raise ValueError(f"timeout must be >= 0, got {timeout}")
        return wait

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        delay = 0.02
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection((self.host, self.port), max(remaining, 0.1))
                break
            except OSError as e:
                if remaining <= 0 or self._closed:
                    raise RendezvousError(
                        f"could not reach the rendezvous store at {self.address} within "
                        f"{self.timeout:g}s ({e}); check that the launcher is running, that "
                        "this host can reach that address and that no firewall blocks the port"
                    ) from e
                time.sleep(min(delay, max(remaining, 0.0)))
                delay = min(delay * 2, 1.0)
        try:
            connect_handshake(sock, self._secret, STORE_CONTEXT, min(self.timeout, 10.0))
        except AuthenticationError as e:
            sock.close()
            raise RendezvousError(
                f"the rendezvous store at {self.address} did not accept this process: {e}; "
                "check that the job secret (HORA_SECRET) is the launcher's"
            ) from e
        configure(sock)
        return sock

    def _acquire(self) -> socket.socket:
        with self._lock:
            if self._closed:
                raise RendezvousError(f"the client of the store at {self.address} is closed")
            if self._idle:
                return self._idle.pop()
        sock = self._connect()
        with self._lock:
            self._open.add(sock)
        return sock

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._open.add(sock)
                self._idle.append(sock)
                return
        sock.close()

    def _call(self, req: Request, wait: float = 0.0) -> tuple[int, int, bytes]:
        sock = self._acquire()
        try:
            sock.settimeout(self.timeout + wait)
            send_frame(sock, encode_request(req))
            status, number, value = decode_reply(recv_frame(sock))
        except (OSError, EOFError, ValueError) as e:
            with self._lock:
                self._open.discard(sock)
            sock.close()
            raise RendezvousError(
                f"lost the connection to the rendezvous store at {self.address} during "
                f"{OP_NAMES[req.op]}: {e or type(e).__name__}"
            ) from e
        self._release(sock)
        if status == ERROR:
            raise RendezvousError(
                f"the rendezvous store at {self.address} refused {OP_NAMES[req.op]} "
                f"{req.keys}: {value.decode(errors='replace')}"
            )
        return status, number, value


def _key(key: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"store keys are str, got {type(key).__name__}")
    return key


def _keys(keys: Iterable[str]) -> list[str]:
    if isinstance(keys, str):
        raise TypeError("pass a list of keys, not one str")
    return [_key(k) for k in keys]
