"""Mutual HMAC-SHA256 challenge-response that every hora TCP connection runs before any data.

1. acceptor -> connector: ``b"HORA"``, version byte, 32-byte nonce ``ns``.
2. connector -> acceptor: 32-byte nonce ``nc``, context length (u16), context, and
   ``HMAC(secret, b"C" + ns + nc + context)``.
3. the acceptor checks the MAC and the context, then answers ``HMAC(secret, b"S" + ns + nc +
   context)``, which the connector checks in turn.

The secret never travels; fresh nonces on both sides stop replays; the context (for example
"rank 3 to rank 0, data channel, job prefix") is bound into both MACs so a connection cannot be
re-purposed. Used by the TCP transport and by the rendezvous store.

Both functions run on the calling thread, use a socket timeout for the whole exchange and are
thread-safe (no shared state).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Callable
from typing import TypeVar

from hora.errors import AuthenticationError
from hora.transport.tcp.wire import recv_exact

HANDSHAKE_TIMEOUT_S = 5.0
NONCE_BYTES = 32
MAX_CONTEXT = 1024
_GREETING = b"HORA\x01"
_LENGTH = struct.Struct("!H")

T = TypeVar("T")


def _mac(secret: bytes, role: bytes, ns: bytes, nc: bytes, context: bytes) -> bytes:
    return hmac.new(secret, role + ns + nc + context, hashlib.sha256).digest()


def accept_handshake(
    sock: socket.socket,
    secret: bytes,
    check: Callable[[bytes], T],
    timeout: float = HANDSHAKE_TIMEOUT_S,
) -> T:
    """Authenticate the connector on an accepted socket and return ``check(context)``.

    ``check`` parses the connector's context and raises ValueError if it is not acceptable.
    Raises AuthenticationError (the caller closes the socket) on any failure.
    """
    sock.settimeout(timeout)
    try:
        ns = os.urandom(NONCE_BYTES)
        sock.sendall(_GREETING + ns)
        nc = recv_exact(sock, NONCE_BYTES)
        (length,) = _LENGTH.unpack(recv_exact(sock, _LENGTH.size))
        if length > MAX_CONTEXT:
            raise AuthenticationError(f"handshake context of {length} bytes is too long")
        context = recv_exact(sock, length)
        mac = recv_exact(sock, hashlib.sha256().digest_size)
        if not hmac.compare_digest(mac, _mac(secret, b"C", ns, nc, context)):
            raise AuthenticationError("wrong HMAC: the connector does not know the job secret")
        try:
            result = check(context)
        except ValueError as e:
            raise AuthenticationError(f"unexpected handshake context: {e}") from e
        sock.sendall(_mac(secret, b"S", ns, nc, context))
    except (OSError, EOFError) as e:
        raise AuthenticationError(f"handshake failed: {e or type(e).__name__}") from e
    sock.settimeout(None)
    return result


def connect_handshake(
    sock: socket.socket, secret: bytes, context: bytes, timeout: float = HANDSHAKE_TIMEOUT_S
) -> None:
    """Prove knowledge of ``secret`` to the acceptor and check that it knows it too."""
    if len(context) > MAX_CONTEXT:
        raise ValueError(f"handshake context must be at most {MAX_CONTEXT} bytes")
    sock.settimeout(timeout)
    try:
        greeting = recv_exact(sock, len(_GREETING))
        if greeting != _GREETING:
            raise AuthenticationError(f"the remote end is not a hora endpoint (got {greeting!r})")
        ns = recv_exact(sock, NONCE_BYTES)
        nc = os.urandom(NONCE_BYTES)
        mac = _mac(secret, b"C", ns, nc, context)
        sock.sendall(nc + _LENGTH.pack(len(context)) + context + mac)
        try:
            answer = recv_exact(sock, len(mac))
        except EOFError as e:
            raise AuthenticationError(
                "the remote end closed the connection during the handshake "
                "(different job secret, or a connection it did not expect)"
            ) from e
        if not hmac.compare_digest(answer, _mac(secret, b"S", ns, nc, context)):
            raise AuthenticationError("the remote end does not know the job secret")
    except (OSError, EOFError) as e:
        raise AuthenticationError(f"handshake failed: {e or type(e).__name__}") from e
    sock.settimeout(None)
